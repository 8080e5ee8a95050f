"""Shared helpers for the P/D connector tests: engine pairs and a colocated reference."""
from __future__ import annotations

import time
from typing import Any, Callable

from connectors.transfer_params import RecvKV, SendKV
from pd_cluster import LLM, SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine


def kv_config(role: str, timeout: float = 10.0, **pipe: Any) -> dict[str, Any]:
    return {"role": role, "kv_transfer_timeout": timeout, "record_timings": True, **pipe}


def prompts_of_lengths(lengths: list[int], vocab: int = 500) -> list[list[int]]:
    return [[4 + (i * 31 + j * 7) % (vocab - 4) for j in range(n)] for i, n in enumerate(lengths)]


def producer_params(params: SamplingParams) -> SamplingParams:
    d = params.to_dict()
    d.update(max_tokens=1, min_tokens=0)
    return SamplingParams.from_dict(d)


def submit_pair(p: Any, d: Any, rid: str, prompt: list[int], params: SamplingParams,
                endpoint: str) -> None:
    """Same request id on both sides, as the proxy does (after the handshake, as the cluster
    does at launch: a producer never handshakes on its forward path)."""
    p.connect_kv_peer(endpoint)
    d.add_request(rid, prompt, params, RecvKV())
    p.add_request(rid, prompt, producer_params(params), SendKV(to=endpoint))


def run_in_process(p: LLMEngine, d: LLMEngine, timeout: float = 60.0,
                   after_step: Callable[[], None] | None = None) -> dict[str, list[int]]:
    """Step both engines until idle (``after_step`` called after each pair of steps); returns
    the consumer's final tokens per request."""
    done: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout
    while p.has_unfinished_requests() or d.has_unfinished_requests():
        assert time.monotonic() < deadline, "P/D pair did not finish in time"
        p.step()
        for out in d.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if after_step is not None:
            after_step()
    return done


def colocated_tokens(model: str, prompts: list[list[int]], params: list[SamplingParams],
                     **engine_args: Any) -> list[list[int]]:
    outs = LLM(model=model, **engine_args).generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs]


def drain(p: LLMEngine, d: LLMEngine, timeout: float = 60.0) -> None:
    """Step both engines until neither has work: the producer sees the last ACKs (its blocks
    are freed on the step after). Bounded: the leak check that follows says what is held."""
    deadline = time.monotonic() + timeout
    while p.has_unfinished_requests() or d.has_unfinished_requests():
        if time.monotonic() > deadline:
            return
        p.step()
        d.step()
        time.sleep(0.005)  # pacing: the ACKs travel on the pipes' own threads


def engine(model: str, role: str | None, timeout: float = 10.0, pipe: str | None = None,
           **args: Any) -> LLMEngine:
    """An engine in this process; ``role`` producer/consumer/both (None: no KV transfer) over
    ``pipe`` (default: kv_transfer's default, auto)."""
    kv = kv_config(role, timeout, **({"pipe": pipe} if pipe else {})) if role else None
    return LLMEngine(EngineConfig(model=model, kv_transfer=kv, **args))


def pd_tokens(model: str, prompts: list[list[int]], params: list[SamplingParams], chunk: int,
              block_size: int = 8, **args: Any) -> list[list[int]]:
    """Each prompt through an in-process P/D pair (P prefills ``chunk`` tokens per step and
    ships every layer's KV, D decodes): D's tokens per prompt, once the KV arrived with no
    fallback and neither engine holds anything. ``args``: more engine arguments, both sides."""
    d = engine(model, "consumer", block_size=block_size, **args)
    p = engine(model, "producer", block_size=block_size, max_num_batched_tokens=chunk, **args)
    try:
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            submit_pair(p, d, f"r{i}", prompt, sp, d.kv_endpoint())
        got = run_in_process(p, d)
        assert d.stats()["kv_fallbacks"] == 0
        assert p.stats()["kv_bytes_sent"] == d.stats()["kv_bytes_received"] > 0
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()
    return [got[f"r{i}"] for i in range(len(prompts))]
