"""The Executor: runs each scheduled step on the engine's ranks and returns rank 0's tokens.

With ``tensor_parallel_size`` 1 everything is in-process (rank 0 is the only rank). Above 1,
rank 0 stays in the engine process and the other ranks are worker processes (WorkerGroup):
per step the StepInput is broadcast once, every rank runs the same forward (the model's
collectives keep them in lockstep), rank 0 samples, and each rank's finished KV transfers are
gathered so that a request counts as sent or received only when every rank reported it.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from pd_cluster import start_trace
from pd_cluster.config import EngineConfig
from pd_cluster.engine.kv_tiers.setup import create_tier_store
from pd_cluster.engine.model_runner import ModelRunner
from pd_cluster.engine.sampler import Sampler
from pd_cluster.engine.scheduler import ModelRunnerOutput, SchedulerOutput
from pd_cluster.engine.step_input import build_step
from pd_cluster.engine.step_output import sample_step
from pd_cluster.engine.tp_comm import RankTransfers
from pd_cluster.engine.transfer_tally import TransferTally


def max_model_len_of(config: EngineConfig, hf_config: dict[str, Any]) -> int:
    max_pos = hf_config.get("max_position_embeddings", 2048)
    max_len = config.max_model_len or max_pos
    if max_len > max_pos:
        raise ValueError(f"max_model_len {max_len} exceeds the model's "
                         f"max_position_embeddings {max_pos}")
    return max_len


def check_tensor_parallel(hf_config: dict[str, Any], size: int) -> None:
    """One-line ValueError when ``size`` cannot split the model (before any process starts)."""
    if size == 1:
        return
    heads = hf_config.get("num_attention_heads", 0)
    kv_heads = hf_config.get("num_key_value_heads") or heads
    checks = [("num_attention_heads", heads), ("vocab_size", hf_config.get("vocab_size", 0)),
              ("intermediate_size", hf_config.get("intermediate_size", 0)),
              # experts (Qwen3-MoE, DeepSeek-V3) split by their own intermediate dimension
              ("moe_intermediate_size", hf_config.get("moe_intermediate_size") or 0)]
    for name, value in checks:
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide {name}={value}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv_heads}: "
                         f"one must divide the other")


def engine_info(config: EngineConfig, runner: ModelRunner, tp: Any = None) -> dict[str, Any]:
    """What a connector's handshake compares (this rank's per-layer KV specs, its place in
    the TP group, and the model's total KV heads: 1 for latent attention, on every rank)."""
    from connectors.hello import model_fingerprint
    spec = runner.kv_spec
    first = spec.layers[0]
    return {"model_id": model_fingerprint(config.model), "dtype": str(spec.dtype),
            "block_size": spec.block_size, "num_layers": spec.num_layers,
            "num_kv_heads": first.heads, "head_dim": first.width, "kv_specs": spec.describe(),
            "total_kv_heads": runner.model.args.total_kv_heads,
            "kv_cache_dtype": config.kv_cache_dtype,
            "tp_rank": tp.rank if tp else 0, "tp_size": tp.size if tp else 1,
            "spec_state": spec_state(config),
            # each layer's KV cache group (connectors/group_tables.py); None: one table
            "layer_groups": runner.layer_group,
            "faults": config.faults}  # test-only fault injection (pd_cluster/faults.py)


def spec_state(config: EngineConfig) -> dict[str, Any] | None:
    """The speculative proposer's state a request carries (compared at handshake):
    None without one (speculation off, or ngram: drafts are a function of the tokens); for
    draft_model, which draft (its checkpoint's fingerprint), whose KV P and D must agree on."""
    spec = config.speculative
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "mtp":  # the served checkpoint's own layer (its KV and hidden state)
        return {"method": "mtp"}
    from connectors.hello import model_fingerprint
    from pd_cluster.engine.spec.draft_runner import draft_model_dir
    return {"method": spec.method, "model_id": model_fingerprint(draft_model_dir(spec))}


def create_worker_connector(config: EngineConfig, runner: ModelRunner, tp: Any = None) -> Any:
    """This rank's worker-side connector, registered on its cache (None without kv_transfer);
    returns the scheduler side (used by rank 0 only)."""
    if not config.kv_transfer:
        return None
    from connectors.factory import create_connector
    scheduler_side, worker_side = create_connector(config.kv_transfer,
                                                   engine_info(config, runner, tp))
    worker_side.register_kv_caches(runner.kv_caches)
    runner.connector = worker_side
    return scheduler_side


class Executor:
    def __init__(self, config: EngineConfig, hf_config: dict[str, Any], max_model_len: int):
        self.config = config
        self.workers: Any = None
        device = config.torch_device
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(hf_config, config.tensor_parallel_size)
            from pd_cluster.engine.worker_group import WorkerGroup
            self.workers = WorkerGroup(config, device)
        try:
            tp = self.workers.tp_group if self.workers else None
            self.runner = (ModelRunner(config, hf_config, max_model_len, tp, device) if tp
                           else ModelRunner(config, hf_config, max_model_len))
            kv = config.kv_transfer
            blocks = self.runner.fitting_blocks(kv.device_reserve_bytes() if kv else 0)
            self.num_blocks = self.workers.agree_num_blocks(blocks) if self.workers else blocks
            start_trace.mark("engine", "KV cache sized")
            self.runner.allocate_kv_cache(self.num_blocks)
            start_trace.mark("engine", "KV cache allocated")
            create_tier_store(config, self.runner)
            self.scheduler_connector = create_worker_connector(config, self.runner, tp)
            if self.workers is not None:
                self.workers.start()
        except BaseException:
            if getattr(self, "runner", None) is not None:
                self.runner.close()  # a background compile
            # The workers may be anywhere in their start-up (not listening for a Shutdown).
            if self.workers is not None:
                self.workers.kill()
            raise
        self.sampler = Sampler(seed=config.seed)
        self._tally = TransferTally(config.tensor_parallel_size)
        self._rank_bytes: dict[int, tuple[int, int]] = {}  # rank -> (KV bytes sent, received)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        step, plan = build_step(out.scheduled, self.config.block_size, out.kv_connector_metadata,
                                out.tier_ops)
        result = ModelRunnerOutput()
        with self.workers.step(step) if self.workers else nullcontext():
            logits = self.runner.run_step(step)
            ended = self.runner.finished_transfers()
            sending, recving, unfenced = set(ended.sent), dict(ended.received), set(ended.unfenced)
            if self.workers and self.runner.connector is not None:
                stats = self.runner.connector.stats()
                reports = self.workers.gather_transfers(RankTransfers(
                    sorted(sending), recving, stats["kv_bytes_sent"], stats["kv_bytes_received"],
                    sorted(unfenced)))
                self._rank_bytes = {r: (t.bytes_sent, t.bytes_received)
                                    for r, t in enumerate(reports)}
                sending, recving, unfenced = self._tally.add(reports)
        sample_step(plan, logits, self.sampler, result)
        result.finished_sending, result.finished_recving = sending, recving
        result.unfenced = unfenced
        return result

    @property
    def failed(self) -> bool:
        """A rank is gone: the next step raises (the engine is then restarted as a whole)."""
        return self.workers is not None and self.workers.failed

    # ---- the KV connector across ranks ----------------------------------------------------
    def kv_endpoint(self) -> str | None:
        """Where producers send this engine's KV: one endpoint per rank, joined in rank order."""
        conn = self.runner.connector
        if conn is None or conn.endpoint() is None:
            return None
        from connectors.tp_topology import join_endpoints
        return join_endpoints([conn.endpoint()] + (self.workers.endpoints() if self.workers
                                                   else []))

    def connect_peer(self, endpoint: str, tag: str | None) -> None:
        """Handshake every rank with a consumer (in parallel: workers in their threads)."""
        seq = self.workers.peer_op("connect", endpoint, tag) if self.workers else None
        self.runner.connector.connect_peer(endpoint, tag)
        if seq is None:
            return
        try:
            self.workers.wait_peer_op(seq, self.config.kv_transfer.pipe_config.handshake_timeout
                                      + 5.0)
        except Exception:
            # Linked on every rank or on none: rank 0's peers() is what the cluster sees.
            self.disconnect_peer(endpoint)
            raise

    def disconnect_peer(self, endpoint: str) -> None:
        if self.workers:
            self.workers.peer_op("disconnect", endpoint, None)
        self.runner.connector.disconnect_peer(endpoint)

    def set_kv_role(self, role: str) -> str | None:
        """Flip every rank's connector to ``role`` (a drained engine; connectors/pd_roles.py);
        returns the engine's new KV endpoint (None for a producer)."""
        seq = self.workers.peer_op("role", role, None) if self.workers else None
        self.runner.connector.set_role(role)
        if seq is not None:
            self.workers.wait_peer_op(seq, self.config.collective_timeout)
        return self.kv_endpoint()

    def kv_holds(self) -> dict[str, int]:
        """What rank 0's connector holds for transfers (pd_roles.holds; the ranks move in
        lockstep, so rank 0 answers for the engine)."""
        return self.runner.connector.holds() if self.runner.connector is not None else {}

    def connector_stats(self) -> dict[str, Any]:
        """Rank 0's connector stats, KV byte counters summed over the ranks."""
        stats = dict(self.runner.connector.stats())
        if self._rank_bytes:
            stats["kv_bytes_sent"] = sum(s for s, _ in self._rank_bytes.values())
            stats["kv_bytes_received"] = sum(r for _, r in self._rank_bytes.values())
        return stats

    def rank_stats(self) -> dict[str, Any]:
        """The ranks, for `pd-cluster status`: all on this engine's node, rank 0 this process."""
        import os
        pids = [os.getpid()] + ([p.pid for p in self.workers.procs] if self.workers else [])
        return {"tensor_parallel_size": self.config.tensor_parallel_size,
                "tp_pids": ",".join(map(str, pids))}

    def close(self) -> None:
        if getattr(self, "runner", None) is not None:
            self.runner.close()
            if self.runner.connector is not None:
                self.runner.connector.close()
        if self.workers is not None:
            self.workers.close()
