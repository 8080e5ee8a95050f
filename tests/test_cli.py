"""The `pd-cluster` command line as a user runs it (subprocesses), for everything that needs no
cluster: the checks `serve`/`launch` make before Ray starts, --version, help texts, status
advice. Each command here ends in well under a second; none starts Ray."""
from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pd_cluster.serving.cluster.testing import REPO_ROOT


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PD_CLUSTER_STATE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path), "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "pd_cluster.cli", *args], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def _one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_misspelt_preset_names_the_closest_ones(tmp_path: Path) -> None:
    line = _one_line_error(_run("serve", "tiny-lama", tmp_path=tmp_path))
    assert line.startswith("error: model: 'tiny-lama' is not a built-in preset"), line
    assert "did you mean tiny-llama" in line and "presets: tiny-llama," in line


def test_missing_checkpoint_dir_and_dir_without_config(tmp_path: Path) -> None:
    line = _one_line_error(_run("serve", str(tmp_path / "nope"), tmp_path=tmp_path))
    assert line == f"error: model: '{tmp_path / 'nope'}': no such directory on this machine"
    line = _one_line_error(_run("serve", str(tmp_path), tmp_path=tmp_path))
    assert "has no config.json" in line, line


def test_launch_checks_the_model_before_ray_too(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: tiny-qwen-2\n")
    line = _one_line_error(_run("launch", "--config", str(cfg), tmp_path=tmp_path))
    assert "did you mean tiny-qwen2" in line, line


def test_busy_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = _one_line_error(_run("serve", "tiny-llama", "--port", str(port),
                                    tmp_path=tmp_path))
    assert line.startswith(f"error: proxy.port {port} on 127.0.0.1 is not available"), line


@pytest.mark.parametrize("args, expected", [
    (["--set", "prefill.replcas=2"], "error: prefill.replcas: unknown key (expected one of:"),
    (["--prefill", "0"], "error: prefill.replicas: must be >= 1, got 0"),
    (["--block-size", "12"], "error: engine.block_size: must be a power of two"),
    (["--mode", "colocated", "--prefill", "2"], "error: prefill: not used with mode: colocated"),
])
def test_bad_flags_name_the_config_key(tmp_path: Path, args: list[str], expected: str) -> None:
    assert _one_line_error(_run("serve", "tiny-llama", *args, tmp_path=tmp_path)
                           ).startswith(expected)


def test_version_and_log_level_choices(tmp_path: Path) -> None:
    from pd_cluster import __version__
    done = _run("--version", tmp_path=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == f"pd-cluster {__version__}"
    top = _run("--help", tmp_path=tmp_path).stdout
    assert "{DEBUG,INFO,WARNING,ERROR,CRITICAL}" in top and "serve" in top
    bad = _run("--log-level", "LOUD", "status", tmp_path=tmp_path)
    assert bad.returncode == 2 and "invalid choice: 'LOUD'" in bad.stderr


@pytest.mark.parametrize("command", ["generate", "make-model", "serve", "launch", "status",
                                     "profile", "plan"])
def test_every_flag_has_help_text(tmp_path: Path, command: str) -> None:
    """argparse prints a flag with no help as its name alone on a line."""
    out = _run(command, "--help", tmp_path=tmp_path).stdout
    options = out.split("options:", 1)[1]
    bare = [ln for ln in options.splitlines()
            if re.fullmatch(r"\s+-[-\w]+( [A-Z_\[\]. ]+)?(, --?[-\w]+( [A-Z_\[\]. ]+)?)?", ln)
            and not ln.strip().startswith("-h")]
    # a long flag's help may start on the next line: then that line is indented further
    lines = options.splitlines()
    undocumented = [ln for ln in bare
                    if lines.index(ln) + 1 >= len(lines)
                    or not re.match(r"\s{20,}\S", lines[lines.index(ln) + 1])]
    assert not undocumented, undocumented


def test_serve_help_names_the_yaml_key_of_every_flag(tmp_path: Path) -> None:
    from pd_cluster.serving.cluster.serve_flags import FLAGS
    out = " ".join(_run("serve", "--help", tmp_path=tmp_path).stdout.split())
    for f in FLAGS:
        assert f"[{f.key}]" in out, f.flag


def test_status_without_a_cluster_says_how_to_start_one(tmp_path: Path) -> None:
    line = _one_line_error(_run("status", tmp_path=tmp_path))
    assert "no cluster is running in namespace 'pd-cluster'" in line
    assert "pd-cluster serve MODEL" in line, line
