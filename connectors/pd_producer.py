"""Producer methods of the P/D connector's worker (PDConnectorWorker mixes them in; split from
pd_connector.py like the ZMQ pipe's peer side): ship each layer's new blocks as it is
computed, skip what the consumer's own prefix cache holds, and send the FIN after them.

Decode-side prefix reuse: when the producer first schedules a request it sends an OFFER; the
consumer answers (as soon as it admitted the request) with a HOLD naming the prompt tokens its
own prefix cache covers, and the producer ships only the blocks after them. Layers computed
before the answer came go at once past ``SendKV.expect_held`` (the proxy's view of what the
consumer holds); the ones before it are deferred (the producer's blocks stay pinned until the
consumer's ACK, so their KV is still there) and sent when it comes, or in full after
``OFFER_WAIT`` of the transfer timeout; the consumer drops any block it holds, so a late
answer costs bytes, never correctness. A FIN goes after its request's deferred layers and
once their sends settled. Only the engine thread calls these, except _record_hold (the receiver thread).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import wait
from typing import Any

import torch

from connectors.group_tables import spec_for_layer
from connectors.granted_writes import granted_targets, route_is_whole, written_head
from connectors.metadata import FinHeader, KVWrittenHeader, OfferHeader, SendSpec, encode_header
from connectors.pipes.base import PipeError
from connectors.staged_writes import staged_offset
from connectors.tp_topology import num_feeders, split_endpoint
from connectors.window_shipping import first_shipped_token
from pd_cluster import ttft_trace

logger = logging.getLogger("connectors.pd_connector")
OFFER_WAIT = 0.5  # of kv_transfer_timeout: how long layers wait for the consumer's HOLD


class PDProducer:
    """Producer half of PDConnectorWorker (its __init__ sets the attributes used here)."""

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        if self._meta is None or not self._meta.sends:
            return
        if self._deferred:
            self._flush_deferred()
        last = self.num_target_layers - 1  # the draft's layers go later (draft_layers.py)
        if layer in (0, last) and ttft_trace.enabled():
            for spec in self._meta.sends:
                ttft_trace.mark(spec.request_id, f"layer{'0' if layer == 0 else 'N'}")
        for spec in self._meta.sends:
            if spec.request_id in self._failed_sends or not self._usable(spec.peer):
                self._failed_sends.add(spec.request_id)
                continue
            if layer < self.num_target_layers:  # the layer's own group's blocks
                spec = spec_for_layer(spec, self.layer_groups, layer)
            held = self._held_tokens(spec.request_id)
            # Written in place: nothing goes before the consumer's HOLD granted its blocks.
            if held is None and spec.expect_held is not None and not self._writes(spec.peer):
                # No answer yet: blocks past what the consumer is expected to hold go now.
                cut = min(max(spec.expect_held // self.block_size - spec.first_block, 0),
                          len(spec.block_ids))
                if cut < len(spec.block_ids):
                    self._send_unheld(dataclasses.replace(
                        spec, block_ids=spec.block_ids[cut:], first_block=spec.first_block + cut),
                        layer, kv_layer, 0)
                if cut == 0:
                    continue
                spec = dataclasses.replace(spec, block_ids=spec.block_ids[:cut])
            if held is None:  # the rest once the consumer said what it holds
                if layer == 0:
                    ttft_trace.mark(spec.request_id, "defer")
                self._deferred.setdefault(spec.request_id, []).append((layer, spec))
                continue
            self._send_unheld(spec, layer, kv_layer, held)
        if layer == last and self.config.record_timings:
            now = time.time()
            for spec in self._meta.sends:
                self.last_layer_times[spec.request_id] = now
            while len(self.last_layer_times) > 4096:
                self.last_layer_times.popitem(last=False)

    def _send_unheld(self, spec: SendSpec, layer: int, kv_layer: torch.Tensor,
                     held: int) -> None:
        """Send ``layer`` of the spec's blocks the consumer's cache does not hold, and of a
        sliding-window layer only those its decodes can read (window_shipping.py). A draft
        model's layer (draft_layers.py) sends every one of its own blocks, to one rank whole."""
        draft = layer >= self.num_target_layers
        if draft:
            spec, held = self._draft_spec(spec), 0
        held = max(held, first_shipped_token(spec.num_prompt_tokens, self.windows[layer],
                                             self.block_size)) if not draft else 0
        skip = max(0, held // self.block_size - spec.first_block)
        if skip >= len(spec.block_ids):
            return
        if skip:
            spec = dataclasses.replace(spec, block_ids=spec.block_ids[skip:],
                                       first_block=spec.first_block + skip)
        for endpoint, r in self._routes.get(spec.peer, []):
            if self._writes_into(endpoint):
                if not self._write_layer(spec, layer, endpoint, r, kv_layer):
                    break
            elif not self._send_layer(spec, layer, endpoint,
                                      self.sender.layer_messages(spec, layer, kv_layer, None
                                                                 if draft else
                                                                 (r.src, r.count, r.dst))):
                break

    def _writes_into(self, endpoint: str) -> bool:
        """Blocks for this consumer rank are written in place (else sent): the pipe's, or
        with pipe auto the link's (auto_pipe.py)."""
        writes_to = getattr(self.pipe, "writes_to", None)
        return self._in_place and (writes_to is None or writes_to(endpoint))

    def _writes(self, peer: str) -> bool:
        return any(self._writes_into(ep) for ep, _ in self._routes.get(peer, [])) or (
            self._in_place and not self._routes.get(peer))

    def _write_layer(self, spec: SendSpec, layer: int, endpoint: str, route: Any,
                     kv_layer: torch.Tensor) -> bool:
        """Pipes that write in place: the layer's blocks into the ones the consumer granted
        (granted_writes.py); no grant (or past its cutoff) fails the request: recomputed."""
        rid = spec.request_id
        if layer >= self.num_target_layers:
            return self._write_draft_layer(spec, layer, endpoint, kv_layer)
        if not route_is_whole(route, kv_layer):
            return self._write_failed(spec, f"layer {layer}", ValueError(
                "a write carries whole blocks: both engines need the same KV heads per rank "
                "(TP size)"))
        grant = self.grants.get(endpoint, rid, layer)
        if grant is None:
            return self._write_failed(spec, f"layer {layer}", ValueError(
                "no grant from the consumer (or its cutoff passed)"))
        return self._write_into(spec, layer, endpoint, kv_layer, grant, "layer") is not None

    def _write_into(self, spec: SendSpec, layer: int, endpoint: str, kv_layer: torch.Tensor,
                    grant: Any, what: str) -> int | None:
        """Write ``spec``'s blocks of ``layer`` into the consumer's ``grant``
        (granted_writes.py): the bytes written, or None when the write failed (the request
        is failed: recomputed)."""
        rid = spec.request_id
        try:
            targets = granted_targets(grant, spec.first_block, len(spec.block_ids))
            # a fragmented grant: through the consumer's staging range (staged_writes.py)
            at = staged_offset(self.pipe, self.staging_ranges, endpoint, rid, layer,
                               spec.block_ids, targets)
            header = KVWrittenHeader(rid, layer, spec.first_block, len(spec.block_ids),
                                     staged_at=at)
            future = self.pipe.write_blocks(endpoint, layer, kv_layer, spec.block_ids,
                                            targets, written_head(header),
                                            **({"staged_at": at} if at >= 0 else {}))
        except (ValueError, PipeError) as e:
            self._write_failed(spec, f"{what} {layer}", e)
            return None
        self._step_futures.append((rid, spec.peer, future))
        self.leases.sending(rid)
        nbytes = kv_layer[:, 0].nbytes * len(spec.block_ids)
        self.bytes_sent += nbytes
        return nbytes

    def _write_failed(self, spec: SendSpec, what: str, error: Exception) -> bool:
        """A write that failed fails its request (recomputed); a pipe error breaks the link."""
        logger.error("write of %s %s failed: %s", spec.request_id, what, error)
        self._failed_sends.add(spec.request_id)
        if isinstance(error, PipeError):
            self._broken.add(spec.peer)
        return False

    # ---- producer: what the consumer holds (decode-side prefix reuse) --------------------
    def _offer(self, spec: SendSpec) -> None:
        """Ask the consumer which prompt tokens it holds (answered by a HoldHeader)."""
        self._offered[spec.request_id] = (time.monotonic()
                                          + OFFER_WAIT * self.config.kv_transfer_timeout)
        if not self._usable(spec.peer):
            return
        if not self._routes.get(spec.peer):  # this rank feeds none of its ranks: no answer
            self._record_hold(spec.request_id, 0)
        for endpoint, _ in self._routes.get(spec.peer, []):
            try:
                self.sender.send(endpoint, encode_header(OfferHeader(spec.request_id)), None)
            except PipeError as e:
                logger.error("offer of %s failed: %s", spec.request_id, e)
                self._failed_sends.add(spec.request_id)
                self._broken.add(spec.peer)
                return

    def _held_tokens(self, request_id: str) -> int | None:
        """Prompt tokens the consumer holds; None while its answer may still come (after the
        wait, 0: everything is sent and the consumer drops what it holds)."""
        with self._holds_lock:
            held = self._holds.get(request_id)
        if held is not None:
            return held
        deadline = self._offered.get(request_id)
        return 0 if deadline is None or time.monotonic() > deadline else None

    def _send_ready_fins(self) -> None:
        """A FIN goes once its layers went out and their sends settled (a failed one turns
        it into "recompute"), in FIN order."""
        ready = [f for rid, f in self._waiting_fins.items() if rid not in self._deferred]
        if ready:
            self._settle_sends()
            for fin in ready:
                del self._waiting_fins[fin.request_id]
                self._send_fin(fin)

    def _flush_deferred(self) -> None:
        """Send deferred layers whose consumer answered (or stopped being waited for)."""
        for rid in list(self._deferred):
            held = self._held_tokens(rid)
            if held is None:
                continue
            ttft_trace.mark(rid, "flush", held=held)
            for layer, spec in self._deferred.pop(rid):
                if rid not in self._failed_sends:
                    self._send_unheld(spec, layer, self.kv_caches[layer], held)

    def _send_layer(self, spec: Any, layer: int, endpoint: str, msgs: list) -> bool:
        for msg in msgs:
            try:
                future = self.sender.send_layer(endpoint, msg)
            except PipeError as e:
                logger.error("send of %s layer %d failed: %s", spec.request_id, layer, e)
                self._failed_sends.add(spec.request_id)
                self._broken.add(spec.peer)
                return False
            self._step_futures.append((spec.request_id, spec.peer, future))
            self.leases.sending(spec.request_id)
            self.bytes_sent += msg.tensor.nbytes
            if layer >= self.num_target_layers:
                self.draft_bytes_sent += msg.tensor.nbytes
        return True

    def wait_for_save(self) -> None:
        """Every payload sent so far released by the pipe: zero-copy views point into the
        cache, which the next forward may write (the engine calls this before it). A send
        that failed, or is still pending after the timeout, fails its request: the FIN tells
        the consumer to recompute at once."""
        if self._deferred:  # answers that came meanwhile: send before waiting
            self._flush_deferred()
        self._settle_sends()

    def _settle_sends(self) -> None:
        if not self._step_futures:
            return
        done, pending = wait([f for _, _, f in self._step_futures],
                             timeout=self.config.kv_transfer_timeout)
        if ttft_trace.enabled():
            for rid in {rid for rid, _, _ in self._step_futures}:
                ttft_trace.mark(rid, "saved")
        bad = [(rid, peer) for rid, peer, f in self._step_futures
               if f in pending or f.cancelled() or f.exception() is not None]
        if pending:
            self.num_send_timeouts += 1
            logger.error("%d KV sends still pending after %.1fs", len(pending),
                         self.config.kv_transfer_timeout)
        elif bad:
            logger.error("KV sends of %s failed: %s", sorted({r for r, _ in bad}), next(
                f.exception() for _, _, f in self._step_futures if f in done
                and not f.cancelled() and f.exception() is not None))
        self._failed_sends.update(rid for rid, _ in bad)
        self._broken.update(peer for _, peer in bad)
        self._step_futures = []

    def _send_fin(self, fin: Any) -> None:
        ok = fin.request_id not in self._failed_sends and fin.first_token is not None
        ttft_trace.mark(fin.request_id, "fin")
        # its draft layers went too (all of them: none dropped for want of a grant)
        draft = fin.request_id in self._draft_sent and fin.request_id not in self._draft_dropped
        state = self._draft_states.pop(fin.request_id, b"") if draft else b""
        self._draft_states.pop(fin.request_id, None)
        self._draft_sent.discard(fin.request_id)
        self._draft_dropped.discard(fin.request_id)
        self.draft_grants.drop(fin.request_id)
        self._failed_sends.discard(fin.request_id)
        self._offered.pop(fin.request_id, None)
        self.grants.drop(fin.request_id)
        self.staging_ranges.drop(fin.request_id)
        with self._holds_lock:
            self._holds.pop(fin.request_id, None)
        routes = self._routes.get(fin.peer, []) if self._usable(fin.peer) else []
        if not routes:  # no consumer can answer (or this rank fed none of its ranks): free now
            self.leases.drop(fin.request_id)
            return
        if ok:  # held before the FINs leave: the answers can come back before send returns
            self.leases.hold(fin.request_id, len(routes))
        n_ranks = len(split_endpoint(fin.peer))
        for endpoint, r in routes:
            header = FinHeader(fin.request_id, fin.first_token if ok else None,
                               fin.num_prompt_tokens, self.config.lease_seconds, num_feeders(
                                   r.dst_rank, self.tp_size, n_ranks, self.hello["num_kv_heads"]),
                               draft, state)
            try:
                self.sender.send(endpoint, encode_header(header), None)
                self.bytes_sent += len(state)  # mtp's hidden state: draft bytes too
                self.draft_bytes_sent += len(state)
            except PipeError as e:
                logger.error("FIN for %s failed: %s", fin.request_id, e)
                ok = False
        if not ok:  # a failed transfer's FIN makes the consumer recompute: nothing reads ours
            self.leases.drop(fin.request_id)

    def _record_hold(self, request_id: str, num_tokens: int) -> None:
        ttft_trace.mark(request_id, "hold", n=num_tokens)
        with self._holds_lock:
            self._holds[request_id] = num_tokens
            while len(self._holds) > 4096:  # answers to requests already finished here
                self._holds.popitem(last=False)

