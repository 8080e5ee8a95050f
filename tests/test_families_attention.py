"""The torch attention backend's per-layer options (sliding window, logit soft-cap, attention
sinks, scale) against a dense reference written from the definitions, on a paged cache with
decodes and chunked prefills in one batch. (The Triton kernels are checked against the same
options in tests/test_kernels.py.)"""
from __future__ import annotations

import pytest
import torch

from pd_cluster.attention import AttentionMetadata, AttentionOptions
from pd_cluster.attention.torch_backend import TorchAttentionBackend

HQ, HKV, D, BS = 4, 2, 16, 8
# (seq_len, q_len): two decodes (one inside, one far past the window), then prefill chunks
# after a cached prefix and a whole prompt.
REQS = [(5, 1), (61, 1), (40, 11), (23, 23), (9, 4)]


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    opts: AttentionOptions) -> torch.Tensor:
    """One request: q [Lq, HQ, D] at positions q_pos over its whole context k/v [L, HKV, D]."""
    out = torch.empty_like(q)
    group = HQ // HKV
    for t in range(q.shape[0]):
        p = int(q_pos[t])
        for h in range(HQ):
            keys = [j for j in range(p + 1)
                    if opts.sliding_window is None or p - j < opts.sliding_window]
            s = torch.stack([q[t, h] @ k[j, h // group] * opts.scale for j in keys])
            if opts.logit_softcap is not None:
                s = opts.logit_softcap * torch.tanh(s / opts.logit_softcap)
            w = torch.exp(s - s.max())
            denom = w.sum()
            if opts.sinks is not None:
                denom = denom + torch.exp(opts.sinks[h] - s.max())
            out[t, h] = sum(w[i] * v[j, h // group] for i, j in enumerate(keys)) / denom
    return out


def run_backend(opts: AttentionOptions, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(s for s, _ in REQS) // BS)
    num_blocks = len(REQS) * max_blocks + 1
    cache = torch.zeros(2, num_blocks, BS, HKV, D)
    perm = torch.randperm(num_blocks - 1, generator=gen)[: len(REQS) * max_blocks] + 1
    tables = perm.view(len(REQS), max_blocks).to(torch.int32)
    backend = TorchAttentionBackend()
    locs, slots, qs, refs = [0], [], [], []
    for i, (seq_len, q_len) in enumerate(REQS):
        k = torch.randn(seq_len, HKV, D, generator=gen)
        v = torch.randn(seq_len, HKV, D, generator=gen)
        q = torch.randn(q_len, HQ, D, generator=gen)
        pos = torch.arange(seq_len)
        all_slots = tables[i].long()[pos // BS] * BS + pos % BS
        ctx = seq_len - q_len  # the cached prefix is already in the cache
        flat = cache.view(2, -1, HKV, D)
        flat[0, all_slots[:ctx]], flat[1, all_slots[:ctx]] = k[:ctx], v[:ctx]
        slots.append(all_slots[ctx:])
        locs.append(locs[-1] + q_len)
        qs.append((q, k[ctx:], v[ctx:]))
        refs.append(dense_reference(q, k, v, pos[ctx:], opts))
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=torch.tensor(locs, dtype=torch.int32),
        seq_lens=torch.tensor([s for s, _ in REQS], dtype=torch.int32), block_tables=tables,
        num_decodes=2, max_query_len=max(q for _, q in REQS),
        max_seq_len=max(s for s, _ in REQS), block_size=BS, query_start_loc_cpu=locs,
        seq_lens_cpu=[s for s, _ in REQS])
    backend.write_kv(torch.cat([k for _, k, _ in qs]), torch.cat([v for _, _, v in qs]),
                     cache, meta)
    got = backend.forward(torch.cat([q for q, _, _ in qs]), cache, meta, opts)
    return got, torch.cat(refs)


SINKS = torch.tensor([0.5, -1.0, 2.0, 4.0])
OPTIONS = {
    "plain": AttentionOptions(D ** -0.5),
    "window": AttentionOptions(D ** -0.5, sliding_window=7),
    "window-1": AttentionOptions(D ** -0.5, sliding_window=1),  # attends to itself only
    "softcap": AttentionOptions(0.6, logit_softcap=1.5),
    "sinks": AttentionOptions(D ** -0.5, sinks=SINKS),
    "all": AttentionOptions(0.3, sliding_window=10, logit_softcap=3.0, sinks=SINKS),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_torch_backend_matches_dense_reference(name: str) -> None:
    got, want = run_backend(OPTIONS[name])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_each_option_changes_the_result() -> None:
    """The reference is sensitive to every option (so the checks above can fail)."""
    plain, _ = run_backend(OPTIONS["plain"])
    for name in ("window", "sinks"):
        assert not torch.allclose(run_backend(OPTIONS[name])[0], plain, atol=1e-3)
    capped, _ = run_backend(OPTIONS["softcap"])
    assert not torch.allclose(capped, run_backend(AttentionOptions(0.6))[0], atol=1e-3)


@pytest.mark.parametrize("field, value", [("sliding_window", 0), ("logit_softcap", -1.0)])
def test_invalid_options_are_rejected(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field.replace("logit_softcap", "softcapping")):
        AttentionOptions(1.0, **{field: value})
