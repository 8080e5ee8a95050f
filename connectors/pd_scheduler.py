"""Scheduler half of the P/D connector: turns request state into per-step transfer plans.

kv_transfer_params on a request (set by the proxy, same request id on both engines;
connectors/transfer_params.py): SendKV(to=<consumer endpoint>) on the producer's (P) request,
RecvKV() on the consumer's (D). D's own prefix-cache hits (whole blocks) count as computed
tokens; only the rest is external and comes from P.
"""
from __future__ import annotations

from typing import Any, Callable

from connectors.base import KVConnectorBase_Scheduler
from connectors.group_tables import request_tables
from connectors.metadata import FinishSpec, KVConnectorMetadata, RecvSpec, SendSpec
from connectors.transfer_params import RecvKV, SendKV
from connectors.window_shipping import unshipped_blocks


class PDConnectorScheduler(KVConnectorBase_Scheduler):
    def __init__(self, block_size: int, windows: tuple[int | None, ...] = (),
                 whole_blocks: bool = False):
        self.block_size = block_size
        self.windows = windows  # each layer's sliding window (None: full attention)
        # Pipes that write into the consumer's blocks (nixl) ship each block once, whole: a
        # chunk ending mid-block leaves that block to the next chunk (a second write of it
        # could land before the consumer checked the first one's code).
        self.whole_blocks = whole_blocks
        self._recvs: list[RecvSpec] = []
        self._finishes: list[FinishSpec] = []
        self._cancels: list[str] = []
        self._sent_upto: dict[str, int] = {}  # producer: prompt tokens already planned to send
        # Speculative draft_model: the draft's blocks for a request's prompt, from
        # the engine (pd_cluster/engine/spec/draft_pd.py), () when its draft KV does not move;
        # None: no draft model here.
        self.draft_blocks: Callable[[Any], tuple[int, ...]] | None = None
        self._draft_ids: dict[str, tuple[int, ...]] = {}  # producer: per request, once

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        # Asynchronous even with nothing external (a full hit): token 1 comes in P's FIN.
        if isinstance(request.kv_transfer_params, RecvKV):
            return max(request.num_prompt_tokens - num_computed_tokens, 0), True
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if isinstance(request.kv_transfer_params, RecvKV):
            self._recvs.append(RecvSpec(
                request.request_id, tuple(block_ids), request.num_prompt_tokens,
                request.num_prompt_tokens - num_external_tokens,
                self.draft_blocks(request) if self.draft_blocks is not None else (),
                request_tables(request)))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        sends = []
        for item in scheduler_output.scheduled:
            request = item.request
            params = request.kv_transfer_params
            if not isinstance(params, SendKV):
                continue
            # From what was already planned (prefix-cache hits included) to this step's end.
            start = self._sent_upto.get(request.request_id, 0)
            end = min(request.num_computed_tokens + item.num_new_tokens, request.num_prompt_tokens)
            if self.whole_blocks and end < request.num_prompt_tokens:
                end -= end % self.block_size
            if end <= start:
                continue
            self._sent_upto[request.request_id] = end
            first, last = start // self.block_size, -(-end // self.block_size)
            draft = self._draft_ids.get(request.request_id)
            if draft is None and self.draft_blocks is not None:  # first plan: the whole prompt's
                draft = self._draft_ids[request.request_id] = self.draft_blocks(request)
            sends.append(SendSpec(request.request_id, params.to,
                                  tuple(request.block_ids[first:last]), first,
                                  params.expect_held, request.num_prompt_tokens,
                                  tuple(draft[first:last]) if draft else (),
                                  tuple(t[first:last] for t in request_tables(request))))
        meta = KVConnectorMetadata(sends, self._finishes, self._recvs, self._cancels)
        self._finishes, self._recvs, self._cancels = [], [], []
        return meta

    def unshipped_blocks(self, request: Any) -> int:
        """Consumer: leading prompt blocks whose sliding layers were not shipped (never to be
        registered for prefix hits here; window_shipping.py)."""
        if not isinstance(request.kv_transfer_params, RecvKV) or request_tables(request):
            return 0  # with groups, a sliding group's unshipped entries are the null block
        return unshipped_blocks(request.num_prompt_tokens, self.windows, self.block_size)

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        params = request.kv_transfer_params
        if isinstance(params, RecvKV):
            self._cancels.append(request.request_id)  # no-op for the worker if already done
            return False
        if not isinstance(params, SendKV):
            return False
        sent = self._sent_upto.pop(request.request_id, 0)
        self._draft_ids.pop(request.request_id, None)
        complete = sent >= request.num_prompt_tokens and request.output_token_ids
        first = request.output_token_ids[0] if complete and request.finish_reason != "abort" \
            else None
        self._finishes.append(FinishSpec(request.request_id, params.to, first,
                                         request.num_prompt_tokens))
        return bool(block_ids)
