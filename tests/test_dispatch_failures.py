"""The proxy's dispatcher when engines fail: lost deltas, malformed messages, migration of a
request whose engine died mid-stream, a first-token mismatch (scripted fake engines)."""
from __future__ import annotations

import msgspec
import pytest
import ray.exceptions

from pd_cluster.serving.api.errors import APIError
from pd_cluster.driver.messages import EngineDelta, EngineRequest, decode_request, encode
from tests.test_serving_dispatch import FakeEngine, Script, _Gen, d_ok, delta, make, p_ok, run


def test_a_lost_or_repeated_delta_fails_the_leg_instead_of_being_merged() -> None:
    """Deltas are incremental: a gap in their numbers means output was lost. The leg fails
    (here before anything was sent, so the request is retried on another decode engine)."""
    class GapGen(_Gen):
        def _increment(self, d: EngineDelta) -> EngineDelta:
            inc = super()._increment(d)
            return msgspec.structs.replace(inc, seq=inc.seq + 1) if inc.seq == 1 else inc

    gappy = FakeEngine(d_ok, gen=GapGen)
    disp, pool, metrics = make({"prefill-0": FakeEngine(lambda r: [0.05] + p_ok(r)),
                                "decode-0": gappy, "decode-1": FakeEngine(d_ok)},
                               retries=2)
    with pytest.raises(APIError) as exc:  # D-0's second delta skipped a number
        run(disp)
    assert exc.value.status == 502 and "expected 1: lost or reordered" in exc.value.message


def test_malformed_engine_messages_are_rejected_at_the_edge() -> None:
    from pd_cluster.sampling_params import SamplingParams
    good = encode(EngineRequest("r", [1, 2], SamplingParams(max_tokens=2)))
    assert decode_request(good).params.max_tokens == 2
    for bad in (b"\\x93garbage", msgspec.msgpack.encode({"request_id": "r", "oops": 1}),
                msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": ["x"],
                                        "params": {}}),
                msgspec.msgpack.encode({"request_id": "r", "prompt_token_ids": [1],
                                        "params": {"temperature": -3}})):
        with pytest.raises(ValueError):
            decode_request(bad)


def test_decode_dying_mid_stream_is_migrated_and_the_stream_goes_on() -> None:
    """D fails after two tokens: another decode engine resumes from the prompt plus the tokens
    sent, and the client's stream continues without a repeat or a gap."""
    def d_dies(r: EngineRequest) -> Script:
        return [0.02, delta(r.request_id, "ab", [5, 6]), ray.exceptions.ActorDiedError()]

    def resumed(r: EngineRequest) -> Script:  # continues from what it was given
        assert r.resume_token_ids == [5, 6] and r.resume_text_len == 2
        assert r.kv_transfer_params is None  # recomputes the prompt + output itself
        return [delta(r.request_id, "abc", [5, 6, 7], "length")]

    d1 = FakeEngine(resumed)
    disp, pool, metrics = make({"prefill-0": FakeEngine(p_ok), "decode-0": FakeEngine(d_dies),
                                "decode-1": d1})
    disp.max_migrations = 2
    events = run(disp)  # fails on a failed assert in a script (FakeEngine.failures)
    assert [(r.resume_token_ids, r.kv_transfer_params) for r in d1.requests] == [([5, 6], None)]
    assert "".join(t for t, _, _ in events) == "abc" and events[-1][2] == "length"
    assert [i for _, ids, _ in events for i in ids] == [5, 6, 7]
    assert metrics.migrations._value.get() == 1
    assert not next(e for e in pool.engines if e.name == "decode-0").healthy


def test_a_first_token_mismatch_is_never_streamed() -> None:
    """D's first token differs from P's (already sent): D's continuation is not used; the
    request resumes from the client's token on another engine."""
    def d_disagrees(r: EngineRequest) -> Script:
        return [0.05, delta(r.request_id, "zq", [9, 6]), delta(r.request_id, "zqc", [9, 6, 7],
                                                                "length")]

    def resumed(r: EngineRequest) -> Script:
        assert r.resume_token_ids == [5]
        return [delta(r.request_id, "abc", [5, 6, 7], "length")]

    d1 = FakeEngine(resumed)
    disp, _, metrics = make({"prefill-0": FakeEngine(p_ok), "decode-0": FakeEngine(d_disagrees),
                             "decode-1": d1})
    disp.max_migrations = 1
    events = run(disp)
    assert [r.resume_token_ids for r in d1.requests] == [[5]]
    assert [i for _, ids, _ in events for i in ids] == [5, 6, 7]
    assert "".join(t for t, _, _ in events) == "abc"
    assert metrics.first_token_mismatch._value.get() == 1


def test_colocated_engine_dying_mid_stream_is_migrated() -> None:
    def dies(r: EngineRequest) -> Script:
        return [delta(r.request_id, "ab", [5, 6]), ray.exceptions.ActorDiedError()]

    def resumed(r: EngineRequest) -> Script:
        assert r.resume_token_ids == [5, 6]
        return [delta(r.request_id, "abc", [5, 6, 7], "length")]

    c1 = FakeEngine(resumed)
    disp, _, metrics = make({"colocated-0": FakeEngine(dies), "colocated-1": c1},
                            mode="colocated")
    disp.max_migrations = 1
    events = run(disp)
    assert [r.resume_token_ids for r in c1.requests] == [[5, 6]]
    assert [i for _, ids, _ in events for i in ids] == [5, 6, 7]
    assert metrics.migrations._value.get() == 1
