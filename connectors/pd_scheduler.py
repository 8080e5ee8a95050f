"""Scheduler half of the P/D connector: turns request state into per-step transfer plans.

kv_transfer_params on a request (set by the proxy, same request id on both engines):
- producer (P): {"do_remote_decode": True, "remote_kv_addr": <consumer endpoint>}
- consumer (D): {"do_remote_prefill": True}
"""
from __future__ import annotations

from typing import Any

from connectors.base import KVConnectorBase_Scheduler
from connectors.metadata import FinishSpec, KVConnectorMetadata, RecvSpec, SendSpec


def _params(request: Any) -> dict[str, Any]:
    return request.kv_transfer_params or {}


class PDConnectorScheduler(KVConnectorBase_Scheduler):
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._recvs: list[RecvSpec] = []
        self._finishes: list[FinishSpec] = []
        self._cancels: list[str] = []
        self._sent_upto: dict[str, int] = {}  # producer: prompt tokens already planned to send

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        if _params(request).get("do_remote_prefill"):
            return request.num_prompt_tokens - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        if num_external_tokens:
            self._recvs.append(RecvSpec(request.request_id, tuple(block_ids),
                                        request.num_prompt_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        sends = []
        for item in scheduler_output.scheduled:
            request = item.request
            params = _params(request)
            if not params.get("do_remote_decode"):
                continue
            # From what was already planned (prefix-cache hits included) to this step's end.
            start = self._sent_upto.get(request.request_id, 0)
            end = min(request.num_computed_tokens + item.num_new_tokens, request.num_prompt_tokens)
            if end <= start:
                continue
            self._sent_upto[request.request_id] = end
            first, last = start // self.block_size, -(-end // self.block_size)
            sends.append(SendSpec(request.request_id, params["remote_kv_addr"],
                                  tuple(request.block_ids[first:last]), first))
        meta = KVConnectorMetadata(sends, self._finishes, self._recvs, self._cancels)
        self._finishes, self._recvs, self._cancels = [], [], []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        params = _params(request)
        if params.get("do_remote_prefill"):
            self._cancels.append(request.request_id)  # no-op for the worker if already done
            return False
        if not params.get("do_remote_decode"):
            return False
        sent = self._sent_upto.pop(request.request_id, 0)
        complete = sent >= request.num_prompt_tokens and request.output_token_ids
        first = request.output_token_ids[0] if complete and request.finish_reason != "abort" \
            else None
        self._finishes.append(FinishSpec(request.request_id, params["remote_kv_addr"], first,
                                         request.num_prompt_tokens))
        return bool(block_ids)
