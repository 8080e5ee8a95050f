"""One rank's model, paged KV cache and worker-side KV connector: runs a StepInput's forward
and returns the logits it asks for (sampling is rank 0's, in step_output.py)."""
from __future__ import annotations

import logging
from typing import Any

import torch

from connectors.base import FinishedTransfers
from pd_cluster import start_trace
from pd_cluster.attention import AttentionMetadata, create_backend
from pd_cluster.attention.background_kernels import BackgroundKernels, needs_build
from pd_cluster.config import EngineConfig
from pd_cluster.engine.cache_engine import (DeviceMemory, KVCacheSpec, allocate_kv_caches,
                                            determine_num_blocks)
from pd_cluster.engine.compiled_model import CompiledModel, compile_enabled, compile_mode
from pd_cluster.engine.cuda_graphs import DecodeGraphs, pool_bound
from pd_cluster.engine.input_buffers import InputBuffers
from pd_cluster.engine.kv_groups import layer_groups, make_groups
from pd_cluster.engine.kv_spec import check_kv_dtype
from pd_cluster.engine.step_input import StepInput
from pd_cluster.models.context import ForwardContext
from pd_cluster.models.layers.cpu_gemm import prepare_model
from pd_cluster.models.layers.tp import TPGroup
from pd_cluster.models.loader import load_model

logger = logging.getLogger(__name__)


def profile_batch(num_tokens: int, max_model_len: int, max_num_seqs: int
                  ) -> tuple[list[int], int]:
    """The worst step the scheduler can build: (prompt lengths, logits rows). ``num_tokens``
    (max_num_batched_tokens) split into prompts no longer than the model's positions, and one
    logits row per sequence that may sample in a step (max_num_seqs)."""
    lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lens.append(num_tokens % max_model_len)
    return lens, min(max_num_seqs, num_tokens)


def groups_enabled(config: EngineConfig) -> bool:
    """Whether layers of different kinds get their own block tables (kv_groups.py): also
    through P/D (each layer's KV ships from and into its group's table:
    connectors/group_tables.py) and with the KV tiers (each group's page of a block is its
    own tier entry: group_hits.tier_key); not yet where a draft model reads the target's
    block ids: there every layer keeps every block, as before."""
    spec = config.speculative
    return spec is None or spec.method != "draft_model"


class ModelRunner:
    """One rank's model, paged KV cache and worker-side connector (the engine's rank 0 runs
    in the engine process; the others in worker processes, see worker.py)."""

    def __init__(self, config: EngineConfig, hf_config: dict[str, Any],
                 max_model_len: int | None = None, tp: TPGroup = TPGroup(),
                 device: torch.device | None = None):
        self.config = config
        self.tp = tp
        self.max_model_len = max_model_len or int(hf_config.get("max_position_embeddings", 2048))
        self.device = device or config.torch_device
        self.dtype = config.torch_dtype
        before = self._allocated()
        self.model = load_model(config.model, hf_config, self.dtype, self.device, tp=tp)
        self.weights_bytes = self._allocated() - before  # this engine's, not the process's
        start_trace.mark("engine", "weights loaded")
        prepare_model(self.model, self.dtype, self.device, config.cpu_gemm)  # CPU GEMM layout
        layer_specs = tuple(self.model.kv_cache_specs(config.kv_torch_dtype))
        self.kv_spec = KVCacheSpec(config.block_size, layer_specs,
                                   make_groups(layer_specs, groups_enabled(config)))
        groups = self.kv_spec.kv_groups
        self.layer_group = layer_groups(groups, len(layer_specs)) if len(groups) > 1 else None
        check_kv_dtype(self.kv_spec, config.kv_cache_dtype)
        start_trace.mark("engine", "weights prepared")
        # What runs a forward: the model, or the same through one compiled graph (made before
        # serving, or in the background while the steps run eagerly: compile_mode). CUDA graphs
        # capture the forward once, at start: they get the compiled one, made before serving.
        # In the background too: the CPU attention kernels' first build (torch attention
        # until then).
        background = (compile_mode(config.compile_mode) == "background"
                      and not (self.device.type == "cuda" and config.cuda_graphs))
        self._kernels = (BackgroundKernels(self.device)
                         if background and needs_build(config.attention_backend, self.device)
                         else None)
        self.backend = (self._kernels.backend if self._kernels is not None
                        else create_backend(config.attention_backend, self.device))
        start_trace.mark("engine", "attention backend")
        self.forward_model: Any = self.model
        if compile_enabled(config.compile, self.device):
            self.forward_model = CompiledModel(self.model, self.device,
                                               config if background else None)
            start_trace.mark("engine", "compiled model set up")
        self.kv_caches: list[torch.Tensor] = []
        self.inputs = InputBuffers(config.max_num_batched_tokens, config.max_num_seqs,
                                   -(-self.max_model_len // config.block_size),
                                   config.block_size, self.device, num_groups=len(groups))
        self.decode_graphs: DecodeGraphs | None = None  # CUDA only, after the cache exists
        self.connector: Any = None  # worker-side KV connector
        self.tier_store: Any = None  # this rank's KV host tier (kv_tiers/host_store.py)
        # Hidden-state proposers (spec/hidden_head.py) read the last step's hidden states.
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None

    # ---- set-up --------------------------------------------------------------------------
    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def init_kv_cache(self, reserved_bytes: int = 0) -> int:
        """Allocate the paged KV cache; ``reserved_bytes``: device memory the KV connector
        will hold (sized before it exists)."""
        num_blocks = self.fitting_blocks(reserved_bytes)
        self.allocate_kv_cache(num_blocks)
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.kv_spec, num_blocks, self.device)
        # The captured graphs hold one block table: several groups' steps run eagerly.
        if self.device.type == "cuda" and self.config.cuda_graphs and self.layer_group is None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            graphs = DecodeGraphs(self.forward_model, self.backend, self.kv_caches,
                                  self.config.max_num_seqs, self.max_model_len,
                                  self.config.block_size, self.device, self.tp,
                                  pool_bound(total, self.config.gpu_memory_utilization))
            self.decode_graphs = graphs if graphs.capture() else None

    def fitting_blocks(self, reserved_bytes: int = 0) -> int:
        """How many blocks this rank's budget holds (ranks agree on their minimum)."""
        memory = None
        if self.device.type == "cuda" and self.config.num_kv_blocks is None:
            memory = DeviceMemory.measure(self.device, self.weights_bytes,
                                          self._profile_peak_bytes(), reserved_bytes)
        num_blocks = determine_num_blocks(
            self.kv_spec, self.device, self.config.num_kv_blocks, self.config.kv_cache_memory,
            self.config.gpu_memory_utilization, memory)
        return num_blocks

    def _profile_peak_bytes(self) -> int:
        """Peak activation bytes of the worst step, measured on a throwaway cache."""
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.profile_forward()
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak

    @torch.inference_mode()
    def profile_forward(self) -> None:
        """One forward (and the logits) of the largest batch the scheduler may run."""
        lens, rows = profile_batch(self.config.max_num_batched_tokens, self.max_model_len,
                                   self.config.max_num_seqs)
        bs = self.config.block_size
        per_seq = [-(-n // bs) for n in lens]
        caches = allocate_kv_caches(self.kv_spec, sum(per_seq), self.device)
        width, first = max(per_seq), 0
        tables = []
        for nb in per_seq:
            tables.append(list(range(first, first + nb)) + [0] * (width - nb))
            first += nb
        tables_t = torch.tensor(tables, dtype=torch.int32)
        positions = torch.cat([torch.arange(n) for n in lens])
        seq_of = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
        slots = tables_t[seq_of, positions // bs].long() * bs + positions % bs
        query_start = [0]
        for n in lens:
            query_start.append(query_start[-1] + n)
        meta = self._metadata(slots, query_start, list(lens), tables_t, num_decodes=0)
        ctx = ForwardContext(meta, caches, self.backend)
        hidden = self.forward_model(
            torch.zeros(len(positions), dtype=torch.long, device=self.device),
            positions.to(self.device), ctx)
        self.model.compute_logits(hidden[:rows])
        del caches, hidden

    def close(self) -> None:
        """Ends a background compile still running (bounded)."""
        if isinstance(self.forward_model, CompiledModel):
            self.forward_model.close()

    def compile_stats(self) -> dict[str, Any]:
        """Whether the steps run compiled (1/0) and the compile's state in words (off,
        compiling, compiled, failed: eager)."""
        model = self.forward_model
        if not isinstance(model, CompiledModel):
            return {"compiled": 0, "compile_state": "off"}
        return {"compiled": int(model.ready), "compile_state": model.state}

    # ---- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def run_step(self, step: StepInput) -> list[torch.Tensor]:
        """This rank's part of a step: the KV tiers' ops first, then the connector's loads and
        saves around one forward, and the logits of each of ``step.logit_rows``'s groups (full
        vocabulary, on every rank)."""
        conn = self.connector
        # The previous step's sends may still read the cache (zero-copy views of its blocks):
        # they settle before this step writes it, not at the end of their own step, so that
        # step's tokens (P's first token) did not wait for its KV to leave.
        if conn is not None and not step.empty:
            conn.wait_for_save()
        if step.tier_ops is not None:
            # Before the connector binds (a consumer may write received KV into blocks just
            # evicted: their save reads them first) and before the forward.
            self.tier_store.execute(step.tier_ops)
        if conn is not None:
            if step.kv_meta is not None:
                conn.bind_connector_metadata(step.kv_meta)
                if conn.loads_layerwise:
                    conn.start_load_kv(self.kv_caches)
        try:
            logits = self._forward(step) if not step.empty else []
        finally:
            if conn is not None:
                conn.clear_connector_metadata()
        return logits

    def finished_transfers(self) -> FinishedTransfers:
        """This rank's connector's ended transfers (connectors/base.FinishedTransfers)."""
        if self.connector is None:
            return FinishedTransfers(set(), {})
        return self.connector.get_finished()

    def _forward(self, step: StepInput) -> list[torch.Tensor]:
        if self._kernels is not None:
            self.backend = self._kernels.current()
        t = self.inputs.prepare(step)
        ctx = ForwardContext(t.meta, self.kv_caches, self.backend, self.connector,
                             rope_lens=t.rope_lens, group_metas=t.group_metas,
                             layer_group=self.layer_group)
        if self._replays(step):
            hidden = self.decode_graphs.run(t.token_ids, t.positions, t.meta.slot_mapping,
                                            t.meta.seq_lens, t.meta.block_tables, t.rope_lens,
                                            t.meta.max_seq_len)
        else:
            hidden = self.forward_model(t.token_ids, t.positions, ctx)
        if self.keep_hidden:
            self.last_hidden = hidden
        out = []
        for group in step.logit_rows:
            if len(group) == 1:
                rows = hidden[group[0][0]:group[0][1]]
            else:
                rows = hidden[torch.tensor([r for a, b in group for r in range(a, b)],
                                           device=self.device)]
            out.append(self.model.compute_logits(rows))
        return out

    def _replays(self, step: StepInput) -> bool:
        """A captured graph runs this step: decodes only, a graph captured for their number and
        longest context, and no connector loading KV layer by layer during it (a replay skips
        the connector's hooks; sends only follow prefills)."""
        graphs = self.decode_graphs
        return (graphs is not None and step.num_decodes == len(step.seq_lens)
                and graphs.ready(len(step.tokens), max(step.seq_lens))
                and not (self.connector is not None and self.connector.loads_layerwise))

    def _metadata(self, slots: torch.Tensor, query_start: list[int], seq_lens: list[int],
                  tables: torch.Tensor, num_decodes: int) -> AttentionMetadata:
        dev = self.device
        return AttentionMetadata(
            slot_mapping=slots.to(dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=tables.to(dev, torch.int32), num_decodes=num_decodes,
            max_query_len=max(b - a for a, b in zip(query_start, query_start[1:])),
            max_seq_len=max(seq_lens), block_size=self.config.block_size,
            query_start_loc_cpu=list(query_start), seq_lens_cpu=list(seq_lens))
