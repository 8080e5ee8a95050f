"""Engine configuration: pydantic models validated once, with errors that name the field."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from connectors.config import KVTransferConfig
from pd_cluster.faults import FaultsConfig

if TYPE_CHECKING:  # torch loads with an engine, not with the config (fast CLI checks)
    import torch

# dtype names the config accepts -> torch attribute names
_DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
# What device "auto" means in this process and every process it starts (they inherit it):
# tests set it so that no process of a CPU test picks a GPU; unset, "auto" is CUDA if available.
DEVICE_ENV = "PD_CLUSTER_DEVICE"
# engine.cpu_gemm's values (the layouts are models/layers/cpu_gemm.py's).
CPU_GEMM_MODES = ("auto", "torch", "transposed", "packed", "upcast")
# engine.kv_cache_dtype's values (vLLM's; the FP8 layout is kernels/kv_quant.py's).
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
COMPILE_MODES = ("background", "blocking")


def _check_device(value: str) -> str:
    if value not in ("cpu", "cuda") and not value.startswith("cuda:"):
        raise ValueError(f"must be auto, cpu or cuda[:N], got {value!r}")
    return value


class StructuredOutputsConfig(BaseModel):
    """The engine section's ``structured_outputs`` (vLLM's ``--structured-outputs-config``)."""
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    backend: str = "auto"  # auto | xgrammar (the one measured fastest here; see README)
    # JSON output with no whitespace between tokens unless a request says otherwise.
    disable_any_whitespace: bool = False
    # At most this many whitespace characters between two JSON tokens (json schemas and
    # json_object; null: unbounded). Pretty-printing fits; a small model that prefers "\n"
    # cannot pad until max_tokens (measured on tiny-llama: pure whitespace, unbounded).
    max_whitespace_cnt: int | None = 8
    compile_threads: int = 1  # grammars compile on these threads, never on the step's

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if value not in ("auto", "xgrammar"):
            raise ValueError(f"must be auto or xgrammar, got {value!r}")
        return value

    @field_validator("compile_threads")
    @classmethod
    def _threads(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("max_whitespace_cnt")
    @classmethod
    def _whitespace(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1 or null (for none at all: disable_any_whitespace), "
                             f"got {value}")
        return value


SPEC_METHODS = ("ngram", "draft_model", "mtp")


class SpeculativeConfig(BaseModel):
    """The engine section's ``speculative`` (vLLM's ``--speculative-config`` keys): decode
    engines verify up to ``num_speculative_tokens`` proposed tokens per request per step and
    keep the longest accepted prefix plus one token (engine/spec/)."""
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    # ngram (prompt lookup, no model) | draft_model (a small model) | mtp (the served
    # checkpoint's own MTP layer, DeepSeek-V3's num_nextn_predict_layers, chained k times)
    method: str = "ngram"
    num_speculative_tokens: int = 4  # drafts per request per step at most
    # ngram: a request whose drafts were all kept may verify up to this many next step (the
    # width doubles from num_speculative_tokens per fully kept verify, back at the first
    # rejected draft): a long copied span takes fewer steps. None: num_speculative_tokens.
    num_speculative_tokens_max: int | None = None
    prompt_lookup_min: int = 2  # shortest n-gram of the recent tokens looked up
    prompt_lookup_max: int = 5  # longest (tried first)
    # draft_model's checkpoint (a directory or a preset name): same tokenizer and vocabulary
    # as the served model, e.g. the same weights with fewer layers (pd-cluster make-model
    # (pd_cluster/checkpoints/truncate.py)
    model: str | None = None

    @field_validator("method")
    @classmethod
    def _method(cls, value: str) -> str:
        if value not in SPEC_METHODS:
            raise ValueError(f"must be one of {list(SPEC_METHODS)}, got {value!r}")
        return value

    @field_validator("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @model_validator(mode="after")
    def _window(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.num_speculative_tokens_max is not None:
            if self.method != "ngram":
                raise ValueError("num_speculative_tokens_max: only ngram grows its drafts")
            if self.num_speculative_tokens_max < self.num_speculative_tokens:
                raise ValueError(f"num_speculative_tokens_max ({self.num_speculative_tokens_max})"
                                 f" must be >= num_speculative_tokens "
                                 f"({self.num_speculative_tokens})")
        if self.model is not None and self.method == "ngram":
            raise ValueError("model: ngram proposes from the prompt and needs no model")
        if self.model is not None and self.method == "mtp":
            raise ValueError("model: mtp reads the served checkpoint's own MTP layers and "
                             "needs no model")
        if self.method == "draft_model" and not self.model:
            raise ValueError("model: draft_model needs the draft's checkpoint (a directory or "
                             "a preset name)")
        return self

    @property
    def max_drafts(self) -> int:
        """Drafts one request may verify in one step, at most."""
        return self.num_speculative_tokens_max or self.num_speculative_tokens


class KVOffloadingDiskConfig(BaseModel):
    """The engine section's ``kv_offloading_disk``: a disk tier written behind the host tier."""
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    # directory of the block files (made if missing; files of another model ignored); in a
    # cluster each engine writes <path>/<engine name>
    path: str
    size: float  # GiB of files at most (least recently used files go first)

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value:
            raise ValueError("must name a directory")
        return value

    @field_validator("size")
    @classmethod
    def _size(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"must be > 0 GiB, got {value}")
        return value


class EngineArgs(BaseModel):
    """Everything about an engine except which model it serves and its KV transfer role:
    the cluster YAML's ``engine`` section, shared by every engine of a cluster."""
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    dtype: str = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    device: str = "auto"  # auto (CUDA if present), cpu, cuda or cuda:N
    seed: int = 0  # seeds the engine's sampling RNG
    block_size: int = 16  # tokens per KV cache block (a power of two in [8, 128])
    # KV cache element type (vLLM's name and values): auto = the model's dtype; fp8_e4m3 /
    # fp8_e5m2 store K/V in FP8 with per-head scales in each block (the checkpoint's
    # k_scale/v_scale where it has them, else computed per block as it is written): about
    # half the bytes held and shipped of bf16 (a quarter of fp32), and 4 bytes per block and head.
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64  # requests in one step's batch at most
    max_num_batched_tokens: int = 2048  # tokens (prompt + decode) in one step at most
    # While any request decodes, at most this many prompt tokens per step (chunked prefill
    # does the rest), so a long local prefill does not stall running decodes' inter-token
    # latency. None: no cap beyond max_num_batched_tokens.
    max_prefill_tokens_per_step: int | None = None
    # While requests decode, prompt chunks ride in their steps as far as this TPOT target
    # allows: a step may outlast a decode step (the engine's measured step times,
    # engine/step_time_model.py) by the least slack of the decoding requests that can still
    # meet the target (pd_cluster/tpot_budget.py); at least one block's worth of prompt
    # tokens goes per step. None: no such bound (max_prefill_tokens_per_step alone). A
    # colocated cluster sets it to proxy.slo.tpot_ms.
    tpot_target_ms: float | None = None
    # With tpot_target_ms: the queued prompts' TTFT target. A mixed step's prompt chunk is
    # widened past what the TPOT slack allows as far as the prompts that can still meet this
    # target need (pd_cluster/ttft_budget.py). None: the TPOT bound alone. A colocated
    # cluster sets it to proxy.slo.ttft_ms.
    ttft_target_ms: float | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_kv_blocks: int | None = None  # KV cache blocks per rank (null: sized from memory)
    kv_cache_memory: int = 256 * 1024 * 1024  # CPU budget in bytes when num_kv_blocks is unset
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory an engine may use
    enable_prefix_caching: bool = True  # reuse the KV blocks of a prompt's cached prefix
    attention_backend: str = "auto"  # auto | cpu | torch | triton
    tokenizer: str | None = None  # tokenizer directory (null: the model's own)
    # Ranks per engine (one device each); the KV budget (num_kv_blocks, kv_cache_memory,
    # gpu_memory_utilization) is per rank.
    tensor_parallel_size: int = 1
    collective_timeout: float = 60.0  # s: bounds every collective between an engine's ranks
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    # torch.compile the decoder (attention outside the graph; engine/compiled_model.py), once
    # per model and kept on disk for the next start. None: $PD_CLUSTER_COMPILE decides
    # (neither: on for CPUs, off on GPUs until measured there); true/false decide here.
    compile: bool | None = None
    # When the compiled step is made: background (serve eagerly from the moment the weights
    # are loaded; a child process compiles, and each engine switches to the compiled step
    # between two steps once it is ready: engine/background_compile.py) or blocking (compile
    # before serving the first request). None: $PD_CLUSTER_COMPILE_MODE, else background.
    compile_mode: str | None = None
    # CPU linear weights' layout after loading (models/layers/cpu_gemm.py): auto (per dtype,
    # as measured: fp32 transposed on Intel CPUs and oneDNN-packed on other x86 ones, bf16
    # oneDNN-packed, or packed in fp32 where the CPU has no bf16 dot product; fp16 as loaded)
    # | torch (as loaded) | transposed | packed | upcast.
    # None: $PD_CLUSTER_CPU_GEMM decides (default auto). CUDA: as loaded.
    cpu_gemm: str | None = None
    # On CUDA: decode steps replay CUDA graphs captured at start per batch size and context
    # bucket (engine/cuda_graphs.py), in a pool bounded by half the memory
    # gpu_memory_utilization leaves. Off by default: not yet run on a GPU; turn on once
    # scripts/gpu_check.sh has passed its CUDA graph rows on yours.
    cuda_graphs: bool = False
    # GiB of host memory (pinned on CUDA) for KV blocks evicted from the device pool, summed
    # over an engine's ranks (vLLM's --kv-offloading-size); prefix hits there are restored
    # instead of recomputed (engine/kv_tiers/). None or 0: no host tier.
    kv_offloading_size: float | None = None
    # A disk tier below the host tier ({path, size}: GiB); needs kv_offloading_size and
    # tensor_parallel_size 1. In a cluster each engine uses <path>/<engine name> (its own
    # LRU and size; a restarted engine finds its files). None: no disk tier.
    kv_offloading_disk: KVOffloadingDiskConfig | None = None
    # Speculative decoding ({method: ngram | draft_model | mtp, num_speculative_tokens,
    # prompt_lookup_min, prompt_lookup_max, model}, vLLM's --speculative-config keys); None: off. Lossless: greedy output
    # is the same, sampled output has the same distribution (engine/spec/).
    speculative: SpeculativeConfig | None = None
    # Where requests' sampling defaults come from (vLLM's --generation-config): auto = the
    # model's generation_config.json (temperature, top_p, top_k, repetition_penalty for
    # requests that leave them unset; max_new_tokens the default and cap of max_tokens),
    # vllm = none (this API's own defaults), else a folder holding a generation_config.json.
    generation_config: str = "auto"
    # Sampling keys set over the generation config's, key by key (vLLM's
    # --override-generation-config), e.g. {temperature: 0.5}; with generation_config vllm,
    # only these.
    override_generation_config: dict[str, int | float] | None = None
    # Test-only: drop, delay, corrupt or fail a share of the KV pipe's sends and receives,
    # the token path's frames and the control calls ({kv_send: {drop: 0.05}, seed: 1, ...};
    # pd_cluster/faults.py says what each means). None: off (never set it in production).
    faults: FaultsConfig | None = None

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int) -> int:
        if not 8 <= value <= 128 or value & (value - 1):
            raise ValueError(f"must be a power of two in [8, 128], got {value}")
        return value

    @field_validator("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "max_model_len",
                     "tensor_parallel_size", "max_prefill_tokens_per_step")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"must be >= 1, got {value}")
        return value

    @field_validator("tpot_target_ms", "ttft_target_ms")
    @classmethod
    def _positive_ms(cls, value: float | None) -> float | None:
        if value is not None and not value > 0:
            raise ValueError(f"must be > 0 ms, got {value}")
        return value

    @field_validator("collective_timeout")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if value <= 0:
            raise ValueError(f"must be > 0, got {value}")
        return value

    @field_validator("kv_offloading_size")
    @classmethod
    def _offload_size(cls, value: float | None) -> float | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0 GiB, got {value}")
        return value

    @model_validator(mode="after")
    def _fp8_graphs(self) -> "EngineArgs":
        # An FP8 write grows block scales with host-side decisions: not capturable in a graph.
        if self.cuda_graphs and self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype} does not run in CUDA "
                             f"graphs yet; set cuda_graphs false or kv_cache_dtype auto")
        return self

    @model_validator(mode="after")
    def _offload_disk(self) -> "EngineArgs":
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size: the KV tiers hold prefix-cache blocks; "
                             "they need enable_prefix_caching")
        if self.kv_offloading_disk is None:
            return self
        if not self.kv_offloading_size:
            raise ValueError("kv_offloading_disk: the disk tier is written behind the host "
                             "tier; set kv_offloading_size too")
        if self.tensor_parallel_size > 1:
            raise ValueError("kv_offloading_disk: needs tensor_parallel_size 1 (got "
                             f"{self.tensor_parallel_size})")
        return self

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, value: str) -> str:
        if not value:
            raise ValueError("must be auto, vllm or a folder holding a generation_config.json")
        return value

    @field_validator("override_generation_config")
    @classmethod
    def _override_generation(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        from pd_cluster.generation_defaults import check_override
        if value:
            check_override(value)
        return value

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(f"must be in (0, 1], got {value}")
        return value

    @field_validator("compile_mode")
    @classmethod
    def _compile_mode(cls, value: str | None) -> str | None:
        if value is not None and value not in COMPILE_MODES:
            raise ValueError(f"must be one of {list(COMPILE_MODES)}, got {value!r}")
        return value

    @field_validator("cpu_gemm")
    @classmethod
    def _cpu_gemm(cls, value: str | None) -> str | None:
        if value is not None and value not in CPU_GEMM_MODES:
            raise ValueError(f"must be one of {list(CPU_GEMM_MODES)}, got {value!r}")
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_cache_dtype(cls, value: str) -> str:
        if value not in KV_CACHE_DTYPES:
            raise ValueError(f"must be one of {list(KV_CACHE_DTYPES)}, got {value!r}")
        return value

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        if value != "auto" and value not in _DTYPES:
            raise ValueError(f"must be auto or one of {sorted(_DTYPES)}, got {value!r}")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        return value if value == "auto" else _check_device(value)


class EngineConfig(EngineArgs):
    """One engine's whole configuration, validated once (errors name the field)."""
    model: str
    kv_transfer: KVTransferConfig | None = None

    @model_validator(mode="after")
    def _mtp_without_tiers(self) -> "EngineConfig":
        # The MTP layer reads the target's hidden state at every position, so prefix caching
        # is off with mtp (llm_engine.py), and the KV tiers restore prefix-cache blocks.
        # Through P/D the prefill engine ships the MTP layer's KV and the prompt's last hidden
        # state (engine/spec/mtp_pd.py).
        spec = self.speculative
        if spec is None or spec.method != "mtp":
            return self
        if self.kv_offloading_size:
            raise ValueError("speculative.method: mtp turns prefix caching off, which the KV "
                             "tiers need; unset kv_offloading_size")
        return self

    @model_validator(mode="after")
    def _corrupt_needs_a_check(self) -> "EngineConfig":
        # A flipped bit nothing checks would be decoded on: wrong tokens, not a test.
        faults, kv = self.faults, self.kv_transfer
        if faults is None or kv is None or kv.pipe_config.integrity != "none":
            return self
        for site in ("kv_send", "kv_recv"):
            if faults.site(site).corrupt:
                raise ValueError(f"faults.{site}.corrupt: needs kv_transfer.integrity mac or "
                                 f"crc32 (with none nothing would catch it)")
        return self

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> "EngineConfig":
        unknown = sorted(set(kwargs) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)

    @property
    def torch_device(self) -> "torch.device":
        """The device this config names; "auto": $PD_CLUSTER_DEVICE, else CUDA if available."""
        import torch
        if self.device != "auto":
            return torch.device(self.device)
        override = os.environ.get(DEVICE_ENV)
        if override:
            try:
                return torch.device(_check_device(override))
            except ValueError as e:
                raise ValueError(f"${DEVICE_ENV}: {e}") from None
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def on_device(self, device: "torch.device") -> "EngineConfig":
        """This config with ``device`` made concrete, for the processes an engine starts (its
        workers, an engine subprocess): they use the device the parent resolved, never their
        own idea of "auto"."""
        return self.model_copy(update={"device": str(device)})

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, _DTYPES[self.dtype])

    @property
    def kv_torch_dtype(self) -> "torch.dtype":
        """The KV cache's element type: the model's (auto) or an FP8 one."""
        from kernels.kv_quant import kv_cache_torch_dtype
        return kv_cache_torch_dtype(self.kv_cache_dtype, self.torch_dtype)


def read_hf_config(model_dir: str) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"model: {model_dir!r} has no config.json (expected a Hugging Face "
                         f"checkpoint directory; `pd-cluster make-model --out DIR` writes one)")
    return json.loads(path.read_text())
