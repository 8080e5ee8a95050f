"""Per-step input tensors written into persistent buffers: the same values the step's lists
describe, the same memory from step to step, grown when a step is larger than the buffers."""
from __future__ import annotations

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
