"""A proposer's KV through P/D (speculative ``draft_model`` and ``mtp``), the worker's
side: a draft model's layers, or the MTP layer's (one layer; "draft" below means either).

The prefill engine runs the draft's prefill too (pd_cluster/engine/spec/draft_pd.py) and its
layers travel after the target's on the same pipe and links: layer indices num_layers ..
num_layers + M - 1, over the draft's own block ids (SendSpec / RecvSpec ``draft_block_ids``),
in the same messages as any layer, so the same integrity tags, in-flight budget, staging bound,
lease and byte counters cover them. The decode engine counts a request in once the draft's
layers landed as well (the FIN says whether they come); then its proposer starts from the
prompt's draft KV instead of running the draft's prefill.

Every draft block goes, whatever the decode engine's prefix cache holds: the draft's pool has
no prefix cache, so a hit on the target's blocks says nothing of the draft's.

Shipped only where one producer rank feeds one consumer rank whole (the draft runs unsharded
on rank 0: TP 1 on both sides), over a pipe that carries messages (zmq, gloo, nccl) or the
shm pipe (and auto's links): a consumer's shared cache then holds the draft's layers too and
its HOLD grants the draft's blocks beside the target's. Elsewhere (tensor parallelism, nixl,
a consumer that granted no draft blocks) the FIN says "no draft" and the decode engine runs
the draft's prefill itself, as before: nothing is lost either way.

A hidden-state proposer (mtp) needs one thing more at its first proposal: the target's hidden
state at the prompt's last position. It rides in the FIN (``FinHeader.draft_state``, under the
frame's MAC, counted in the draft bytes); the consumer checks its length (``draft_state_bytes``)
and fails the transfer closed when it is wrong. Without it (FIN "no draft") the decode engine
has no hidden states for the prompt: that request decodes without drafts (mtp_pd.py).
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from connectors.metadata import SendSpec
from connectors.tp_topology import split_endpoint

logger = logging.getLogger("connectors.pd_connector")


class DraftLayers:
    """Mixed into PDConnectorWorker (its __init__ sets num_target_layers, num_draft_layers,
    _draft_sent, draft_bytes_sent)."""

    kv_caches: list[torch.Tensor]
    receiver: Any
    tp_size: int
    num_target_layers: int
    num_draft_layers: int
    _draft_sent: set[str]
    _draft_dropped: set[str]
    _draft_in_place: bool
    _in_place: bool
    _failed_sends: set[str]
    _deferred: dict[str, list[tuple[int, SendSpec]]]
    _draft_states: dict[str, bytes]

    def register_draft_caches(self, caches: list[torch.Tensor], state_bytes: int = 0) -> None:
        """The proposer's per-layer caches, addressed as layers after the target's;
        ``state_bytes``: the length of the state its FIN carries (mtp's hidden state; 0)."""
        self.num_target_layers = self.receiver.num_layers
        self.num_draft_layers = len(caches)
        self.kv_caches = [*self.kv_caches[:self.num_target_layers], *caches]
        self.receiver.kv_caches = self.kv_caches
        self.receiver.num_draft_layers = len(caches)
        self.receiver.draft_state_bytes = state_bytes
        if self._in_place and self.tp_size == 1 and getattr(self.pipe, "adds_caches", False):
            self.pipe.register_kv_caches(self.kv_caches)  # before any handshake
            self._draft_in_place = True

    def ships_draft_to(self, peer: str) -> bool:
        """Whether a request's draft KV can go to ``peer`` (see the module's last paragraph)."""
        return (self.num_draft_layers > 0 and self.tp_size == 1
                and len(split_endpoint(peer)) == 1
                and (not self._writes(peer) or getattr(self.pipe, "adds_caches", False)))

    def takes_draft(self) -> bool:
        """Consumer: whether this rank takes a draft's KV (TP 1; written in place only where
        its shared cache holds the draft's layers)."""
        return (self.num_draft_layers > 0 and self.tp_size == 1
                and (not self._in_place or self._draft_in_place))

    def save_draft_layers(self, sends: list[SendSpec], caches: list[torch.Tensor]) -> None:
        """Producer, after the draft's prefill of this step: ship its layers of each send that
        has draft blocks (the blocks' KV is final: the draft computed up to the send's end)."""
        for spec in sends:
            rid = spec.request_id
            if not spec.draft_block_ids or rid in self._failed_sends:
                continue
            if not self._usable(spec.peer):
                self._failed_sends.add(rid)
                continue
            # Written in place: nothing goes before the consumer's HOLD granted its blocks.
            wait = self._writes(spec.peer) and self._held_tokens(rid) is None
            for j, cache in enumerate(caches):
                if wait:
                    self._deferred.setdefault(rid, []).append((self.num_target_layers + j, spec))
                else:
                    self._send_unheld(spec, self.num_target_layers + j, cache, 0)
            self._draft_sent.add(rid)

    def ship_draft_state(self, request_id: str, state: bytes) -> None:
        """Producer: what the request's FIN carries with its draft KV (mtp's hidden state)."""
        self._draft_states[request_id] = state

    def drop_draft(self, request_id: str) -> None:
        """Producer: the request's draft KV is incomplete after all (its FIN says "no draft")."""
        self._draft_dropped.add(request_id)

    def take_draft_landed(self, request_id: str) -> bytes | None:
        """Consumer: the state that came with the request's draft KV (b"" for a draft model),
        or None when its draft KV did not arrive with its target KV (asked once, when the
        request starts decoding)."""
        return self.receiver.take_draft_landed(request_id)

    def _write_draft_layer(self, spec: SendSpec, layer: int, endpoint: str,
                           kv_layer: torch.Tensor) -> bool:
        """A draft layer into the blocks the consumer granted for the draft (``spec`` over
        the draft's blocks). No such grant (a consumer that takes no draft KV in place): not
        written, and the FIN says so (the consumer runs the draft's prefill); a failed write
        fails the request like any layer's."""
        rid = spec.request_id
        grant = self.draft_grants.get(endpoint, rid)
        if grant is None:
            self._draft_dropped.add(rid)
            return True
        nbytes = self._write_into(spec, layer, endpoint, kv_layer, grant, "draft layer")
        if nbytes is None:
            return False
        self.draft_bytes_sent += nbytes
        return True

    def _draft_spec(self, spec: SendSpec) -> SendSpec:
        """The send over the draft's blocks."""
        import dataclasses
        return dataclasses.replace(spec, block_ids=spec.draft_block_ids)
