"""Faults injected at a rate (engine.faults, pd_cluster/faults.py), under load: each kind of
fault at each site, on real engines in this process. KV pipe sends and receives dropped,
delayed, corrupted (after the integrity code: the receiver's check refuses it) or failed,
on a P/D pair over zmq and over auto (shm on one host): every output equals the colocated
engine's, every KV block is free at the end, and the counters say what was injected. The
token path's frames dropped, corrupted (the frame's CRC-32 refuses it), delayed or its
connection broken, through the proxy's TokenChannel and Dispatcher over two engines: every
request ends exact (a retry or a migration) or, when the frame it ended in was lost, with a
timeout error at its deadline; nothing hangs, nothing is held. Control calls failed or
delayed while the engine serves. And the config: bad rates are errors naming the field,
``--set engine.faults...`` reaches every engine."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from connectors.pipes import PipeConfig, create_pipe
from connectors.pipes.faulty_pipe import with_faults
from pd_cluster import SamplingParams
from pd_cluster.config import EngineArgs, EngineConfig
from pd_cluster.driver.engine_loop import EngineLoop
from pd_cluster.driver.messages import EngineDelta, EngineRequest, encode
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.fault_sites import InjectedFault
from pd_cluster.faults import FaultsConfig
from pd_cluster.serving.api.errors import APIError
from pd_cluster.serving.cluster.cluster_config import ProxyConfig
from pd_cluster.serving.cluster.testing import wait_until
from pd_cluster.serving.engine.frame_socket import FrameParser, MalformedFrame, frame
from pd_cluster.serving.observability.metrics import ProxyMetrics
from pd_cluster.serving.routing.dispatch import Dispatcher
from pd_cluster.serving.routing.engine_pool import EnginePool
from pd_cluster.serving.routing.legs import GenerateJob
from pd_cluster.serving.routing.token_channel import TokenChannel
from tests.pd_helpers import (colocated_tokens, drain, prompts_of_lengths, run_in_process,
                              submit_pair)
from tests.token_path_fakes import FakeEngineActor, until

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# Twelve requests, none a prefix of another (their KV is shipped in full).
PROMPTS = prompts_of_lengths([9, 17, 24, 33, 40, 12, 48, 20, 29, 36, 15, 44])
BS = 8
# Short bounds: a lost FIN costs the decode engine a transfer timeout, a lost ACK the
# producer a lease.
KV = {"kv_transfer_timeout": 2.0, "lease_seconds": 1.0}


@pytest.fixture(scope="module")
def expected(tiny_model) -> list[list[int]]:
    """The colocated engine's tokens for each prompt (the reference)."""
    return colocated_tokens(tiny_model(), PROMPTS, [GREEDY] * len(PROMPTS), block_size=BS)


def _pair(model: str, faults: dict[str, Any], pipe: str) -> tuple[LLMEngine, LLMEngine]:
    """A P/D pair with the same faults on both engines (as ``--set engine.faults`` gives)."""
    def one(role: str, **args: Any) -> LLMEngine:
        return LLMEngine(EngineConfig(model=model, block_size=BS, faults=faults, **args,
                                      kv_transfer={"role": role, "pipe": pipe, **KV}))
    return one("producer", max_num_batched_tokens=32), one("consumer")


def _injected(engines: tuple[LLMEngine, ...], site: str, kind: str) -> int:
    return sum(e.stats().get(f"faults_injected_{site}_{kind}", 0) for e in engines)


KV_CASES = [(site, kind, "zmq") for site in ("kv_send", "kv_recv")
            for kind in ("drop", "delay", "corrupt", "fail")]
KV_CASES += [("kv_send", "corrupt", "auto"), ("kv_recv", "corrupt", "auto"),
             ("kv_send", "drop", "auto")]


@pytest.mark.parametrize("site,kind,pipe", KV_CASES, ids=["-".join(c) for c in KV_CASES])
def test_kv_faults_at_a_rate_keep_every_output_exact_and_hold_nothing(
        tiny_model, expected, site: str, kind: str, pipe: str) -> None:
    p, d = _pair(tiny_model(), {site: {kind: 0.25}, "delay_s": 0.02, "seed": 7}, pipe)
    try:
        endpoint = d.kv_endpoint()
        for i, prompt in enumerate(PROMPTS):
            submit_pair(p, d, f"r{i}", prompt, GREEDY, endpoint)

        def relink() -> None:  # the cluster's peer linker: a failed send drops the link
            if endpoint not in p.kv_peers():
                p.connect_kv_peer(endpoint)
        got = run_in_process(p, d, timeout=60, after_step=relink)
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
        if pipe == "auto":  # one host: the link writes into D's shared cache
            assert p.stats()["kv_links"] == {endpoint: "shm"}
        # both still receive (a failed receive once ended the connector's receiver thread)
        assert all(e.runner.connector._thread.is_alive() for e in (p, d))
        drain(p, d)
        p.check_no_leaks(), d.check_no_leaks()
        # the connectors too (a late message staged for a request gone expires in a timeout)
        wait_until(lambda: not any(v for e in (p, d) for v in e.kv_holds().values()),
                   2 * KV["kv_transfer_timeout"], "the connectors to hold nothing", 0.01)
        assert _injected((p, d), site, kind) > 0
        others = [k for k in ("drop", "delay", "corrupt", "fail") if k != kind]
        assert all(_injected((p, d), s, k) == 0 for s in ("kv_send", "kv_recv")
                   for k in others)
        if kind == "corrupt":  # refused by the receiver's check, never decoded on
            refused = sum(e.stats()[key] for e in (p, d)
                          for key in ("kv_integrity_failures", "kv_digest_failures"))
            assert refused > 0
    finally:
        p.close(), d.close()


# ---------------------------------------------------------------------------- the token path

TOKENS = 12
TOKEN_PARAMS = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
TOKEN_PROMPTS = prompts_of_lengths([5, 11, 19, 26, 8, 14, 31, 22])


class LoopActor(FakeEngineActor):
    """The token path's test double (token_path_fakes.py) with its requests run by a real
    engine on its own EngineLoop, as the engine actor does, and its OutputSender's faults."""

    def __init__(self, name: str, engine: LLMEngine, faults: FaultsConfig | None = None):
        super().__init__(name, faults=faults)
        self.engine_loop = EngineLoop(engine, self.sender.emit)
        self.engine_loop.start()

    def accept(self, req: EngineRequest) -> None:
        self.sender.route(req.request_id, req.output_session)
        self.engine_loop.submit(req)

    def _abort(self, ids: list[str]) -> None:  # a closed session's, or the proxy's
        super()._abort(ids)
        self.engine_loop.abort(ids)

    def stop(self) -> None:
        super().stop()
        self.engine_loop.stop()


@pytest.fixture(scope="module")
def colocated(tiny_model) -> Any:
    """Two colocated engines (reused: a test's faults live in its actors' OutputSenders)
    and the reference tokens of TOKEN_PROMPTS."""
    model = tiny_model()
    engines = [LLMEngine(EngineConfig(model=model, block_size=BS)) for _ in range(2)]
    ref = colocated_tokens(model, TOKEN_PROMPTS, [TOKEN_PARAMS] * len(TOKEN_PROMPTS),
                           block_size=BS)
    yield engines, ref
    for e in engines:
        e.close()


async def _serve_through_proxy(engines: list[LLMEngine], faults: FaultsConfig,
                               deadline_s: float, waves: int = 4
                               ) -> tuple[list[Any], LoopActor, Any]:
    """TOKEN_PROMPTS' requests through the Dispatcher, all at once, ``waves`` times: each
    started on engine ``a`` (faulted), retried or migrated to ``b`` (not) by the proxy's
    rules, ``a`` linked again by the health checks after its link failed. Returns each
    request's tokens (or its error) wave after wave, ``a`` and the TokenChannel's
    counters."""
    a, b = LoopActor("colocated-0", engines[0], faults), LoopActor("colocated-1", engines[1])
    pool = EnginePool([(x.name, "colocated", x.handle) for x in (a, b)],
                      ProxyConfig(health_check_interval=0.1, routing="round_robin"))
    channel = TokenChannel(5.0, pool.mark_failed, node_id="here")
    pool.token_channel = channel
    pool.routers["colocated"].pick = lambda candidates, *_: candidates[0]
    await pool.start()
    dispatcher = Dispatcher(pool, "colocated", ProxyMetrics(lambda: pool.engines), channel,
                            max_retries=2, max_migrations=4)

    async def one(wave: int, i: int) -> list[int]:
        job = GenerateJob(f"t{wave}-{i}", TOKEN_PROMPTS[i], TOKEN_PARAMS,
                          time.monotonic() + deadline_s)
        return [t async for ev in dispatcher.stream(job) for t in ev.token_ids]
    try:
        got: list[Any] = []
        for wave in range(waves):
            # a linked again after a link failure, routable again (its failures reset)
            await until(lambda: channel.linked(pool.engines[0], "i0")
                        and pool.engines[0].failures == 0)
            got += await asyncio.gather(*(one(wave, i) for i in range(len(TOKEN_PROMPTS))),
                                        return_exceptions=True)
        counters = dict(channel.counters)
        for x in (a, b):  # nothing held: every request ended on both engines
            await until(lambda: x.engine_loop.snapshot.get("num_active") == 0
                        and not x.sender._routes)
            x.engine_loop.call(lambda e: e.check_no_leaks()).result(10)
            assert x.engine_loop.alive
    finally:
        await pool.close()
        a.stop(), b.stop()
    return got, a, counters


def test_a_frame_with_a_flipped_bit_in_a_token_id_is_refused_not_decoded() -> None:
    """msgpack decodes such a payload to another token (a wrong answer): the frame's
    CRC-32 makes it a malformed frame instead."""
    payload = encode([EngineDelta("r", 0, [300], "x")])
    at = payload.index(bytes([0xcd, 0x01, 0x2c])) + 2  # uint16 300
    flipped = payload[:at] + bytes([payload[at] ^ 0x01]) + payload[at + 1:]
    assert msgspec.msgpack.decode(flipped, type=list[EngineDelta])[0].token_ids == [301]
    data = frame(payload)
    bad = data[:-len(payload)] + flipped
    with pytest.raises(MalformedFrame, match="CRC-32"):
        FrameParser().feed(bad, lambda p: None)
    got: list[bytes] = []
    FrameParser().feed(data, lambda p: got.append(bytes(p)))
    assert got == [payload]


@pytest.mark.parametrize("kind,rate", [("corrupt", 0.1), ("fail", 0.1), ("delay", 0.3)])
def test_token_path_faults_end_in_exact_outputs_by_the_proxys_rules(colocated, kind: str,
                                                                     rate: float) -> None:
    """A corrupted frame fails its CRC-32 (the link fails as a malformed one does), a broken
    connection closes the session: either way the legs on it migrate and finish exactly."""
    engines, ref = colocated
    faults = FaultsConfig(token={kind: rate}, delay_s=0.02, seed=3)
    got, a, counters = asyncio.run(_serve_through_proxy(engines, faults, 60.0))
    assert got == ref * 4
    assert a.sender.counters[f"faults_injected_token_{kind}"] > 0
    if kind == "corrupt":
        assert counters["malformed"] > 0  # refused, never decoded
    if kind == "fail":
        assert a.sender.counters["output_sessions_dropped"] > 0


def test_lost_token_frames_fail_their_legs_or_time_out_never_hang(colocated) -> None:
    """A frame lost: the requests that go on find the gap at their next delta and migrate
    exactly; one that ended in it gets a timeout error at its deadline, not a hang."""
    engines, ref = colocated
    faults = FaultsConfig(token={"drop": 0.1}, seed=5)
    t0 = time.monotonic()
    got, a, _ = asyncio.run(_serve_through_proxy(engines, faults, 6.0))
    assert time.monotonic() - t0 < 30
    assert a.sender.counters["faults_injected_token_drop"] > 0
    for tokens, want in zip(got, ref * 4):
        if isinstance(tokens, APIError):
            assert tokens.status == 504 and "timed out" in tokens.message
        else:
            assert tokens == want
    assert any(not isinstance(t, APIError) for t in got)


# ---------------------------------------------------------------------------- control calls

def test_control_calls_failed_or_delayed_while_the_engine_serves(tiny_model, expected) -> None:
    engine = LLMEngine(EngineConfig(model=tiny_model(), block_size=BS, faults={
        "control": {"fail": 0.3, "delay": 0.3}, "delay_s": 0.01, "seed": 2}))
    done: dict[str, list[int]] = {}

    def emit(deltas: list[Any]) -> None:
        for d in deltas:
            done.setdefault(d.request_id, []).extend(d.token_ids)
    loop = EngineLoop(engine, emit)
    loop.start()
    try:
        for i, prompt in enumerate(PROMPTS):
            loop.submit(EngineRequest(f"c{i}", prompt, GREEDY))
        calls = [loop.call(lambda e: e.stats()["num_running"]) for _ in range(40)]
        failed = 0
        for fut in calls:
            try:
                assert isinstance(fut.result(10), int)
            except InjectedFault:
                failed += 1
        wait_until(lambda: loop.snapshot.get("requests_finished") == len(PROMPTS), 30,
                   "every request to finish", interval=0.01)
        assert [done[f"c{i}"] for i in range(len(PROMPTS))] == expected
        assert loop.alive and loop.snapshot["faults_injected_control_fail"] == failed > 0
        assert loop.snapshot["faults_injected_control_delay"] > 0
        for _ in range(20):  # a caller retries a control call that failed
            try:
                loop.call(lambda e: e.check_no_leaks()).result(10)
                break
            except InjectedFault:
                continue
        else:
            raise AssertionError("every leak check failed")
    finally:
        loop.stop()
        engine.close()


# ---------------------------------------------------------------------------- the config

def test_bad_rates_are_errors_naming_the_field_and_off_is_the_default(tiny_model) -> None:
    assert EngineArgs().faults is None
    with pytest.raises(ValueError, match=r"faults\.kv_send\.drop\n.*fraction in \[0, 1\]"):
        EngineArgs(faults={"kv_send": {"drop": 1.5}})
    with pytest.raises(ValueError, match=r"faults\.token\.delay"):
        EngineArgs(faults={"token": {"delay": -0.1}})
    with pytest.raises(ValueError, match=r"faults\.kv_recv\.lost\n.*Extra inputs"):
        EngineArgs(faults={"kv_recv": {"lost": 0.1}})
    with pytest.raises(ValueError, match=r"control\.drop: control calls are failed or delayed"):
        EngineArgs(faults={"control": {"drop": 0.1}})
    with pytest.raises(ValueError, match=r"faults\.kv_recv\.corrupt: needs kv_transfer\."
                                         r"integrity mac or crc32"):
        EngineConfig(model=tiny_model(), faults={"kv_recv": {"corrupt": 0.1}},
                     kv_transfer={"role": "consumer", "security": "none",
                                  "integrity": "none"})
    with pytest.raises(ValueError, match=r"faults\.kv_send\.corrupt: the GlooPipe has no "
                                         r"integrity channel"):
        with_faults(create_pipe("gloo", PipeConfig()), FaultsConfig(kv_send={"corrupt": 0.1}))
    plain = with_faults(create_pipe("zmq", PipeConfig()), FaultsConfig(token={"drop": 0.1}))
    assert type(plain).__name__ == "ZmqPipe"  # no KV rate: the pipe itself, unwrapped
    plain.close()


def test_set_keys_reach_every_engine_and_bad_ones_name_the_key() -> None:
    from pd_cluster.cli import build_parser
    from pd_cluster.serving.cluster.schema import ConfigError
    from pd_cluster.serving.cluster.serve_cli import serve_config

    def serve(*sets: str) -> Any:
        flags = [x for s in sets for x in ("--set", s)]
        return serve_config(build_parser().parse_args(["serve", "tiny-llama", "--mode",
                                                       "disaggregated", "--port", "0", *flags]))
    cfg = serve("engine.faults.kv_send.drop=0.05", "engine.faults.seed=3")
    specs = cfg.engine_specs()
    assert {s.role for s in specs} == {"prefill", "decode"}
    for spec in specs:
        faults = EngineArgs.model_validate(
            {k: v for k, v in spec.engine_args.items() if k != "kv_transfer"}).faults
        assert faults.kv_send.drop == 0.05 and faults.seed == 3 and not faults.token.active
    with pytest.raises(ConfigError, match=r"^engine\.faults\.kv_send\.drop: must be a "
                                          r"fraction in \[0, 1\], got 2"):
        serve("engine.faults.kv_send.drop=2")


@pytest.mark.parametrize("pipe", ["zmq", "auto"])
def test_a_lease_far_shorter_than_the_consumers_reads_never_lets_it_decode_on_freed_blocks(
        tiny_model, expected, pipe: str) -> None:
    """vLLM's digest suite: a 50 ms lease against slow reads. Every message reaches the
    consumer 0.3 s late (past the producer's lease many times over): the producer frees its
    blocks and reuses them for the next prompts, and the consumer must still decode on
    exactly the KV it was sent (or recompute), never on what the freed blocks hold now."""
    faults = {"kv_recv": {"delay": 1.0}, "delay_s": 0.3, "seed": 3}

    def one(role: str, **args: Any) -> LLMEngine:
        kv = {**KV, "lease_seconds": 0.05, "kv_transfer_timeout": 10.0}
        return LLMEngine(EngineConfig(model=tiny_model(), block_size=BS, faults=faults, **args,
                                      kv_transfer={"role": role, "pipe": pipe, **kv}))
    p, d = one("producer", max_num_batched_tokens=32, num_kv_blocks=64), one("consumer")
    try:
        endpoint = d.kv_endpoint()
        for i, prompt in enumerate(PROMPTS):
            submit_pair(p, d, f"r{i}", prompt, GREEDY, endpoint)
        got = run_in_process(p, d, timeout=120)
        assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
        drain(p, d)
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()
