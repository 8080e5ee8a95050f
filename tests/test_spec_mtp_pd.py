"""The MTP layer's state through P/D (issue 41): a prefill engine with the same mtp config runs
the MTP layer's prefill over the prompt and ships its KV after the target's layers, and the
prompt's last hidden state in the FIN (pd_cluster/engine/spec/mtp_pd.py); the decode engine
starts proposing right after the prompt without running the MTP prefill itself.

The heads under test run the real MTP layer (its KV written and read as usual) and propose the
known continuation where the layer's own greedy token is not 0 mod 3, a wrong token where it
is: which drafts are kept is a function of the head's KV and hidden states, so D's acceptance
and the layer's outputs (its trace) equal the colocated run's only if the KV and hidden state
that came are right (a wrong hidden state shipped changes them). Over zmq and shm; a corrupted
MTP layer in flight fails closed and is recomputed exactly; a mismatched P is refused; a P that
ships no MTP state leaves the request decoding without drafts; a request moved mid-speculation
continues exactly. Greedy output always equals the colocated run without speculation; every
test ends leak-free (the target's blocks and the head's, both engines)."""
from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch

from connectors.pipes.base import HandshakeError
from pd_cluster import LLM, SamplingParams
from pd_cluster.engine.llm_engine import LLMEngine
from pd_cluster.engine.spec import mtp_pd
from tests.conftest import random_prompt
from tests.pd_helpers import colocated_tokens, drain, engine, run_in_process, submit_pair
from tests.spec_helpers import outputs
from tests.test_families import family_model  # noqa: F401 (the fixture)
from tests.test_kv_fail_closed import _tampered

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MTP = {"method": "mtp", "num_speculative_tokens": 3}
# L - 1 at a block's start (17), a short prompt (2: one MTP position on P), one in chunks (21).
PROMPTS = [random_prompt(n, seed=n) for n in (21, 17, 2)]
COUNTERS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "spec_draft_prefill_tokens")


class _Probe(torch.nn.Module):
    """A HiddenStateHead around the real MTP layer (see the module's docstring); ``trace``:
    (position, the layer's greedy token) of every state scored."""

    def __init__(self, real: Any) -> None:
        super().__init__()
        self.real, self.seq = real, []
        self.vocab = real.shared_head.head.vocab_size
        self.where: dict[bytes, int] = {}  # a state's bytes -> its position
        self.trace: list[tuple[int, int]] = []

    def kv_cache_specs(self, dtype: torch.dtype) -> list[Any]:
        return self.real.kv_cache_specs(dtype)

    def forward(self, token_ids, positions, hidden, ctx):  # type: ignore[no-untyped-def]
        out = self.real(token_ids, positions, hidden, ctx)
        for p, row in zip(positions.tolist(), out):
            self.where[row.cpu().numpy().tobytes()] = p
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        picks = self.real.compute_logits(hidden).argmax(dim=-1).tolist()
        logits = torch.zeros(hidden.shape[0], self.vocab)
        for i, (row, pick) in enumerate(zip(hidden, picks)):
            p = self.where[row.cpu().numpy().tobytes()]
            self.trace.append((p, pick))
            want = self.seq[p + 2] if p + 2 < len(self.seq) else 5
            logits[i, want if pick % 3 else (want + 1) % 200 + 4] = 1.0
        self.where.clear()
        return logits


def _probe(e: LLMEngine) -> _Probe:
    """``e``'s head wrapped in a probe; the backoff's cost gate off (its step timings would
    make proposing depend on the clock)."""
    e.proposer.backoff.cost.threshold = lambda batch, extra=0.0: 0.0
    runner = e.proposer.runner
    runner.head = _Probe(runner.head)
    return runner.head


def _counts(e: LLMEngine) -> dict[str, int]:
    s = e.stats()
    return {k: s.get(k, 0) for k in COUNTERS}


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


@pytest.fixture(scope="module")
def model(family_model: Any) -> str:  # noqa: F811
    return family_model("tiny-deepseek-v3")


@pytest.fixture(scope="module")
def reference(model: str) -> list[tuple[list[int], list[tuple[int, int]], dict[str, int]]]:
    """Per prompt, alone: the tokens without speculation, and the colocated mtp run's trace
    and counters (its output checked equal)."""
    want = colocated_tokens(model, PROMPTS, [GREEDY] * len(PROMPTS), block_size=8,
                            compile=False)
    llm = LLM(model=model, block_size=8, max_num_batched_tokens=16, speculative=MTP,
              compile=False)
    probe = _probe(llm.engine)
    out = []
    for prompt, tokens in zip(PROMPTS, want):
        probe.seq, probe.trace = prompt + tokens, []
        before = _counts(llm.engine)
        assert list(outputs(llm, [prompt], GREEDY)[0].token_ids) == tokens
        out.append((tokens, probe.trace, _delta(_counts(llm.engine), before)))
    llm.engine.check_no_leaks()
    return out


def _pair(model: str, pipe: str) -> tuple[LLMEngine, LLMEngine, _Probe]:
    d = engine(model, "consumer", pipe=pipe, block_size=8, speculative=MTP, compile=False)
    p = engine(model, "producer", pipe=pipe, block_size=8, max_num_batched_tokens=16,
               speculative=MTP, compile=False)
    p.connect_kv_peer(d.kv_endpoint())
    return p, d, _probe(d)


@pytest.fixture(scope="module")
def pair(model: str) -> Iterator[tuple[LLMEngine, LLMEngine, _Probe]]:
    p, d, probe = _pair(model, "zmq")
    yield p, d, probe
    p.close(), d.close()


def _through(p: LLMEngine, d: LLMEngine, probe: _Probe, rid: str, i: int, ref: Any
             ) -> tuple[list[int], list[tuple[int, int]], dict[str, int], dict[str, int]]:
    """Prompt ``i`` through the pair: D's tokens and trace, D's and P's counters' change."""
    probe.seq, probe.trace = PROMPTS[i] + ref[i][0], []
    before_d, before_p = _counts(d), _counts(p)
    submit_pair(p, d, rid, PROMPTS[i], GREEDY, d.kv_endpoint())
    got = run_in_process(p, d)[rid]
    drain(p, d)
    return got, probe.trace, _delta(_counts(d), before_d), _delta(_counts(p), before_p)


def _check_shipped(p: LLMEngine, d: LLMEngine, probe: _Probe, ref: Any, name: str) -> None:
    """Every prompt through the pair as the colocated mtp run: same tokens, trace and
    acceptance; D ran no MTP prefill; the MTP bytes sent all came; both engines leak-free."""
    bytes_before = p.stats()["kv_draft_bytes_sent"], d.stats()["kv_draft_bytes_received"]
    for i in range(len(PROMPTS)):
        tokens, trace, on_d, on_p = _through(p, d, probe, f"{name}{i}", i, ref)
        want_tokens, want_trace, want = ref[i]
        assert tokens == want_tokens
        assert trace == want_trace  # the layer's outputs on D: right KV, right hidden state
        assert on_d["spec_num_accepted_tokens"] == want["spec_num_accepted_tokens"] > 0
        assert on_d["spec_num_draft_tokens"] == want["spec_num_draft_tokens"]
        assert on_d["spec_draft_prefill_tokens"] == 0  # D ran no MTP prefill
        assert on_p["spec_draft_prefill_tokens"] == len(PROMPTS[i]) - 1 \
            == want["spec_draft_prefill_tokens"]
    s, sp = d.stats(), p.stats()
    assert s["kv_fallbacks"] == 0
    sent = sp["kv_draft_bytes_sent"] - bytes_before[0]
    assert 0 < sent == s["kv_draft_bytes_received"] - bytes_before[1]
    assert sp["kv_bytes_sent"] > sp["kv_draft_bytes_sent"]  # the target's layers too
    p.check_no_leaks(), d.check_no_leaks()


def test_p_ships_the_mtp_state_over_zmq_and_d_proposes_as_colocated(pair, reference) -> None:
    _check_shipped(*pair, reference, "z")


def test_shm_pipe_writes_the_mtp_layer_into_blocks_d_granted(model: str, reference) -> None:
    p, d, probe = _pair(model, "shm")
    try:
        _check_shipped(p, d, probe, reference, "s")
    finally:
        p.close(), d.close()


def test_a_corrupted_mtp_layer_fails_closed_and_d_speculates_after_recomputing(
        pair, reference) -> None:
    """A bit flipped in the MTP layer's KV in flight: the MAC drops it, the transfer fails
    closed, D computes the prompt itself (the MTP prefill too) and speculates as colocated."""
    p, d, probe = pair
    mtp_layer = d.runner.connector.num_target_layers
    flipped: list[int] = []

    def flip(header: dict, t: torch.Tensor) -> torch.Tensor:
        if flipped or header["layer"] != mtp_layer:
            return t
        t = t.clone()
        t.view(-1).view(torch.uint8)[t.nbytes // 2] ^= 0x01
        flipped.append(header["layer"])
        return t
    failed, fallbacks = d.stats()["kv_digest_failures"], d.stats()["kv_fallbacks"]
    with _tampered(d, flip):
        tokens, trace, on_d, _ = _through(p, d, probe, "c0", 0, reference)
    assert flipped and d.stats()["kv_fallbacks"] == fallbacks + 1
    assert d.stats()["kv_digest_failures"] == failed + 1
    assert (tokens, trace) == reference[0][:2]
    assert on_d["spec_num_accepted_tokens"] == reference[0][2]["spec_num_accepted_tokens"]
    assert on_d["spec_draft_prefill_tokens"] == len(PROMPTS[0]) - 1  # D's own, after all
    p.check_no_leaks(), d.check_no_leaks()


def test_a_wrong_hidden_state_shows_and_a_wrong_length_fails_closed(
        pair, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """P ships a wrong hidden state (a bug, not a wire error: the MAC holds): the output stays
    exact but D's layer outputs leave the colocated trace, which the tests above compare.
    One of the wrong length is refused: the transfer fails closed and is recomputed."""
    p, d, probe = pair
    real = mtp_pd.encode_hidden
    monkeypatch.setattr(mtp_pd, "encode_hidden", lambda row, dtype: real(row.roll(1), dtype))
    tokens, trace, _, _ = _through(p, d, probe, "w0", 0, reference)
    assert tokens == reference[0][0] and trace != reference[0][1]
    monkeypatch.setattr(mtp_pd, "encode_hidden", lambda row, dtype: real(row, dtype)[:-4])
    failed = d.stats()["kv_digest_failures"]
    tokens, trace, _, _ = _through(p, d, probe, "w1", 1, reference)
    assert d.stats()["kv_digest_failures"] == failed + 1
    assert (tokens, trace) == reference[1][:2]  # recomputed on D, speculating as colocated
    p.check_no_leaks(), d.check_no_leaks()


def test_without_the_mtp_state_d_decodes_without_drafts_and_a_mismatch_is_refused(
        model: str, pair, reference, monkeypatch: pytest.MonkeyPatch) -> None:
    """A P without mtp is refused at handshake; a P that ships no MTP state (the shipping
    turned off on P: as with TP > 1 or nixl) leaves D without the prompt's hidden states:
    that request decodes without drafts, its output exact."""
    p, d, probe = pair
    other = engine(model, "producer", pipe="zmq", block_size=8, compile=False)
    try:
        with pytest.raises(HandshakeError, match="speculative config mismatch"):
            other.connect_kv_peer(d.kv_endpoint())
    finally:
        other.close()
    monkeypatch.setattr(p.draft_pd.worker, "ships_draft_to", lambda peer: False)
    tokens, trace, on_d, on_p = _through(p, d, probe, "n0", 1, reference)
    assert tokens == reference[1][0]
    assert trace == [] and on_d["spec_num_draft_tokens"] == 0
    assert on_p["spec_draft_prefill_tokens"] == 0
    p.check_no_leaks(), d.check_no_leaks()


def test_request_moved_mid_speculation_continues_exactly(pair, reference) -> None:
    """D decodes a few tokens (speculating from P's MTP state), the request is ended there and
    resumed on P (an mtp engine: prompt and output recomputed): the same tokens."""
    p, d, probe = pair
    prompt, want = PROMPTS[0], reference[0][0]
    probe.seq = prompt + want
    submit_pair(p, d, "m", prompt, GREEDY, d.kv_endpoint())
    tokens: list[int] = []
    for _ in range(400):  # bounded: a step at a time until D made 5 tokens
        p.step()
        for out in d.step():
            tokens = list(out.outputs[0].token_ids)
        if len(tokens) >= 5:
            break
    assert 5 <= len(tokens) < len(want)
    assert d.stats()["spec_num_accepted_tokens"] > 0
    d.abort_request(["m"])
    drain(p, d)
    p.add_request("m2", prompt, GREEDY, resume_token_ids=tokens)
    rest: list[int] = []
    while p.has_unfinished_requests():
        for out in p.step():
            rest += out.outputs[0].delta_token_ids
    assert tokens + rest == want
    p.check_no_leaks(), d.check_no_leaks()
