"""Per-step input tensors written into persistent buffers: the same values the step's lists
describe, the same memory from step to step, grown when a step is larger than the buffers; and
with asynchronous host-to-device copies (CUDA's, or a fake stream that runs them late), no host
buffer rewritten before the copy that reads it ran (issue 38, item 5a)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pd_cluster.engine.input_buffers import InputBuffers
from pd_cluster.engine.step_input import StepInput


def step_of(reqs: list[tuple[int, int, list[int], int]]) -> StepInput:
    """reqs: (computed tokens, new tokens, block ids, prompt length); decodes first."""
    tokens, positions, starts, lens = [], [], [0], []
    for done, new, _, _ in reqs:
        tokens += [(done + i) * 7 % 50 for i in range(new)]
        positions += list(range(done, done + new))
        starts.append(starts[-1] + new)
        lens.append(done + new)
    width = max(len(b) for _, _, b, _ in reqs)
    tables = [b + [0] * (width - len(b)) for _, _, b, _ in reqs]
    return StepInput(tokens, positions, starts, lens, tables,
                     sum(1 for _, n, _, _ in reqs if n == 1), [p for *_, p in reqs])


def check(t, step: StepInput, bs: int) -> None:
    assert t.token_ids.tolist() == step.tokens
    assert t.positions.tolist() == step.positions
    assert t.meta.query_start_loc.tolist() == step.query_start
    assert t.meta.seq_lens.tolist() == step.seq_lens
    assert t.meta.block_tables.tolist() == step.block_tables
    slots, rope = [], []
    for i, table in enumerate(step.block_tables):
        for p in step.positions[step.query_start[i]:step.query_start[i + 1]]:
            slots.append(table[p // bs] * bs + p % bs)
            rope.append(max(step.prompt_lens[i], p + 1))
    assert t.meta.slot_mapping.tolist() == slots
    assert t.rope_lens.tolist() == rope
    assert t.meta.num_decodes == step.num_decodes
    assert t.meta.seq_lens_cpu == step.seq_lens and t.meta.query_start_loc_cpu == step.query_start
    assert t.meta.max_seq_len == max(step.seq_lens)
    assert t.meta.max_query_len == max(b - a for a, b in zip(step.query_start,
                                                             step.query_start[1:]))


def test_values_and_reuse() -> None:
    bs = 4
    buffers = InputBuffers(max_tokens=32, max_reqs=4, max_blocks=8, block_size=bs,
                           device=torch.device("cpu"))
    first = step_of([(9, 1, [3, 5, 1], 9), (4, 1, [2, 7], 6), (0, 6, [4, 6], 6)])
    t1 = buffers.prepare(first)
    check(t1, first, bs)
    ptrs = (t1.token_ids.data_ptr(), t1.meta.block_tables.data_ptr(),
            t1.meta.slot_mapping.data_ptr())
    second = step_of([(10, 1, [3, 5, 1], 9), (3, 9, [0, 8, 9], 12)])
    t2 = buffers.prepare(second)
    check(t2, second, bs)
    assert (t2.token_ids.data_ptr(), t2.meta.block_tables.data_ptr(),
            t2.meta.slot_mapping.data_ptr()) == ptrs  # the same memory, rewritten


def test_grows_past_its_sizes() -> None:
    buffers = InputBuffers(max_tokens=2, max_reqs=1, max_blocks=1, block_size=2,
                           device=torch.device("cpu"))
    step = step_of([(5, 1, [1, 2, 3], 5), (0, 7, [4, 5, 6, 7], 7)])
    check(buffers.prepare(step), step, 2)
    assert (buffers.max_tokens, buffers.max_reqs, buffers.max_blocks) == (8, 2, 4)


# ---- asynchronous copies: the double-buffer / event discipline, with a fake stream ---------

class FakeStream:
    """A device stream that runs work only when something waits for it (an event, a sync),
    as a busy GPU would. Each queued copy checks that its source still holds what it held
    when the copy was issued: a host buffer rewritten before its copy ran is a violation."""

    def __init__(self) -> None:
        self.queue: list = []
        self.ran = 0
        self.violations: list[str] = []
        self.waits = 0

    def run_until(self, mark: int) -> None:
        while self.ran < mark:
            self.queue[self.ran]()
            self.ran += 1

    def sync(self) -> None:
        self.run_until(len(self.queue))


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.mark = stream, None

    def record(self) -> None:
        self.mark = len(self.stream.queue)

    def synchronize(self) -> None:
        self.stream.waits += 1
        if self.mark is not None:
            self.stream.run_until(self.mark)


class FakeCopier:
    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        issued = src.clone()

        def run() -> None:
            if not torch.equal(src, issued):
                self.stream.violations.append(f"copy #{len(self.stream.queue)}: source "
                                              "rewritten before the copy ran")
            dst.copy_(src)
        self.stream.queue.append(run)

    def event(self) -> FakeEvent:
        return FakeEvent(self.stream)


def _snapshot(t) -> SimpleNamespace:
    """What the forward reads, cloned when the stream runs it."""
    m = t.meta
    return SimpleNamespace(
        token_ids=t.token_ids.clone(), positions=t.positions.clone(),
        rope_lens=t.rope_lens.clone(),
        meta=SimpleNamespace(**{**vars(m), **{k: getattr(m, k).clone() for k in (
            "slot_mapping", "query_start_loc", "seq_lens", "block_tables")}}))


# A long prompt prefilled in chunks (no step samples) beside decodes, a step that grows the
# buffers while copies are queued, and sampling steps (a full sync) in between.
STEPS = [  # (requests, samples)
    ([(0, 4, [1, 2], 20)], False),
    ([(4, 4, [1, 2], 20)], False),
    ([(8, 4, [1, 2, 3], 20)], False),
    ([(12, 4, [1, 2, 3, 4], 20)], False),
    ([(7, 1, [5, 6], 7), (16, 4, [1, 2, 3, 4, 9], 20)], True),
    ([(8, 1, [5, 6, 7], 7), (0, 30, [10, 11, 12, 13, 14, 15, 16, 17], 40)], False),  # grows
    ([(9, 1, [5, 6, 7], 7), (30, 10, [10, 11, 12, 13, 14, 15, 16, 17, 18, 19], 40)], False),
    ([(10, 1, [5, 6, 7], 7), (40, 1, [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], 40)], True),
    ([(11, 1, [5, 6, 7], 7)], False),
    ([(12, 1, [5, 6, 7, 8], 7)], False),
]


def test_async_copies_never_read_a_rewritten_host_buffer() -> None:
    """Without the slots and events (one buffer rewritten while its copy waits in the stream)
    the forward of a no-sample step reads the next step's token ids and slots."""
    bs, stream = 4, FakeStream()
    buffers = InputBuffers(max_tokens=8, max_reqs=2, max_blocks=4, block_size=bs,
                           device=torch.device("cpu"), copier=FakeCopier(stream))
    seen, steps, first_copy = [], [], []
    for i, (reqs, samples) in enumerate(STEPS):
        step = step_of(reqs)
        first_copy.append(len(stream.queue))
        t = buffers.prepare(step)
        steps.append(step)
        if i and not STEPS[i - 1][1]:
            # Not over-synchronised: this step waited for the copies two steps back at most;
            # the previous step's are still queued (the CPU stays one step ahead).
            assert stream.ran <= first_copy[i - 1]
        stream.queue.append(lambda t=t: seen.append(_snapshot(t)))  # the forward
        if samples:
            stream.sync()  # the sampled tokens come back to the host
    stream.sync()
    assert stream.violations == []
    assert len(seen) == len(STEPS)
    for snap, step in zip(seen, steps):
        check(snap, step, bs)
    assert stream.waits > 0  # the events were waited on, not just recorded
    assert (buffers.max_tokens, buffers.max_reqs, buffers.max_blocks) == (31, 2, 11)


def test_cpu_has_one_slot_and_no_copies() -> None:
    """The CPU fast path: the inputs are the host buffers themselves, nothing is copied."""
    buffers = InputBuffers(8, 2, 4, 4, torch.device("cpu"))
    assert buffers.copier is None and len(buffers._slots) == 1
    t = buffers.prepare(step_of([(3, 1, [1], 4)]))
    assert t.token_ids.data_ptr() == buffers._slots[0].tensors["token_ids"].data_ptr()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copies_behind_a_busy_stream_read_their_own_step() -> None:
    """The CUDA twin of the fake-stream test: a sleeping kernel before each step's forward keeps
    the copies queued while the CPU prepares the next steps; each forward (a clone on the
    stream) must still see its own step's inputs."""
    bs = 4
    buffers = InputBuffers(max_tokens=8, max_reqs=2, max_blocks=4, block_size=bs,
                           device=torch.device("cuda"))
    seen, steps = [], []
    for reqs, _ in STEPS:
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU time: the stream lags the CPU
        step = step_of(reqs)
        steps.append(step)
        seen.append(_snapshot(buffers.prepare(step)))  # queued clones, run in stream order
    torch.cuda.synchronize()
    for snap, step in zip(seen, steps):
        check(snap, step, bs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_long_prompt_chunked_behind_a_busy_stream_is_hf_exact(tiny_model) -> None:
    """A prompt alone, prefilled in 32-token chunks: ~20 steps that sample nothing (no sync),
    each forward behind a sleeping kernel so the CPU prepares the next chunks while this
    chunk's copies still wait. HF-exact (one overwritten buffer would write KV to the wrong
    slots), then equal to the same prompt prefilled in one step."""
    from pd_cluster.llm import LLM
    from pd_cluster.sampling_params import SamplingParams
    from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt

    model_dir = tiny_model(max_position_embeddings=1024)
    prompt, max_tokens = random_prompt(700, seed=38), 8
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for chunk in (32, 1024):
        llm = LLM(model=model_dir, device="cuda", dtype="float32", attention_backend="triton",
                  compile=False, cuda_graphs=False, max_num_batched_tokens=chunk,
                  block_size=16, num_kv_blocks=128)
        runner = llm.engine.runner
        forward = runner.forward_model

        def slow(input_ids, positions, ctx, forward=forward):
            torch.cuda._sleep(20_000_000)  # ~10 ms: the stream lags the CPU
            return forward(input_ids, positions, ctx)

        runner.forward_model = slow
        outs[chunk] = llm.generate([prompt], params)[0].outputs[0].token_ids
        llm.engine.check_no_leaks()
        llm.close()
    assert_greedy_matches(model_dir, prompt, outs[32], hf_greedy(model_dir, prompt, max_tokens))
    assert outs[32] == outs[1024]
