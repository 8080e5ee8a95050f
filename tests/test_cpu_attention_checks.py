"""The C++ paged attention checks its inputs: each kind of bad metadata or mismatched tensor is
a RuntimeError naming the problem. In-process on purpose: a kernel that read or wrote out of
bounds instead would crash pytest itself (or corrupt memory), which is what these guard."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from kernels import cpu_build

pytestmark = pytest.mark.skipif(cpu_build.disabled_by_env(), reason="PD_CLUSTER_CPU_KERNELS=0")

BS, NUM_BLOCKS, HQ, HKV, D = 4, 6, 4, 2, 16


@pytest.fixture(autouse=True)
def _kernel_built() -> None:
    assert cpu_build.load_cpu_kernels(), f"CPU kernel failed to build: {cpu_build.load_error()}"


def valid_args() -> dict[str, Any]:
    """Two requests: a decode at position 6 (2 blocks) and a 3-token prefill (1 block)."""
    torch.manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS, BS, HKV, D)
    return {"out": torch.empty(4, HQ, D), "query": torch.randn(4, HQ, D),
            "key_cache": cache[0], "value_cache": cache[1],
            "block_tables": torch.tensor([[3, 1], [5, 0]], dtype=torch.int32),
            "seq_lens": torch.tensor([7, 3], dtype=torch.int32),
            "query_start_loc": torch.tensor([0, 1, 4], dtype=torch.int32),
            "scale": D ** -0.5, "window": 0, "softcap": 0.0, "sinks": None}


def call(args: dict[str, Any]) -> None:
    torch.ops.pd_cluster_cpu.paged_attention(
        args["out"], args["query"], args["key_cache"], args["value_cache"],
        args["block_tables"], args["seq_lens"], args["query_start_loc"], args["scale"],
        args["window"], args["softcap"], args["sinks"])


def test_valid_call_runs() -> None:
    args = valid_args()
    call(args)
    assert torch.isfinite(args["out"]).all()


def _set(key: str, value: Callable[[], Any]) -> Callable[[dict[str, Any]], None]:
    def edit(args: dict[str, Any]) -> None:
        args[key] = value()
    return edit


def _i32(*values: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.tensor(values, dtype=torch.int32)


BAD = {
    "qsl-negative-start": (_set("query_start_loc", _i32(-1, 1, 4)), "start at a row >= 0"),
    "qsl-not-monotone": (_set("query_start_loc", _i32(0, 3, 1)), "not monotone at request 1"),
    "qsl-past-query": (_set("query_start_loc", _i32(0, 1, 9)), "past the query's 4 rows"),
    "qsl-count": (_set("query_start_loc", _i32(0, 4)), "needs requests \\+ 1"),
    "seq-shorter-than-query": (_set("seq_lens", _i32(7, 2)), "seq_len 2 < its 3 query"),
    "negative-seq-len": (_set("seq_lens", _i32(-1, 3)), "seq_len -1 < its 1 query"),
    "table-too-narrow": (_set("seq_lens", _i32(9, 3)), "holds 2 blocks of 4 tokens"),
    "block-id-too-big": (_set("block_tables", lambda: torch.tensor(
        [[3, NUM_BLOCKS], [5, 0]], dtype=torch.int32)), "block id 6 .*outside the cache's 6"),
    "block-id-negative": (_set("block_tables", lambda: torch.tensor(
        [[3, 1], [-2, 0]], dtype=torch.int32)), "request 1 uses block id -2"),
    "too-few-table-rows": (_set("block_tables", lambda: torch.tensor(
        [[3, 1]], dtype=torch.int32)), "block_tables has 1 rows for 2 requests"),
    "table-dtype": (_set("block_tables", lambda: torch.tensor([[3, 1], [5, 0]])),
                    "block_tables must be int32"),
    "seq-lens-dtype": (_set("seq_lens", lambda: torch.tensor([7, 3])),
                       "seq_lens and query_start_loc must be contiguous 1-d int32"),
    "value-blocks": (_set("value_cache", lambda: torch.randn(NUM_BLOCKS - 1, BS, HKV, D)),
                     "value cache shape .* does not match key cache"),
    "value-block-size": (_set("value_cache", lambda: torch.randn(NUM_BLOCKS, BS + 1, HKV, D)),
                         "value cache shape .* in dim 1"),
    "value-strides": (_set("value_cache", lambda: torch.randn(BS, NUM_BLOCKS, HKV, D)
                           .transpose(0, 1)), "value cache strides"),
    "value-dtype": (_set("value_cache", lambda: torch.randn(NUM_BLOCKS, BS, HKV, D).half()),
                    "value cache dtype Half differ"),
    "out-dtype": (_set("out", lambda: torch.empty(4, HQ, D, dtype=torch.bfloat16)),
                  "out dtype BFloat16 and query dtype Float differ"),
    "out-rows": (_set("out", lambda: torch.empty(3, HQ, D)), "out must be \\[tokens"),
    "query-heads": (_set("query", lambda: torch.randn(4, 3, D)), "multiple of kv heads"),
    "query-dim": (_set("query", lambda: torch.randn(4, HQ, D + 1)), "query head dim 17"),
    "query-int": (_set("query", lambda: torch.zeros(4, HQ, D, dtype=torch.int32)),
                  "out dtype Float and query dtype Int differ"),
    "cache-rank": (_set("key_cache", lambda: torch.randn(NUM_BLOCKS, BS, HKV * D)),
                   "key/value cache must be"),
    "window": (_set("window", lambda: -1), "window must be >= 0"),
    "sinks-count": (_set("sinks", lambda: torch.zeros(HQ + 1)), "sinks: one per query head"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_an_error(case: str) -> None:
    edit, message = BAD[case]
    args = valid_args()
    edit(args)
    with pytest.raises(RuntimeError, match=message):
        call(args)


def test_a_slice_of_requests_keeps_its_rows() -> None:
    """A slice of the batch's requests (``paged_attention(reqs=...)``) starts past row 0: it
    passes the checks and computes the same rows as the whole batch."""
    whole = valid_args()
    call(whole)
    part = valid_args()
    part["out"] = torch.zeros(4, HQ, D)
    for key in ("seq_lens", "block_tables"):
        part[key] = part[key][1:]
    part["query_start_loc"] = part["query_start_loc"][1:]
    call(part)
    torch.testing.assert_close(part["out"][1:], whole["out"][1:])
    assert part["out"][0].abs().sum() == 0  # the first request's row: not its to write
