"""The two processes of tests/test_cuda_ipc_pipe.py's GPU test (a module of its own: spawned
processes import it). The decode engine runs in one, the prefill engine in the other (CUDA IPC
opens no handle in the process that made it); each scenario's request goes to both, each side
steps until idle and checks its leaks. Scenarios: exact (a plain write), flip (a bit of a
written block changes before the notification: fail closed), stray (the grant is cut to one
block: the write past it is refused, and so is a direct write past the cache)."""
from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any

import torch

from connectors.transfer_params import RecvKV, SendKV
from pd_cluster import SamplingParams
from pd_cluster.config import EngineConfig
from pd_cluster.engine.llm_engine import LLMEngine
from tests.conftest import random_prompt
from tests.pd_helpers import colocated_tokens, kv_config, producer_params

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SCENARIOS = {"exact": 33, "flip": 37, "stray": 29}  # prompt lengths (no shared prefixes)
_WAIT = 120.0


def _engine(model: str, role: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, block_size=8, device="cuda", kv_transfer={
        **kv_config(role, 10.0), "pipe": "cuda_ipc"}))


def _step_until_idle(e: LLMEngine) -> dict[str, list[int]]:
    done, deadline = {}, time.monotonic() + _WAIT
    while e.has_unfinished_requests():
        assert time.monotonic() < deadline, "engine did not finish in time"
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    for _ in range(200):  # the producer frees its blocks on the step after the ACK
        try:
            e.check_no_leaks()
            return done
        except AssertionError:
            e.step()
            time.sleep(0.01)
    e.check_no_leaks()
    return done


def _leaks(e: LLMEngine) -> str:
    try:
        e.check_no_leaks()
        return "none"
    except AssertionError as err:
        return str(err)[:300]


def decode_side(model: str, inbox: Any, out: Any) -> None:
    d = _engine(model, "consumer")
    out.put(("endpoint", d.kv_endpoint()))
    try:
        while (job := inbox.get(timeout=_WAIT)) is not None:
            name, prompt = job
            before = dict(d.stats())
            d.add_request(name, prompt, GREEDY, RecvKV())
            out.put(("ready", name))
            got = _step_until_idle(d)
            stats = d.stats()
            out.put(("d", name, {
                "tokens": got.get(name),
                "fallbacks": stats["kv_fallbacks"] - before.get("kv_fallbacks", 0),
                "bytes_received": stats["kv_bytes_received"] - before.get("kv_bytes_received",
                                                                          0),
                "digest_failures": d.runner.connector.stats()["kv_digest_failures"],
                "leaks": _leaks(d)}))
    finally:
        d.close()


def prefill_side(model: str, inbox: Any, out: Any) -> None:
    p = _engine(model, "producer")
    pipe = p.runner.connector.pipe
    try:
        while (job := inbox.get(timeout=_WAIT)) is not None:
            name, prompt, endpoint = job
            p.connect_kv_peer(endpoint)
            written0 = pipe.stats()["cuda_ipc_bytes_written"]
            restore = _break(name, p, pipe)
            p.add_request(name, prompt, producer_params(GREEDY), SendKV(to=endpoint))
            _step_until_idle(p)
            restore()
            res = {"bytes_written": pipe.stats()["cuda_ipc_bytes_written"] - written0,
                   "leaks": _leaks(p)}
            if name == "stray":
                past = pipe._remotes[endpoint].layout.layers[0].num_blocks
                try:
                    pipe.write_blocks(endpoint, 0, p.runner.kv_caches[0], [0], [past], b"")
                    res["past_refused"] = False
                except ValueError:
                    res["past_refused"] = True
            out.put(("p", name, res))
    finally:
        p.close()


def _break(name: str, p: LLMEngine, pipe: Any) -> Any:
    """Patch the producer for a scenario; returns the undo."""
    if name == "flip":
        real_copy, real_notify, last, flipped = pipe._copy, pipe._notify, {}, []

        def copy(peer, remote, src, dst, src_ids, dst_ids, *rest):  # type: ignore[no-untyped-def]
            last.update(dst=dst, ids=dst_ids)
            return real_copy(peer, remote, src, dst, src_ids, dst_ids, *rest)

        def notify(peer: str, header: dict) -> Any:
            if not flipped:  # the first write: a bit of its first block, after the copy
                last["dst"][0, last["ids"][0], 3] ^= 1
                torch.cuda.synchronize(last["dst"].device)
                flipped.append(True)
            return real_notify(peer, header)
        pipe._copy, pipe._notify = copy, notify
        return lambda: (setattr(pipe, "_copy", real_copy), setattr(pipe, "_notify", real_notify))
    if name == "stray":
        grants, real = p.runner.connector.grants, p.runner.connector.grants.record
        grants.record = lambda ep, rid, first, ids: real(ep, rid, first, ids[:1])
        return lambda: setattr(grants, "record", real)
    return lambda: None


def run_pair(model: str) -> dict[str, dict[str, Any]]:
    """Each scenario's merged results from both sides, with the colocated answer."""
    ctx = mp.get_context("spawn")
    out, to_d, to_p = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=decode_side, args=(model, to_d, out)),
             ctx.Process(target=prefill_side, args=(model, to_p, out))]
    for proc in procs:
        proc.start()
    try:
        kind, endpoint = out.get(timeout=_WAIT)
        assert kind == "endpoint"
        prompts = {k: random_prompt(n, seed=11 * n) for k, n in SCENARIOS.items()}
        wants = colocated_tokens(model, list(prompts.values()), [GREEDY] * len(prompts),
                                 block_size=8)
        results: dict[str, dict[str, Any]] = {}
        for (name, prompt), want in zip(prompts.items(), wants):
            to_d.put((name, prompt))
            assert out.get(timeout=_WAIT) == ("ready", name)
            to_p.put((name, prompt, endpoint))
            merged: dict[str, Any] = {"want": want}
            for _ in range(2):
                side, got_name, res = out.get(timeout=_WAIT)
                assert got_name == name, (side, got_name)
                leaks = [merged.get("leaks", "none"), res["leaks"]]
                merged.update(res)
                merged["leaks"] = next((x for x in leaks if x != "none"), "none")
            results[name] = merged
        return results
    except queue.Empty:
        raise AssertionError("a side of the pair did not answer in time") from None
    finally:
        to_d.put(None), to_p.put(None)
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
