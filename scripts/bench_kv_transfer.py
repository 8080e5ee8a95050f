"""KV transfer benchmark: our connector end to end vs raw pyzmq, and TTFT 1P1D vs colocated.

Part 1, for prompts of ~1k/4k/16k tokens: gather the request's blocks from the producer's
paged cache, layer by layer -> ZMQ pipe -> scatter into the consumer's paged cache (two
processes), timed from the first gather to the consumer's ACK; beside plain pyzmq PUSH/PULL
loopback throughput with the same frame sizes, in the same run.
Part 2: TTFT of a ~2k-token prompt through a producer engine streaming its KV to a consumer
engine (1P1D, two processes) vs a colocated engine, same model, per pipe (zmq and shm).
Part 3 (issue 20): the same for a DeepSeek-shaped latent-attention (MLA) model beside a GQA
model of the same hidden size, layers and heads: KV bytes per prompt token measured from P's
``kv_bytes_sent`` (beside the value the configs give), and each model's TTFT 1P1D/colocated.
Part 4 (issues 29, 38): the cost of each ``kv_transfer`` integrity mode (none, crc32, mac: the
default, curve + mac) on each pipe (zmq tcp, zmq ipc, gloo), part 1's transfer side by side in
one run, and each tag alone. Part 5 (issue 42): the nixl pipe end to end against NIXL's own
raw WRITE in the same run, per size (scripts/nixl_bench.py; skipped, saying why, without
NIXL), printing `nixl_efficiency=X`. Part 6 (issue 42): the shm pipe end to end (integrity mac,
then none) against a raw memcpy into another process's shared buffer in the same run, per size
(scripts/shm_bench.py), printing `shm_efficiency=X`. Prints `kv_transfer_efficiency=X` (ours / raw, median
over sizes) last. ``--smoke``: one small transfer per pipe, a 1P1D run of each part-3 model on a
short prompt (both pairs at once, beside the other parts; their lines come after part 6), and
part 4's mac on gloo, under 20 s (CI: interfaces still fit; no colocated runs, no TTFT
ratios).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from connectors.config import KVTransferConfig  # noqa: E402
from connectors.metadata import FinishSpec, KVConnectorMetadata, RecvSpec, SendSpec  # noqa: E402
from connectors.pd_connector import PDConnectorWorker  # noqa: E402
from connectors.transfer_params import RecvKV, SendKV  # noqa: E402
from churned_grant import churned_blocks  # noqa: E402
from kv_integrity_modes import PIPES, SECURITY_MODES, part4  # noqa: E402
from nixl_bench import part_nixl  # noqa: E402
from pipe_raw import bench_context  # noqa: E402
from shm_bench import part_shm  # noqa: E402

SHAPE = {"num_layers": 12, "num_kv_heads": 4, "head_dim": 64, "block_size": 16}  # bench-50m


def _info(dtype: torch.dtype) -> dict:
    return {**SHAPE, "model_id": "bench", "dtype": str(dtype)}


def _caches(num_blocks: int, dtype: torch.dtype) -> list[torch.Tensor]:
    shape = (2, num_blocks, SHAPE["block_size"], SHAPE["num_kv_heads"], SHAPE["head_dim"])
    return [torch.randn(shape).to(dtype) for _ in range(SHAPE["num_layers"])]


def _consumer(conn, num_blocks: int, transport: str, extra: dict | None = None) -> None:
    torch.set_num_threads(1)
    worker = PDConnectorWorker(KVTransferConfig.from_dict(dict(
        role="consumer", transport=transport, kv_transfer_timeout=120, **(extra or {}))),
        _info(torch.float32))
    worker.register_kv_caches(_caches(num_blocks, torch.float32))
    conn.send(worker.endpoint())
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        rid, n_tokens, block_ids = cmd
        worker.bind_connector_metadata(KVConnectorMetadata(
            recvs=[RecvSpec(rid, tuple(block_ids), n_tokens)]))
        conn.send("ready")
        done = {}
        while rid not in done:
            done.update(worker.get_finished()[1])
            time.sleep(0.0005)
        conn.send(done[rid] is not None)
    worker.close()


def transfer_throughput(n_tokens: int, producer: PDConnectorWorker, conn, peer: str,
                        repeats: int, dst_in_order: bool = False, churned: bool = False
                        ) -> tuple[float, int]:
    """Best bytes/s of a request's KV from the producer's blocks (in order) into the
    consumer's: shuffled (the default: every block apart, the worst case), ``dst_in_order``
    (a fresh pool's blocks), or ``churned``: both ends' blocks as our engine's pool hands them
    out after serving a while (churned_grant.py)."""
    bs = SHAPE["block_size"]
    blocks = list(range(-(-n_tokens // bs)))
    gen = torch.Generator().manual_seed(n_tokens)
    dst = (list(range(len(blocks), 2 * len(blocks))) if dst_in_order  # past the source's
           else torch.randperm(len(blocks) * 2, generator=gen)[:len(blocks)].tolist())
    if churned:  # both pools hold 2x the largest request (_pair)
        pool = producer.kv_caches[0].shape[1]
        blocks = churned_blocks(pool, len(blocks), seed=2 * n_tokens)
        dst = churned_blocks(pool, len(blocks), seed=2 * n_tokens + 1)
    best, nbytes = 0.0, 0
    for rep in range(repeats):
        rid = f"bench-{n_tokens}-{rep}"
        conn.send((rid, n_tokens, dst))
        assert conn.recv() == "ready"
        t0 = time.perf_counter()
        producer.bind_connector_metadata(KVConnectorMetadata(
            sends=[SendSpec(rid, peer, tuple(blocks), 0)]))
        for layer, cache in enumerate(producer.kv_caches):
            producer.save_kv_layer(layer, cache, None)
        producer.wait_for_save()
        producer.bind_connector_metadata(KVConnectorMetadata(
            finishes=[FinishSpec(rid, peer, 1, n_tokens)]))
        while rid not in producer.get_finished()[0]:
            time.sleep(0.0002)
        elapsed = time.perf_counter() - t0
        assert conn.recv() is True, "consumer did not complete the transfer"
        nbytes = sum(c[:, :len(blocks)].nbytes for c in producer.kv_caches)
        best = max(best, nbytes / elapsed)
    return best, nbytes


def _pair(max_tokens: int, transport: str, extra: dict | None = None):
    """(producer, pipe to the consumer process, the process, the consumer's endpoint)."""
    num_blocks = 2 * -(-max_tokens // SHAPE["block_size"])
    ctx = bench_context()
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(there, num_blocks, transport, extra), daemon=True)
    proc.start()
    producer = PDConnectorWorker(KVTransferConfig.from_dict(dict(
        role="producer", transport=transport, kv_transfer_timeout=120, **(extra or {}))),
        _info(torch.float32))
    producer.register_kv_caches(_caches(num_blocks, torch.float32))
    peer = here.recv()
    producer.connect_peer(peer)
    return producer, here, proc, peer


def part1(sizes: list[int], transport: str, repeats: int) -> list[float]:
    from pipe_raw import raw_zmq_throughput
    producer, here, proc, peer = _pair(max(sizes), transport)
    ratios = []
    print(f"{'tokens':>7} {'KV MiB':>8} {'frame MiB':>9} {'ours GB/s':>10} {'raw GB/s':>9} {'ratio':>6}")
    for n in sizes:
        ours, nbytes = transfer_throughput(n, producer, here, peer, repeats)
        # Our messages: one layer's K (or V) of the request, split by the pipe at 8 MiB. The
        # raw moves the same bytes (it moved at least 64 MiB until issue 42's review, which
        # spread its fixed costs over more bytes than ours at 1k tokens).
        frame = min(nbytes // (2 * SHAPE["num_layers"]), 8 << 20)
        raw = raw_zmq_throughput(frame, nbytes, transport, repeats=repeats)
        ratios.append(ours / raw)
        print(f"{n:>7} {nbytes / 2**20:>8.1f} {frame / 2**20:>9.2f} {ours / 1e9:>10.2f} "
              f"{raw / 1e9:>9.2f} {ours / raw:>6.2f}")
    here.send(None)
    proc.join(timeout=30)
    producer.close()
    return ratios


def ttft_runs(model_name: str, prompt_tokens: int, repeats: int,
              colocated: bool = True, pipe: str = "zmq") -> dict[str, float]:
    """Median TTFT colocated (nan when not run) and 1P1D, and the KV bytes P sent per prompt
    token (every run ships the whole prompt: neither engine reuses a cached prefix). The two
    setups run alternately, so a shared machine's load drifts over both alike."""
    from pd_cluster import SamplingParams
    from pd_cluster.config import EngineConfig
    from pd_cluster.engine.engine_process import EngineProcess
    from pd_cluster.checkpoints.maker import default_model_path
    model = str(default_model_path(model_name))
    prompt = [4 + (i * 37) % 250 for i in range(prompt_tokens)]  # ids every preset's vocab has
    params = SamplingParams(temperature=0, max_tokens=1)
    engine = lambda role=None: EngineProcess(EngineConfig(  # noqa: E731
        model=model, enable_prefix_caching=False,
        kv_transfer={"role": role, "kv_transfer_timeout": 60, "pipe": pipe} if role else None))
    # (--smoke: the P/D pair alone, the same EngineProcess calls)
    colo, d, p = engine() if colocated else None, engine("consumer"), engine("producer")
    for e in (colo, p, d):
        if e is not None:
            e.wait_ready()
    p.connect_kv_peer(d.kv_endpoint)  # the handshake, as a cluster does at launch

    def submit(rid: str) -> None:
        d.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=2), RecvKV())
        p.add_request(rid, prompt, params, SendKV(to=d.kv_endpoint))
    times: dict[str, list[float]] = {"colocated": [], "pd": []}
    for rep in range(repeats + 1):  # the first round warms up
        runs = [lambda: _timed(times["pd"], rep, p, submit, f"pd-{rep}", d)]
        if colo is not None:
            runs.append(lambda: _timed(times["colocated"], rep, colo,
                                       lambda rid: colo.add_request(rid, prompt, params),
                                       f"colo-{rep}"))
        for run in runs[::-1] if rep % 2 else runs:  # neither always runs first
            run()
    sent = p.call("stats")["kv_bytes_sent"]
    with ThreadPoolExecutor() as pool:  # each waits ~1 s for its process to exit: together
        list(pool.map(lambda e: e.shutdown(), [e for e in (colo, p, d) if e is not None]))
    return {"colocated": statistics.median(times["colocated"]) if colo else float("nan"),
            "pd": statistics.median(times["pd"]),
            "kv_bytes_per_token": sent / ((repeats + 1) * prompt_tokens)}


def part2(prompt_tokens: int, repeats: int, model_name: str = "bench-50m",
          pipes: tuple[str, ...] = ("zmq",)) -> None:
    """Per pipe, 1P1D against colocated (each pipe with its own interleaved colocated runs);
    zmq's ratio keeps its old name."""
    for pipe in pipes:
        t = ttft_runs(model_name, prompt_tokens, repeats, pipe=pipe)
        print(f"TTFT {prompt_tokens}-token prompt: colocated {t['colocated'] * 1e3:.1f} ms, "
              f"1P1D over {pipe} {t['pd'] * 1e3:.1f} ms")
        suffix = "" if pipe == "zmq" else f"_{pipe}"
        print(f"ttft_ratio_pd_over_colocated{suffix}={t['pd'] / t['colocated']:.3f}")


def kv_bytes_per_token(model_name: str) -> float:
    """From the config alone: per layer, MLA caches one latent (kv_lora_rank) and one rope key
    (qk_rope_head_dim) per token; GQA caches K and V for each KV head."""
    from pd_cluster.config import EngineConfig, read_hf_config
    from pd_cluster.checkpoints.maker import default_model_path
    model = str(default_model_path(model_name))
    cfg = read_hf_config(model)
    if cfg.get("kv_lora_rank"):
        per_layer = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    else:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_layer = 2 * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    itemsize = EngineConfig(model=model).torch_dtype.itemsize
    return cfg["num_hidden_layers"] * per_layer * itemsize


def part3(prompt_tokens: int, repeats: int, mla_model: str, gqa_model: str,
          colocated: bool = True) -> list[str]:
    """Part 3's lines (printed by the caller: under --smoke it runs beside parts 1, 4-6)."""
    models = {"mla": mla_model, "gqa": gqa_model}
    if colocated:  # timed: one pair at a time
        runs = {k: ttft_runs(m, prompt_tokens, repeats, colocated) for k, m in models.items()}
    else:  # --smoke (no TTFT read): both pairs at once, their start-ups and waits overlap
        with ThreadPoolExecutor(2) as pool:
            futures = {k: pool.submit(ttft_runs, m, prompt_tokens, repeats, colocated)
                       for k, m in models.items()}
            runs = {k: f.result() for k, f in futures.items()}
    out = [f"MLA {mla_model} vs GQA {gqa_model}, {prompt_tokens}-token prompt:",
           f"{'':>4} {'KV B/token':>10} {'analytical':>10} {'TTFT colo ms':>12} "
           f"{'TTFT 1P1D ms':>12}"]
    for kind, name in models.items():
        t = runs[kind]
        out.append(f"{kind:>4} {t['kv_bytes_per_token']:>10.1f} "
                   f"{kv_bytes_per_token(name):>10.1f} {t['colocated'] * 1e3:>12.1f} "
                   f"{t['pd'] * 1e3:>12.1f}")
    mla, gqa = runs["mla"]["kv_bytes_per_token"], runs["gqa"]["kv_bytes_per_token"]
    out.append(f"mla_kv_bytes_per_token={mla:.1f} gqa_kv_bytes_per_token={gqa:.1f} "
               f"kv_bytes_ratio_gqa_over_mla={gqa / mla:.3f}")
    if colocated:
        ratios = {k: t["pd"] / t["colocated"] for k, t in runs.items()}
        out.append(f"mla_ttft_ratio_pd_over_colocated={ratios['mla']:.3f} "
                   f"gqa_ttft_ratio_pd_over_colocated={ratios['gqa']:.3f}")
    return out


def _timed(times: list[float], rep: int, proc, submit, rid: str, consumer=None) -> None:
    """One request's time to its first token (recorded after the warm-up round)."""
    time.sleep(0.2)  # the previous run's last messages and acks are handled before this one
    t0 = time.perf_counter()
    submit(rid)
    proc.wait_finished([rid], timeout=300)
    if rep:
        times.append(time.perf_counter() - t0)
    if consumer is not None:
        consumer.wait_finished([rid], timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--transport", default="tcp", choices=["tcp", "ipc"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-prompt", type=int, default=2000)
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--ttft-pipes", nargs="+", default=["zmq", "shm"],
                        choices=["zmq", "shm", "nixl", "auto"], help="part 2's 1P1D pipes")
    parser.add_argument("--ttft-model", default="bench-50m", help="a built-in preset")
    parser.add_argument("--mla-model", default="tiny-deepseek-v3", help="part 3's MLA preset")
    parser.add_argument("--gqa-model", default="tiny-gqa-like-deepseek",
                        help="part 3's GQA preset (same hidden size, layers and heads)")
    parser.add_argument("--skip-mla", action="store_true", help="no part 3")
    parser.add_argument("--security-tokens", type=int, default=4096,
                        help="part 4's prompt size (each kv_transfer integrity mode's cost)")
    parser.add_argument("--security-pipes", nargs="+", default=list(PIPES), choices=PIPES)
    parser.add_argument("--security-modes", nargs="+", default=list(SECURITY_MODES),
                        choices=SECURITY_MODES, help="part 4's modes (none is the baseline)")
    parser.add_argument("--skip-security", action="store_true", help="no part 4")
    parser.add_argument("--skip-nixl", action="store_true", help="no part 5 (the nixl pipe)")
    parser.add_argument("--skip-shm", action="store_true", help="no part 6 (the shm pipe)")
    parser.add_argument("--smoke", action="store_true",
                        help="a few seconds (CI): 256 tokens once, then part 3's 1P1D runs on "
                             "a 64-token prompt (no part 2, no colocated runs, no ratios)")
    args = parser.parse_args()
    from connectors.secret import has_secret, install, new_secret
    if not has_secret():  # the processes below prove it to each other (inherited)
        install(new_secret())
    if args.smoke:
        args.sizes, args.repeats, args.ttft_prompt, args.skip_ttft = [256], 1, 64, True
        # zmq (mac) ran in part 1; part 4 adds gloo with mac (each mode is a process pair)
        args.security_tokens, args.security_pipes = 256, ["gloo"]
        args.security_modes = ["mac"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    part3_args = (args.ttft_prompt, args.repeats, args.mla_model, args.gqa_model, not args.smoke)
    beside = None
    if args.smoke and not args.skip_mla:  # its engines start while parts 1, 4-6 run; its
        # Both presets made here first: made in threads, they import transformers' lazy
        # model classes at once, which fails (ci10, a fresh cache: ImportError).
        from pd_cluster.checkpoints.maker import default_model_path
        for name in (args.mla_model, args.gqa_model):
            default_model_path(name)
        beside = ThreadPoolExecutor(1)     # lines come after part 6
        part3_lines = beside.submit(part3, *part3_args)
    ratios = part1(args.sizes, args.transport, args.repeats)
    if not args.skip_ttft:
        part2(args.ttft_prompt, args.repeats, args.ttft_model, tuple(args.ttft_pipes))
    if not args.skip_mla and beside is None:
        print("\n".join(part3(*part3_args)))
    if not args.skip_security:
        modes = ([] if args.smoke else ["none"]) + [m for m in args.security_modes
                                                    if m != "none"]
        part4(args.security_tokens, args.repeats, args.security_pipes, modes, _pair,
              transfer_throughput, SHAPE["block_size"])
    if not args.skip_nixl:
        part_nixl(args.sizes, args.repeats, _pair, transfer_throughput, SHAPE["num_layers"])
    if not args.skip_shm:
        part_shm(args.sizes, args.repeats, _pair, transfer_throughput, SHAPE["num_layers"],
                 ("mac",) if args.smoke else ("mac", "none"))
    if beside is not None:
        print("\n".join(part3_lines.result(timeout=300)))
        beside.shutdown()
    print(f"kv_transfer_efficiency={statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
