"""configs/two-gpu.yaml end to end: P and D on two GPUs, KV shipped over the NCCL pipe.

Skipped unless two CUDA GPUs and CuPy are present (NCCL refuses two ranks on one GPU).
"""
from __future__ import annotations

import importlib.util
import os

import pytest


def _two_gpus_and_cupy() -> tuple[bool, str]:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False, "torch missing"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return False, "needs 2 CUDA GPUs (NCCL refuses two ranks on one GPU)"
    if importlib.util.find_spec("cupy") is None:
        return False, "needs cupy (pip install 'pd-cluster[nccl]')"
    return True, ""


_OK, _WHY = _two_gpus_and_cupy()
pytestmark = [pytest.mark.two_gpu, pytest.mark.skipif(not _OK, reason=_WHY)]


def test_two_gpu_nccl_pd_matches_single_engine(tmp_path, monkeypatch) -> None:
    import httpx
    import openai

    from pd_cluster import LLM, SamplingParams
    from pd_cluster.serving.cluster_config import resolve_model
    from pd_cluster.serving.launcher import launch
    from pd_cluster.serving.testing import ensure_ray, leak_reports, local_config, wait_idle

    monkeypatch.setenv("PD_CLUSTER_STATE_DIR", str(tmp_path))
    ensure_ray()
    engine = {"num_kv_blocks": 1024, "max_model_len": 1024}  # fixed size: GPUs stay shareable
    cfg = local_config("two-gpu", f"test-two-gpu-{os.getpid()}", engine=engine,
                       proxy={"host": "127.0.0.1"})
    cluster = launch(cfg, progress=False)
    try:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="x", max_retries=0)
        # Reference: one colocated engine with the same dtype/device (bf16 on CUDA).
        ref = LLM(model=resolve_model(cfg.model), device="cuda", dtype="bfloat16", **engine)
        prompts = [[4 + (i * 37 + j * 11) % 400 for j in range(n)]
                   for i, n in enumerate((5, 40, 130, 300))]
        for prompt in prompts:
            expected = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                             ignore_eos=True))[0].outputs[0]
            r = client.completions.create(model=cfg.model_name, prompt=prompt, max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True,
                                                                     "return_token_ids": True})
            assert r.choices[0].token_ids == list(expected.token_ids)  # type: ignore[attr-defined]
        st = wait_idle(cluster.url, timeout=60)
        d = next(e for e in st["engines"] if e["role"] == "decode")
        assert d["stats"].get("kv_bytes_received", 0) > 0  # the KV really crossed GPUs
        assert d["stats"].get("kv_fallbacks", 0) == 0
        assert leak_reports(cluster) == {}
        assert httpx.get(f"{cluster.url}/health").status_code == 200
    finally:
        cluster.shutdown()
