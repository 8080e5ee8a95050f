"""`pd-cluster profile` (measure the cost table) and `pd-cluster plan` (size a cluster from it)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml


def add_planner_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure prefill, decode and KV transfer costs on this "
                       "machine (the table `plan` and the planner read)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", default=None, help="cluster YAML: its model, engine settings, "
                     "KV pipe and threads per role")
    src.add_argument("--model", default=None, help="a model (preset, checkpoint dir or repo id) "
                     "with default settings on CPU (default: the built-in model)")
    p.add_argument("--out", default=None, help="JSON file to write (default: "
                   "profile-<model>.json here)")
    p.add_argument("--grid", choices=["default", "tiny"], default="default",
                   help="tiny: a few cells (seconds on the built-in model)")
    p.add_argument("--prompt-lengths", default=None, help="comma list (prefill grid)")
    p.add_argument("--batch-sizes", default=None, help="comma list (decode grid)")
    p.add_argument("--context-lengths", default=None, help="comma list (decode grid)")
    p.set_defaults(run=_run_profile)

    q = sub.add_parser("plan", help="replicas per role and engine settings meeting TTFT/TPOT "
                       "targets at the highest rate, from a profile")
    q.add_argument("--profile", required=True, help="JSON from `pd-cluster profile`")
    q.add_argument("--input-len", type=int, default=None, help="prompt tokens per request")
    q.add_argument("--output-len", type=int, default=None, help="output tokens per request")
    q.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in len x (1 +- ratio)")
    q.add_argument("--requests", default=None, help="JSONL of requests (input_len / "
                   "prompt_tokens and output_len / max_tokens per line) instead of the lengths")
    q.add_argument("--slo-ttft-ms", type=float, required=True, help="time to first token "
                   "target, ms")
    q.add_argument("--slo-tpot-ms", type=float, required=True, help="time per output token "
                   "target, ms")
    q.add_argument("--percentile", type=float, default=90.0,
                   help="the targets hold at this percentile of requests (default 90)")
    q.add_argument("--slots", type=int, default=2, help="engine slots to split (default 2)")
    q.add_argument("--rate", type=float, default=None, help="req/s to serve: the fewest slots "
                   "(up to --max-slots) that take it, instead of --slots")
    q.add_argument("--max-slots", type=int, default=64, help="with --rate: slots at most")
    q.add_argument("--max-num-seqs", type=int, default=256, help="decode batch cap considered")
    q.add_argument("--at-rate", type=float, default=None, help="also predict p50 and the "
                   "percentile TTFT/TPOT at this req/s on the planned split (or --split)")
    q.add_argument("--split", default=None, metavar="P:D", help="with --at-rate: this many "
                   "prefill and decode engines instead of the plan's")
    q.add_argument("--colocated-profile", default=None, help="JSON from `pd-cluster profile` "
                   "of one colocated engine on the cores of --slots engines together: also "
                   "compare that shape with the P/D split (the comparison `mode: auto` makes)")
    q.add_argument("--config", default=None, help="base cluster YAML the plan is written into")
    q.add_argument("--out", default=None, help="write the planned cluster YAML here")
    q.set_defaults(run=_run_plan)


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected a comma list of integers, got {text!r}") from None


def _setup(args: argparse.Namespace) -> Any:
    from connectors.config import KVTransferConfig
    from pd_cluster.planner.profiler import ProfileSetup
    from pd_cluster.serving.cluster.cluster_config import kv_for_role, load_config
    from pd_cluster.serving.cluster.model_source import check_model
    if args.config:
        cfg = load_config(args.config)
        kv = kv_for_role(cfg.kv_transfer, "prefill")
        kv.pop("role", None)
        # a colocated engine prefills and decodes on the same threads: both measured there
        p, d = ((cfg.colocated, cfg.colocated) if cfg.mode == "colocated"
                else (cfg.prefill, cfg.decode))
        return ProfileSetup(model=check_model(cfg.model), model_name=cfg.model,
                            engine_args=dict(cfg.engine), kv_transfer=kv,
                            prefill_threads=max(1, int(p.num_cpus)),
                            decode_threads=max(1, int(d.num_cpus)),
                            tensor_parallel_size=p.tensor_parallel_size)
    model = args.model or "tiny-llama"
    kv = kv_for_role(KVTransferConfig(), "prefill")
    kv.pop("role", None)
    return ProfileSetup(model=check_model(model), model_name=model,
                        engine_args={"device": "cpu"}, kv_transfer=kv)


def _run_profile(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pd_cluster.planner.profiler import ProfileGrid, grid_cells, run_profile
    grid = ProfileGrid.tiny() if args.grid == "tiny" else ProfileGrid()
    for name in ("prompt_lengths", "batch_sizes", "context_lengths"):
        values = _ints(getattr(args, name), "--" + name.replace("_", "-"))
        if values is not None:
            setattr(grid, name, values)
    setup = _setup(args)
    with tqdm(total=grid_cells(grid), desc="profile", unit="cell") as bar:
        def tick(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)
        profile = run_profile(setup, grid, tick)
    out = Path(args.out or f"profile-{Path(setup.model_name).name}.json")
    profile.save(out)
    s = profile.summary()
    rate = s["transfer_bytes_per_s"]
    print(f"wrote {out}: {s['key']}; KV {s['kv_bytes_per_token']} B/token, transfer "
          f"{'n/a' if rate is None else f'{rate / 1e6:.0f} MB/s'}")
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    from pd_cluster.planner.perf_model import LIMITATIONS, PerfModel, Slo
    from pd_cluster.planner.plan import (colocated_config, make_plan, plan_config,
                                         smallest_plan)
    from pd_cluster.planner.profile_table import Profile
    from pd_cluster.planner.workload import Workload
    profile = Profile.load(args.profile)
    if args.requests:
        workload = Workload.from_jsonl(args.requests)
    elif args.input_len is None or args.output_len is None:
        raise ValueError("--input-len and --output-len (or --requests): the workload to size for")
    else:
        workload = Workload.from_lengths(args.input_len, args.output_len, args.range_ratio)
    slo = Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.percentile)
    model = PerfModel(profile, workload, slo, args.max_num_seqs)
    tp = profile.key.tensor_parallel_size
    print(f"profile: {profile.key.model} {profile.key.dtype} TP{tp} on {profile.key.device}, "
          f"pipe {profile.key.pipe}")
    print(f"workload: prompt {workload.mean_input:.0f} tokens, output {workload.mean_output:.0f}"
          f" tokens (mean); targets TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms "
          f"at p{args.percentile:g}")
    try:
        plan = (smallest_plan(model, args.rate, args.max_slots, tp) if args.rate is not None
                else make_plan(model, args.slots, tp))
    except ValueError as e:
        if not args.colocated_profile:
            raise
        plan, no_plan = None, e  # the colocated shape may still meet the targets
        print(f"P/D: {e}")
    if plan is not None:
        _print_plan(plan, args)
        print(f"not modelled: {LIMITATIONS}")
        if args.at_rate is not None:
            _predict_at(model, plan, args)
    choice = None
    if args.colocated_profile:
        choice = _compare_shapes(model, args)
    if plan is None and choice.mode != "colocated":
        raise no_plan  # neither shape meets the targets
    if args.out:
        from pd_cluster.serving.cluster.cluster_config import ClusterConfig
        base = yaml.safe_load(Path(args.config).read_text()) if args.config else {
            "model": profile.key.model}
        data = (colocated_config(choice, base or {}, model) if choice is not None
                and choice.mode == "colocated" else plan_config(plan, base or {}, model))
        data["planner"] = {**data.get("planner", {}), "profile": str(Path(args.profile))}
        ClusterConfig.from_dict(data)  # what is written must launch
        Path(args.out).write_text(yaml.safe_dump(data, sort_keys=False))
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _print_plan(plan: Any, args: argparse.Namespace) -> None:
    print(f"per engine: prefill {plan.prefill_capacity:.3g} req/s, decode "
          f"{plan.decode_capacity:.3g} req/s within the targets")
    print(f"plan: {plan.n_prefill} prefill + {plan.n_decode} decode engines ({plan.slots} slots)"
          f"; decode max_num_seqs {plan.decode_max_num_seqs}, prefill chunk "
          f"(max_num_batched_tokens) {plan.prefill_chunk}")
    print(f"predicted: {plan.rate:.3g} req/s ({plan.rate_per_slot:.3g} per slot), goodput "
          f"{plan.goodput:.3g} req/s, TTFT p{args.percentile:g} {plan.ttft_s * 1e3:.0f} ms, "
          f"TPOT p{args.percentile:g} {plan.tpot_s * 1e3:.1f} ms")


def _predict_at(model: Any, plan: Any, args: argparse.Namespace) -> None:
    n_p, n_d = plan.n_prefill, plan.n_decode
    if args.split:
        try:
            n_p, n_d = (int(x) for x in args.split.split(":"))
        except ValueError:
            raise ValueError(f"--split: expected P:D (two integers), got {args.split!r}") from None
        if n_p < 1 or n_d < 1:
            raise ValueError(f"--split: both counts must be >= 1, got {args.split!r}")
    r, pct = args.at_rate, args.percentile
    print(f"at {r:g} req/s on {n_p}P:{n_d}D: TTFT p50 {model.ttft(r / n_p, 50) * 1e3:.0f} ms, "
          f"p{pct:g} {model.ttft(r / n_p) * 1e3:.0f} ms; TPOT p50 "
          f"{model.tpot(r / n_d, 50) * 1e3:.1f} ms, p{pct:g} {model.tpot(r / n_d) * 1e3:.1f} ms;"
          f" goodput {model.goodput(r, n_p, n_d):.3g} req/s")


def _compare_shapes(model: Any, args: argparse.Namespace) -> Any:
    from pd_cluster.planner.colocated_model import LIMITATIONS, ColocatedModel
    from pd_cluster.planner.profile_table import Profile
    from pd_cluster.planner.shape import compare_shapes
    if args.rate is not None:
        raise ValueError("--colocated-profile: compares shapes on --slots engines' cores; "
                         "drop --rate")
    profile = Profile.load(args.colocated_profile)
    colocated = ColocatedModel(profile, model.workload, model.slo, args.max_num_seqs)
    choice = compare_shapes(model, colocated, args.slots, cores=float(args.slots))
    print(f"colocated ({profile.key.device}): {choice.colocated_rate:.3g} req/s within the "
          f"targets, TTFT p{args.percentile:g} {colocated.ttft(choice.colocated_rate) * 1e3:.0f}"
          f" ms, TPOT {colocated.tpot(choice.colocated_rate) * 1e3:.1f} ms at that rate")
    print(f"shape: {choice.line}")
    print(f"not modelled (colocated): {LIMITATIONS}")
    return choice
