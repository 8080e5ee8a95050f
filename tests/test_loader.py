"""Checkpoint loading: sharded checkpoints with model.safetensors.index.json, bf16 checkpoints,
one-line errors for checkpoints that do not match, and host memory that stays near the model's
own size while a sharded checkpoint streams in (one tensor at a time)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pd_cluster.checkpoints.maker import make_model
from pd_cluster.models.loader import checkpoint_files, load_model

SMALL = dict(arch="qwen2", num_layers=2, hidden_size=64, intermediate_size=128)


def _load(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return load_model(str(model_dir), cfg, dtype, torch.device("cpu"))


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path: Path) -> None:
    one = make_model(tmp_path / "one", seed=3, **SMALL)
    sharded = make_model(tmp_path / "sharded", seed=3, max_shard_size="100KB", **SMALL)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(checkpoint_files(str(sharded))) > 2
    a, b = _load(one).state_dict(), _load(sharded).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_checkpoint_loads_in_any_dtype(tmp_path: Path) -> None:
    src = make_model(tmp_path / "fp32", seed=1, **SMALL)
    bf16_dir = tmp_path / "bf16"
    bf16_dir.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, bf16_dir / f.name,
                      metadata={"format": "pt"})
        else:
            (bf16_dir / f.name).write_bytes(f.read_bytes())
    ref = load_file(bf16_dir / "model.safetensors")
    model = _load(bf16_dir, torch.float32)
    qkv = model.model.layers[1].self_attn.qkv_proj
    want = torch.cat([ref[f"model.layers.1.self_attn.{p}_proj.bias"] for p in "qkv"]).float()
    assert qkv.bias.dtype == torch.float32 and torch.equal(qkv.bias, want)
    half = _load(bf16_dir, torch.float16)
    assert all(p.dtype == torch.float16 for p in half.parameters())


def test_checkpoint_missing_a_tensor_is_rejected(tmp_path: Path) -> None:
    src = make_model(tmp_path / "m", seed=1, **SMALL)
    state = load_file(src / "model.safetensors")
    del state["model.layers.0.self_attn.k_proj.weight"]
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing.*layers.0.self_attn.qkv_proj.weight"):
        _load(src)


_PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, threading, time, torch
    from pd_cluster.models.loader import load_model

    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

    def load(model_dir):
        cfg = json.load(open(model_dir + "/config.json"))
        return load_model(model_dir, cfg, torch.bfloat16, torch.device("cpu"))

    load(sys.argv[2])  # a tiny model first: one-time costs (thread pools, imports) paid
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.0005)

    base = rss()
    t = threading.Thread(target=sample)
    t.start()
    model = load(sys.argv[1])
    stop.set()
    t.join()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"growth": max(peak[0], rss()) - base, "weights": weights}))
""")


def test_peak_host_memory_while_loading_a_sharded_checkpoint(tmp_path: Path) -> None:
    """fp32 shards loaded as bf16: the old loader held every shard's tensors (2x the bf16
    model) before building the model; streaming stays near the bf16 model plus one shard."""
    tiny = make_model(tmp_path / "tiny", arch="llama")  # same family: same imports
    model_dir = make_model(tmp_path / "big", arch="llama", vocab_size=4096, hidden_size=256,
                           num_layers=8, num_heads=4, num_kv_heads=2, intermediate_size=1024,
                           max_shard_size="6MB")
    shards = checkpoint_files(str(model_dir))
    checkpoint = sum(f.stat().st_size for f in shards)
    largest = max(f.stat().st_size for f in shards)
    assert len(shards) >= 5
    res = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(model_dir), str(tiny)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"checkpoint {checkpoint / 2**20:.1f} MiB in {len(shards)} shards, bf16 weights "
          f"{got['weights'] / 2**20:.1f} MiB, peak RSS growth {got['growth'] / 2**20:.1f} MiB")
    # The model itself, plus at most about one shard in flight (a tensor read, its pages).
    assert got["growth"] < got["weights"] + largest + 4 * 2**20
    assert got["growth"] < checkpoint  # never the whole (fp32) checkpoint at once


def test_generation_config_eos_ids_all_end_generation(tmp_path: Path) -> None:
    """Llama 3 lists several EOS ids in generation_config.json; each ends a request, as in
    HF's generate (ours stops where HF, given the same list, stops)."""
    from pd_cluster import LLM, SamplingParams
    from tests.conftest import hf_model, random_prompt

    model_dir = make_model(tmp_path / "m", seed=2, **SMALL)
    prompt = random_prompt(20, seed=4)
    free = LLM(model=str(model_dir)).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    tokens = free.outputs[0].token_ids
    stop_at = next(i for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    eos = [2, tokens[stop_at], 511]  # the second of three ends this continuation
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    gen["eos_token_id"] = eos
    gen_path.write_text(json.dumps(gen))
    llm = LLM(model=str(model_dir))
    assert llm.engine.eos_token_id == tuple(eos)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids == tokens[:stop_at + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None  # an EOS, not a stop_token_ids entry
    hf = hf_model(str(model_dir))
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=12, eos_token_id=eos, pad_token_id=3)[0, 20:]
    assert out.token_ids == want.tolist()
    llm.engine.check_no_leaks()
