"""Ship only the window (connectors/window_shipping.py): a sliding-window layer's prompt
blocks before its window go nowhere, and the decode engine never reads them.

Tiny windowed families (Gemma 3: sliding + full layers; Mistral with a window) with prompts
longer than every window, through an in-process P/D pair whose decode engine's cache is first
filled with huge values: any read of a block that was not shipped would change the tokens,
which equal HF's greedy ones. The bytes shipped are exactly the window's blocks; a repeat of
the prompt on the same pair (the decode engine's prefix cache) stays exact, as does P/D at
different TP sizes. Leak checks after each."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from connectors.window_shipping import first_shipped_token, unshipped_blocks
from pd_cluster import SamplingParams
from pd_cluster.checkpoints.maker import PRESETS, make_model
from tests.conftest import assert_greedy_matches, hf_greedy, random_prompt
from tests.pd_helpers import colocated_tokens, drain, engine, run_in_process, submit_pair

BS = 8
NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def test_first_shipped_token_is_the_first_decodes_window() -> None:
    # The first decode sits at position L and sees keys > L - W: from L - W + 1, block-aligned.
    assert first_shipped_token(70, 16, 8) == 48  # 55 -> block 6
    assert first_shipped_token(70, None, 8) == 0
    assert first_shipped_token(10, 16, 8) == 0  # shorter than the window: everything
    assert unshipped_blocks(70, (16, None, 24), 8) == 6


def _bytes_per_block(model: str, layer_windows: list[int | None], prompt_len: int) -> int:
    """Bytes the producer ships for one prompt (fp32: the CPU's auto)."""
    cfg = json.loads(Path(model, "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block = 2 * BS * cfg["num_key_value_heads"] * head_dim * 4
    blocks = -(-prompt_len // BS)
    return sum(block * (blocks - first_shipped_token(prompt_len, w, BS) // BS)
               for w in layer_windows)


@pytest.fixture(scope="module", params=["tiny-gemma3", "tiny-mistral-window"])
def windowed(request, tmp_path_factory) -> tuple[str, list[int | None]]:
    name = request.param
    model = str(make_model(tmp_path_factory.mktemp("win") / name, **PRESETS[name]))
    cfg = json.loads(Path(model, "config.json").read_text())
    window = cfg["sliding_window"]
    types = cfg.get("layer_types") or ["sliding_attention"] * cfg["num_hidden_layers"]
    return model, [window if t == "sliding_attention" else None for t in types]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_window_only_is_shipped_never_read_beyond_and_hf_exact(windowed, backend) -> None:
    model, windows = windowed
    prompts = [random_prompt(n, seed=n) for n in (45, 70)]  # longer than every window
    args = dict(block_size=BS, num_kv_blocks=48, attention_backend=backend)
    p, d = engine(model, "producer", **args), engine(model, "consumer", **args)
    try:
        for cache in d.runner.kv_caches:  # a block D reads that P did not send shows
            cache.fill_(1e4)
        for rid, prompt in (("a", prompts[0]), ("b", prompts[1]),
                            ("again", prompts[1] + random_prompt(9, seed=3))):
            sent = p.stats()["kv_bytes_sent"]
            submit_pair(p, d, rid, prompt, GREEDY, d.kv_endpoint())
            got = run_in_process(p, d)[rid]
            drain(p, d)
            assert d.stats()["kv_fallbacks"] == 0
            assert_greedy_matches(model, prompt, got, hf_greedy(model, prompt, NEW))
            if rid != "again":  # (the repeat ships only what D's prefix cache lacks)
                assert p.stats()["kv_bytes_sent"] - sent == _bytes_per_block(
                    model, windows, len(prompt))
            p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()


@pytest.mark.parametrize("p_size, d_size", [(2, 1), (1, 2)])
@pytest.mark.parametrize("name", ["tiny-mistral-window", "tiny-gemma3"])
def test_window_shipping_across_tp_sizes(tmp_path_factory, name: str, p_size: int,
                                         d_size: int) -> None:
    """tiny-gemma3: full and sliding layers, so KV cache groups on both ends at every TP."""
    model = str(make_model(tmp_path_factory.mktemp("wtp") / "m", **PRESETS[name]))
    prompts = [random_prompt(n, seed=n) for n in (40, 61)]
    want = colocated_tokens(model, prompts, [GREEDY] * 2, block_size=BS, num_kv_blocks=64)
    args = dict(num_kv_blocks=64, collective_timeout=20.0, block_size=BS)
    p = engine(model, "producer", tensor_parallel_size=p_size, **args)
    d = engine(model, "consumer", tensor_parallel_size=d_size, **args)
    try:
        if name == "tiny-gemma3":
            assert d.runner.layer_group is not None and p.runner.layer_group is not None
        if d_size == 1:
            for cache in d.runner.kv_caches:
                cache.fill_(1e4)
        for i, prompt in enumerate(prompts):
            submit_pair(p, d, f"r{i}", prompt, GREEDY, d.kv_endpoint())
        done = run_in_process(p, d)
        assert [done["r0"], done["r1"]] == want
        assert d.stats()["kv_fallbacks"] == 0
        drain(p, d)
        p.check_no_leaks(), d.check_no_leaks()
    finally:
        p.close(), d.close()
