"""`pd-cluster serve` takes `vllm serve`'s flags by vLLM's names, each onto its YAML key; vLLM
flags with no meaning here are named in one line; an unknown flag gets serve's usage and the
nearest flag or key. Parsing only: nothing starts."""
from __future__ import annotations

from typing import Any

import pytest

from pd_cluster.cli import build_parser, main
from pd_cluster.serving.cluster.serve_cli import serve_config


def _config(*flags: str) -> Any:
    args = build_parser().parse_args(["serve", "tiny-llama", *flags])
    return serve_config(args)


@pytest.mark.parametrize("flags, path, expected", [
    (["--tensor-parallel-size", "2"], "prefill.tensor_parallel_size", 2),
    (["-tp", "2"], "decode.tensor_parallel_size", 2),
    (["--max-model-len", "512"], "engine.max_model_len", 512),
    (["--max-num-seqs", "8"], "engine.max_num_seqs", 8),
    (["--max-num-batched-tokens", "256"], "engine.max_num_batched_tokens", 256),
    (["--enable-prefix-caching"], "engine.enable_prefix_caching", True),
    (["--no-enable-prefix-caching"], "engine.enable_prefix_caching", False),
    (["--dtype", "bfloat16"], "engine.dtype", "bfloat16"),
    (["--kv-cache-dtype", "fp8_e4m3"], "engine.kv_cache_dtype", "fp8_e4m3"),
    (["--seed", "7"], "engine.seed", 7),
    (["--served-model-name", "a", "b"], "served_model_name", ["a", "b"]),
    (["--api-key", "k1"], "proxy.api_key", ["k1"]),
    (["--kv-offloading-size", "1"], "engine.kv_offloading_size", 1.0),
    (["--enable-auto-tool-choice"], "proxy.enable_auto_tool_choice", True),
    (["--tool-call-parser", "hermes"], "proxy.tool_call_parser", "hermes"),
    (["--structured-outputs-config", '{"backend": "xgrammar"}'],
     "engine.structured_outputs", {"backend": "xgrammar"}),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
     "engine.speculative", {"method": "ngram", "num_speculative_tokens": 3}),
    (["--gpu-memory-utilization", "0.5"], "engine.gpu_memory_utilization", 0.5),
    (["--generation-config", "vllm"], "engine.generation_config", "vllm"),
    (["--override-generation-config", '{"temperature": 0.5}'],
     "engine.override_generation_config", {"temperature": 0.5}),
    (["--chat-template", "{{ messages[0].content }}"], "proxy.chat_template",
     "{{ messages[0].content }}"),
    (["--enforce-eager"], "engine.compile", False),
    (["--enforce-eager"], "engine.cuda_graphs", False),
    (["--disable-log-stats"], "proxy.log_stats_interval", 0.0),
    (["--slo-tpot-ms", "20"], "proxy.slo.tpot_ms", 20.0),
    (["--slo-ttft-ms", "1500"], "proxy.slo.ttft_ms", 1500.0),
])
def test_vllm_flag_sets_its_key(flags: list[str], path: str, expected: Any) -> None:
    node: Any = _config(*flags).to_dict()
    for key in path.split("."):
        node = node[key]
    assert node == expected


def test_tensor_parallel_follows_the_mode() -> None:
    cfg = _config("--mode", "colocated", "--tensor-parallel-size", "2")
    assert cfg.colocated.tensor_parallel_size == 2 and "prefill" not in cfg.to_dict()


def test_chat_template_file_is_read(tmp_path: Any) -> None:
    f = tmp_path / "t.jinja"
    f.write_text("{{ 'x' }}")
    assert _config("--chat-template", str(f)).proxy.chat_template == "{{ 'x' }}"


def test_flags_with_no_meaning_here_are_named(capsys: pytest.CaptureFixture) -> None:
    from pd_cluster.serving.cluster.serve_cli import run_serve
    args = build_parser().parse_args(["serve", "tiny-llama", "--trust-remote-code",
                                      "--swap-space", "4", "--disable-log-requests"])
    assert args.model == "tiny-llama"  # --swap-space's value is not taken for MODEL
    from pd_cluster.serving.cluster import serve_flags
    notes = serve_flags.ignored_notes(args.vllm_ignored)
    assert [n.split()[1] for n in notes] == ["--trust-remote-code", "--swap-space",
                                             "--disable-log-requests"]
    assert all(n.startswith("note: ") and "has no meaning here" in n for n in notes)
    bad = build_parser().parse_args(["serve", "tiny-llama", "--pipeline-parallel-size", "2"])
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2: not available here"):
        run_serve(bad)  # fails before anything starts


@pytest.mark.parametrize("flag, hint", [
    ("--tensr-parallel-size", "did you mean --tensor-parallel-size?"),
    ("--max-queue", "did you mean --set proxy.max_queue=VALUE?"),
    ("--frobnicate", "--set KEY=VALUE sets any config key"),
])
def test_unknown_flag_gets_serves_usage_and_the_nearest(
        flag: str, hint: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        main(["serve", "tiny-llama", flag, "3"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pd-cluster serve "), err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"pd-cluster serve: error: unrecognized argument {flag}: ")
    assert last.endswith(hint), last


def test_config_reference_names_the_flags() -> None:
    from pd_cluster.serving.cluster.config_reference import render
    text = render()
    for key, flag in (("engine.kv_offloading_size", "--kv-offloading-size"),
                      ("prefill.tensor_parallel_size", "--tensor-parallel-size"),
                      ("proxy.tool_call_parser", "--tool-call-parser")):
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| `{key}`"))
        assert f"`serve {flag}" in row, row
