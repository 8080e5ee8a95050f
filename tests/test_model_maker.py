"""Tests for pd_cluster.checkpoints.maker: offline, deterministic HF checkpoints used as test oracles."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pd_cluster.checkpoints import maker as mm, writer as checkpoint_writer
from pd_cluster.checkpoints import maker_cli as cli
from pd_cluster.checkpoints.maker import default_model_path, make_model, param_count, preset_names

ROOT = Path(__file__).resolve().parents[1]
TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  Two leading spaces, trailing tab\t",
    "Numbers 12345 and 3.14; quotes \"x\" and it's (parens)\nnew line\n\n",
    "Completely unseen: zyxwvut QQQ ###",
]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load(d: Path):
    return AutoModelForCausalLM.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)


def _greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Plain greedy loop without KV cache; also returns the top-1 minus top-2 logit gap per step."""
    ids, gaps = list(ids), []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2).values
            gaps.append(float(top[0] - top[1]))
            ids.append(int(logits.argmax()))
    return ids, gaps


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_each_arch_loads_with_auto_classes(tmp_path: Path, arch: str) -> None:
    d = make_model(tmp_path / arch, arch)
    assert d == (tmp_path / arch).absolute()
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert (d / f).is_file(), f
    model, tok = _load(d)
    cfg = model.config
    assert cfg.model_type == arch and cfg.vocab_size == 512 and cfg.num_hidden_layers == 2
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                       tok.pad_token_id) == (1, 2, 3)
    gen = json.loads((d / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 3)
    raw = json.loads((d / "config.json").read_text())
    assert raw["torch_dtype"] == "float32" and raw["rope_theta"] == 10000.0
    assert model.dtype == torch.float32 and len(tok) == 512
    has_bias = model.model.layers[0].self_attn.q_proj.bias is not None
    assert has_bias == (arch == "qwen2")
    if arch == "mistral":
        assert cfg.sliding_window is None
    ids = tok("Hello world").input_ids
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), 512) and torch.isfinite(logits).all()


def test_same_args_byte_identical_and_seed_matters(tmp_path: Path) -> None:
    a = make_model(tmp_path / "a", "qwen2", seed=3)
    b = make_model(tmp_path / "b", "qwen2", seed=3)
    c = make_model(tmp_path / "c", "qwen2", seed=4)
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha(a / f) == _sha(b / f), f
    assert _sha(a / "model.safetensors") != _sha(c / "model.safetensors")


@pytest.mark.slow  # a fresh interpreter re-imports torch+transformers (several seconds)
def test_cli_in_subprocess_is_byte_identical_to_in_process(tmp_path: Path) -> None:
    # A fresh interpreter (different hash seeds, fresh RNG state) must produce the same bytes.
    code = ("import argparse, sys; from pd_cluster.checkpoints import maker_cli as cli; p = argparse.ArgumentParser(); "
            "cli.add_make_model_args(p); sys.exit(cli.run_make_model(p.parse_args(sys.argv[1:])))")
    out = tmp_path / "cli"
    r = subprocess.run([sys.executable, "-c", code, "--out", str(out), "--arch", "mistral", "--seed", "7",
                        "--num-kv-heads", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout and "parameters" in r.stdout
    ref = make_model(tmp_path / "ref", "mistral", seed=7, num_kv_heads=1)
    assert _sha(out / "model.safetensors") == _sha(ref / "model.safetensors")
    assert _sha(out / "tokenizer.json") == _sha(ref / "tokenizer.json")


def test_tied_embeddings(tmp_path: Path) -> None:
    d = make_model(tmp_path / "tied", tie_word_embeddings=True)
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    model, _ = _load(d)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    untied = make_model(tmp_path / "untied")
    assert param_count(untied) - param_count(d) == 512 * 64


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_explicit_head_dim(tmp_path: Path, arch: str) -> None:
    d = make_model(tmp_path / "hd", arch, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32)
    model, _ = _load(d)
    assert AutoConfig.from_pretrained(d).head_dim == 32
    attn = model.model.layers[0].self_attn
    assert tuple(attn.q_proj.weight.shape) == (4 * 32, 64)
    assert tuple(attn.k_proj.weight.shape) == (2 * 32, 64)
    assert tuple(attn.o_proj.weight.shape) == (64, 4 * 32)
    assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


@pytest.mark.parametrize("kv", [1, 4])  # MQA and MHA
def test_mqa_and_mha(tmp_path: Path, kv: int) -> None:
    d = make_model(tmp_path / f"kv{kv}", num_heads=4, num_kv_heads=kv)
    model, _ = _load(d)
    assert model.config.num_key_value_heads == kv
    assert tuple(model.model.layers[0].self_attn.k_proj.weight.shape) == (kv * 16, 64)
    assert torch.isfinite(model(torch.tensor([[5, 6, 7]])).logits).all()


@pytest.mark.parametrize("kwargs, field", [
    ({"arch": "gpt2"}, "arch"),
    ({"vocab_size": 100}, "vocab_size"),
    ({"num_heads": 4, "num_kv_heads": 3}, "num_heads"),
    ({"hidden_size": 66, "num_heads": 4}, "hidden_size"),
    ({"head_dim": 15}, "head_dim"),
    ({"num_layers": 0}, "num_layers"),
    ({"intermediate_size": -1}, "intermediate_size"),
    ({"num_kv_heads": 0}, "num_kv_heads"),
    ({"rope_theta": 0.0}, "rope_theta"),
])
def test_bad_args_raise_value_error_naming_field(tmp_path: Path, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # transformers 5 loads qwen2 via Qwen2Tokenizer
def test_tokenizer_round_trip_and_chat_template(tmp_path: Path, arch: str) -> None:
    d = make_model(tmp_path / "tok", arch)
    tok = AutoTokenizer.from_pretrained(d)
    hello = tok("Hello world").input_ids
    assert hello[0] != tok.bos_token_id and tok.eos_token_id not in hello  # no specials added
    assert tok.encode("Hello world") == hello
    assert len(tok.encode("The quick brown fox")) < len("The quick brown fox")  # merges were learned
    for s in TEXTS:
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
        assert tok.decode(tok.encode(s)) == s
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "user: Hi there\nassistant: Hello!\nuser: What is 2+2?\nassistant:"
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True)
    ids = enc["input_ids"] if not isinstance(enc, list) else enc  # 5.x returns a BatchEncoding
    assert tok.decode(ids) == text
    assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == mm.CHAT_TEMPLATE


def test_padded_vocab_beyond_corpus(tmp_path: Path) -> None:
    d = make_model(tmp_path / "big", vocab_size=4096, hidden_size=32, num_heads=2, num_kv_heads=1,
                   intermediate_size=64)
    tok = AutoTokenizer.from_pretrained(d)
    n_real = json.loads((d / mm.MAKER_FILE).read_text())["tokenizer_trained_vocab"]
    assert len(tok) == 4096 and n_real < 4096
    assert tok.convert_ids_to_tokens(4095) == f"<unused_{4095 - n_real}>"
    assert max(tok.encode(" ".join(TEXTS))) < n_real
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        head = f.get_tensor("lm_head.weight")
    assert head.shape == (4096, 32) and not head[n_real:].any() and head[4:n_real].abs().sum(1).all()


def test_greedy_oracle_is_decisive_and_varied(tmp_path: Path) -> None:
    model, tok = _load(make_model(tmp_path / "m"))
    gaps, distinct = [], []
    for s in ("Hello world", "Once upon a time", "The museum opens at nine"):
        ids, g = _greedy(model, tok.encode(s), 24)
        gaps += g
        distinct.append(len(set(ids[-24:])))
    gaps.sort()
    assert gaps[len(gaps) // 2] > 0.3, gaps  # median top-1/top-2 gap far above numeric noise
    assert gaps[0] > 1e-4, gaps
    assert min(distinct) > 4, distinct  # not stuck repeating one token


def test_default_model_path_generates_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_CLUSTER_CACHE", str(tmp_path / "cache"))
    name = "tiny-random-llama"  # a generated preset (the default tiny-llama is shipped, trained)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model_path(name))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    p = tmp_path / "cache" / "models" / name
    assert results == [p] * 3
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert default_model_path(name) == p
    assert (p / "model.safetensors").stat().st_mtime_ns == mtime  # cached, not rebuilt
    assert [x.name for x in p.parent.iterdir() if not x.name.endswith(".lock")] == [name]
    _load(p)
    # A checkpoint from an older generator version is rebuilt in place.
    (p / mm.MAKER_FILE).write_text(json.dumps({"generator_version": -1}))
    assert default_model_path(name) == p
    assert json.loads((p / mm.MAKER_FILE).read_text())["generator_version"] == mm.GENERATOR_VERSION
    with pytest.raises(ValueError, match="name"):
        default_model_path("no-such-model")
    assert {"tiny-llama", "tiny-random-llama", "bench-50m"} <= set(preset_names())
    # The trained default is shipped with the package, never generated into the cache.
    assert default_model_path() == default_model_path("tiny-llama") == mm.ASSETS / "tiny-llama"
    assert not (tmp_path / "cache" / "models" / "tiny-llama").exists()


def test_atomic_write_replaces_and_never_leaves_partial(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    make_model(out)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m"]  # no temp dirs left

    def boom(*a, **k):
        raise RuntimeError("crash mid-write")

    monkeypatch.setattr(checkpoint_writer, "_patch_config", boom)
    with pytest.raises(RuntimeError):
        make_model(tmp_path / "crashed")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m"]


def test_cli_args_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    cli.add_make_model_args(parser)
    args = parser.parse_args(["--out", str(tmp_path / "c"), "--preset", "tiny-llama", "--num-layers", "1",
                              "--tie-word-embeddings", "--head-dim", "8"])
    assert cli.run_make_model(args) == 0
    cfg = AutoConfig.from_pretrained(tmp_path / "c")
    assert cfg.num_hidden_layers == 1 and cfg.tie_word_embeddings and cfg.head_dim == 8
    assert f"{param_count(tmp_path / 'c'):,}" in capsys.readouterr().out
    bad = parser.parse_args(["--out", str(tmp_path / "d"), "--num-kv-heads", "3"])
    assert cli.run_make_model(bad) == 2
    assert "num_heads" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_50m_preset(tmp_path: Path) -> None:
    d = make_model(tmp_path / "b", **mm.PRESETS["bench-50m"])
    assert 45e6 < param_count(d) < 55e6
    assert len(AutoTokenizer.from_pretrained(d)) == 4096
