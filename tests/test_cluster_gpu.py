"""The shipped GPU configs end to end: P/D output equals one colocated engine's on the same GPU
kind and dtype, the KV really crossed, nothing leaked.

configs/one-gpu.yaml: P and D share one GPU (memory fractions), KV over ZMQ via pinned host
copies. configs/two-gpu.yaml: one GPU each, KV over NCCL. Skipped without the hardware.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest


pytestmark = pytest.mark.timeout(900)  # clusters launched on GPUs


def _gpus() -> int:
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_NO_GPU = _gpus() < 1
_NO_TWO = _gpus() < 2 or importlib.util.find_spec("cupy") is None


def _pd_matches_reference(config: str, tmp_path, monkeypatch, engine: dict[str, Any],
                          ref_engine: dict[str, Any]) -> dict[str, Any]:
    """Launch configs/<config>.yaml, compare greedy outputs with a colocated engine, check the
    KV went P -> D with no fallback and no leak; returns the final cluster status."""
    import httpx
    import openai

    from pd_cluster import LLM, SamplingParams
    from pd_cluster.serving.cluster.cluster_config import resolve_model
    from pd_cluster.serving.cluster.launcher import launch
    from pd_cluster.serving.cluster.testing import ensure_ray, leak_reports, local_config, wait_idle

    monkeypatch.setenv("PD_CLUSTER_STATE_DIR", str(tmp_path))
    ensure_ray()
    cfg = local_config(config, f"test-{config}-{os.getpid()}", engine=engine,
                       proxy={"host": "127.0.0.1", "disaggregation": "always"})  # KV must cross
    cluster = launch(cfg, progress=False)
    try:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0)
        # The reference runs beside the cluster, on the same device and dtype (bf16 on CUDA).
        ref = LLM(model=resolve_model(cfg.model), device="cuda", dtype="bfloat16", **ref_engine)
        prompts = [[4 + (i * 37 + j * 11) % 400 for j in range(n)]
                   for i, n in enumerate((5, 40, 130, 300))]
        for prompt in prompts:
            expected = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                             ignore_eos=True))[0].outputs[0]
            r = client.completions.create(model=cfg.model_name, prompt=prompt, max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True,
                                                                     "return_token_ids": True})
            assert r.choices[0].token_ids == list(expected.token_ids)  # type: ignore[attr-defined]
        ref.engine.check_no_leaks()
        st = wait_idle(cluster.url, timeout=60)
        d = next(e for e in st["engines"] if e["role"] == "decode")
        assert d["stats"].get("kv_bytes_received", 0) > 0  # the KV really crossed
        assert d["stats"].get("kv_fallbacks", 0) == 0
        assert leak_reports(cluster) == {}
        assert httpx.get(f"{cluster.url}/health").status_code == 200
        return st
    finally:
        cluster.shutdown()


@pytest.mark.cuda
@pytest.mark.skipif(_NO_GPU, reason="needs a CUDA GPU")
def test_one_gpu_pd_over_zmq_matches_single_engine(tmp_path, monkeypatch) -> None:
    """Both engines size their caches from gpu_memory_utilization on one GPU: each counts only
    its own weights, so the second is not charged for the first one's cache."""
    st = _pd_matches_reference("one-gpu", tmp_path, monkeypatch, engine={},
                               ref_engine={"num_kv_blocks": 256, "max_model_len": 1024})
    p, d = (next(e["stats"]["kv_blocks_total"] for e in st["engines"] if e["role"] == role)
            for role in ("prefill", "decode"))
    assert p > 0 and d > 0 and abs(p - d) <= 0.1 * max(p, d), (p, d)  # equal shares


@pytest.mark.two_gpu
@pytest.mark.skipif(_NO_TWO, reason="needs 2 CUDA GPUs (NCCL refuses two ranks on one GPU) "
                                    "and cupy (pip install 'pd-cluster[nccl]')")
def test_two_gpu_nccl_pd_matches_single_engine(tmp_path, monkeypatch) -> None:
    fixed = {"num_kv_blocks": 1024, "max_model_len": 1024}  # fixed size: GPUs stay shareable
    _pd_matches_reference("two-gpu", tmp_path, monkeypatch, engine=fixed, ref_engine=fixed)
