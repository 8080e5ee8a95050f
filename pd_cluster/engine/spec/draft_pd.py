"""The draft model's KV through P/D (speculative ``draft_model``), the engine's side;
the wire (layers after the target's, who ships where) is connectors/draft_layers.py.

Prefill engine (requests with SendKV): when the connector first plans a request's send, the
draft's blocks for its whole prompt are taken (all or none: a request ships all of its prompt's
draft KV or none of it, never a part the decode engine would have to complete). After each
step's forward the draft runs the step's prompt chunk of each such request (positions it has
not run yet: P's prefix-cache hits too, the draft's pool has none) and the connector ships its
layers. The blocks go back once the request left the scheduler (its send acknowledged).

Decode engine (requests with RecvKV): the proposer reserves the prompt's draft blocks when the
request is admitted to wait for its KV (RecvSpec.draft_block_ids); at its first proposal it
starts after the prompt if the draft KV landed, else it runs the draft's prefill itself (a
producer that sent none, a failed transfer, a full draft pool): nothing is lost either way.

The MTP layer's KV (speculative ``mtp``) takes the same path: mtp_pd.py runs the layer's
prefill instead of a draft model's (``_prefill``) and adds the hidden state its FIN carries.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connectors.transfer_params import RecvKV, SendKV
from pd_cluster.engine.spec.draft_runner import Chunk
from pd_cluster.request import Request


@dataclass
class _Shipping:
    request: Request  # identity: a request id used again is another request
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # prompt positions whose draft KV is in ``blocks``


class DraftKVThroughPD:
    def __init__(self, proposer: Any, worker: Any, scheduler_connector: Any,
                 state_bytes: int = 0) -> None:
        """``proposer``: a DraftModelProposer (or mtp_pd.py's HiddenStateProposer);
        ``state_bytes``: what each FIN carries besides the KV (mtp_pd.py)."""
        self.proposer, self.runner, self.worker = proposer, proposer.runner, worker
        worker.register_draft_caches(self.runner.kv_caches, state_bytes)
        scheduler_connector.draft_blocks = self.draft_blocks
        proposer.landed = worker.take_draft_landed
        self.shipping: dict[str, _Shipping] = {}

    def draft_blocks(self, request: Request) -> tuple[int, ...]:
        """The draft's blocks for the request's prompt (the connector asks once per request):
        reserved on a decode engine, taken for the draft's prefill on a prefill engine; ()
        when its draft KV does not move."""
        params = request.kv_transfer_params
        if isinstance(params, RecvKV):
            return self.proposer.reserve(request) if self.worker.takes_draft() else ()
        if not isinstance(params, SendKV) or not self.worker.ships_draft_to(params.to):
            return ()
        self._drop(request.request_id)
        state = _Shipping(request)
        if not self.runner.grow(state.blocks, request.num_prompt_tokens):
            return ()
        self.shipping[request.request_id] = state
        return tuple(state.blocks)

    def after_forward(self, out: Any) -> None:
        """Prefill engine, after the step's forward: the draft's prefill of the step's chunks
        of requests whose draft KV ships, then its layers to the consumers."""
        meta = out.kv_connector_metadata
        sends = [s for s in meta.sends if s.draft_block_ids] if meta is not None else []
        if not sends:
            return
        planned = {s.request_id for s in sends}
        todo: list[tuple[_Shipping, Any, int]] = []
        for item in out.scheduled:
            request = item.request
            state = self.shipping.get(request.request_id)
            if state is None or state.request is not request or request.request_id not in planned:
                continue
            # As the connector planned the send (pd_scheduler.build_connector_meta).
            end = min(request.num_computed_tokens + item.num_new_tokens,
                      request.num_prompt_tokens)
            if end > state.computed:
                todo.append((state, item, end))
        if todo:
            self._prefill(todo, out)
        self.worker.save_draft_layers(sends, self.runner.kv_caches)

    def _prefill(self, todo: list[tuple[_Shipping, Any, int]], out: Any) -> None:
        """The draft's prefill of prompt positions ``state.computed .. end - 1`` of each
        (state, scheduled item, end); ``state.computed`` moves to ``end``."""
        chunks: list[Chunk] = [(s.blocks, s.computed,
                                s.request.token_ids_range(s.computed, end),
                                s.request.num_prompt_tokens, False) for s, _, end in todo]
        self.runner.next_tokens(chunks)
        for state, _, end in todo:
            self.proposer.prefill_tokens += end - state.computed
            state.computed = end

    def sweep(self, requests: dict[str, Request]) -> None:
        """Give back the draft blocks of requests that left the scheduler (sent, aborted)."""
        for rid in [rid for rid, s in self.shipping.items() if requests.get(rid) is not s.request]:
            self._drop(rid)

    def _drop(self, request_id: str) -> None:
        state = self.shipping.pop(request_id, None)
        if state is not None:
            self.runner.release(state.blocks)

    def check_no_leaks(self) -> None:
        if self.shipping:
            raise AssertionError(f"draft blocks held for shipping: {sorted(self.shipping)[:10]}")
