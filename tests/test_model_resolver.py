"""One model resolver for `serve`, `launch` and ``LLM(...)``: a preset name, a checkpoint
directory or a Hugging Face repo id. A repo id comes from the local hub cache when it is there
(offline too); one that is not, with the Hub out of reach, is one line naming the installed
client's download command, before anything starts."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT

_RESOLVE = ("import sys; from pd_cluster.serving.cluster.model_source import check_model; "
            "print(check_model(sys.argv[1]))")


def _hub_cache(root: Path, repo_id: str, checkpoint: str) -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<rev>/}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    shutil.copytree(checkpoint, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    return snap


def _env(tmp_path: Path, cache: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO_ROOT),
            "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
            "PD_CLUSTER_STATE_DIR": str(tmp_path)}


def test_hub_id_resolves_offline_from_the_local_cache(tmp_path: Path, tiny_model) -> None:
    snap = _hub_cache(tmp_path / "hub", "acme/tiny", tiny_model(arch="llama"))
    done = subprocess.run([sys.executable, "-c", _RESOLVE, "acme/tiny"], cwd=REPO_ROOT,
                          env=_env(tmp_path, tmp_path / "hub"), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == snap


def test_uncached_hub_id_offline_is_one_line_before_ray(tmp_path: Path) -> None:
    (tmp_path / "hub").mkdir()
    done = subprocess.run([sys.executable, "-m", "pd_cluster.cli", "serve", "acme/missing",
                           "--port", "0"], cwd=REPO_ROOT, env=_env(tmp_path, tmp_path / "hub"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "'acme/missing' is not in the Hugging Face cache" in lines[0], lines[0]
    assert "HF_HUB_OFFLINE is set" in lines[0] and "`hf download acme/missing`" in lines[0]
    assert "launching" not in done.stdout  # found out before Ray starts


def test_download_command_is_the_installed_clients() -> None:
    import huggingface_hub

    from pd_cluster.serving.cluster.hub_fetch import download_command
    major, minor = (int(p) for p in huggingface_hub.__version__.split(".")[:2])
    expected = "hf" if (major, minor) >= (0, 34) else "huggingface-cli"
    assert download_command("a/b") == f"{expected} download a/b"
    assert shutil.which(expected, path=str(Path(sys.executable).parent)), expected


def test_llm_takes_what_serve_takes() -> None:
    from pd_cluster.llm import LLM
    from pd_cluster.sampling_params import SamplingParams
    with LLM("tiny-llama", num_kv_blocks=64) as llm:
        out = llm.generate("Once upon a time", SamplingParams(max_tokens=3, temperature=0,
                                                              ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        llm.engine.check_no_leaks()
    with pytest.raises(ValueError, match="did you mean tiny-llama"):
        LLM("tiny-lama")
