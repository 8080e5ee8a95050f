"""An engine that computes nothing, for measuring and testing the serving path alone.

LLMEngine's public interface (tests/test_bench_proxy.py keeps ``add_request``'s signature
equal to LLMEngine's) with no model: every step, one token for every running request. Token
i of a request is ``100 + i % 300`` whatever engine produced it, so a request resumed on
another engine (migration) must continue the same sequence; each token's text is the wall
clock time it was emitted (hex microseconds modulo 2**40), so a client measures every token's
emit -> received time. ``step_seconds`` > 0 paces the engine like a real decode step.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from pd_cluster.outputs import CompletionOutput, RequestOutput


def token_id(i: int) -> int:
    """The null engine's token at output position ``i``."""
    return 100 + i % 300


class NullEngine:
    def __init__(self, step_seconds: float = 0.0):
        self.max_model_len = 4096
        self.requests: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.step_seconds = step_seconds

    def add_request(self, request_id: str, prompt: Any, params: Any,
                    kv_transfer_params: Any = None,
                    resume_token_ids: list[int] | None = None,
                    resume_text_len: int = 0) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running here")
        ids = list(resume_token_ids or [])
        if params.max_tokens is not None and len(ids) >= params.max_tokens:
            raise ValueError(f"resume_token_ids: {len(ids)} tokens, max_tokens is "
                             f"{params.max_tokens}: nothing left to generate")
        self.requests[request_id] = {"prompt": list(prompt), "ids": ids,
                                     "max": params.max_tokens}

    def step(self) -> list[RequestOutput]:
        if self.step_seconds:
            time.sleep(self.step_seconds)
        outs, now = [], time.time()
        for rid, r in list(self.requests.items()):
            token_text = f" {int(now * 1e6) % (1 << 40):x}"
            r["ids"].append(token_id(len(r["ids"])))
            done = len(r["ids"]) >= r["max"]
            # Only the deltas are read downstream: the cumulative fields are left empty (no
            # O(tokens) copy per step, which would make the engine the benchmark's bottleneck).
            outs.append(RequestOutput(rid, None, r["prompt"], [CompletionOutput(
                0, "", [], "length" if done else None, None, None, token_text,
                r["ids"][-1:])], done))
            if done:
                del self.requests[rid]
        return outs

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        out = []
        for rid in request_ids:
            r = self.requests.pop(rid, None)
            if r is not None:
                out.append(RequestOutput(rid, None, r["prompt"], [CompletionOutput(
                    0, "", [], "abort")], True))
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.requests), "num_waiting": 0, "kv_blocks_used": 0,
                "kv_blocks_free": 1, "kv_blocks_total": 1}

    def check_no_leaks(self) -> None:
        """AssertionError while a request is held (LLMEngine's contract)."""
        if self.requests:
            raise AssertionError(f"requests left: {sorted(self.requests)[:10]}")

    def kv_endpoint(self) -> None:
        return None

    def kv_peers(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def null_engine_actor_class() -> Any:
    """The Ray engine actor hosting a NullEngine (``pace`` sets its step time)."""
    import ray

    from pd_cluster.serving.engine.engine_actor import EngineActor

    class NullEngineActor(EngineActor):
        def _make_engine(self, args: dict[str, Any]) -> Any:
            return NullEngine()

        async def pace(self, step_seconds: float) -> None:
            self.engine.step_seconds = step_seconds

    return ray.remote(NullEngineActor)
