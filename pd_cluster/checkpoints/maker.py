"""Generate small, deterministic Hugging Face checkpoints (weights + tokenizer) offline.

The engine has no model hub to download from, so tests and benchmarks use models made here.
The weights are random but shaped so that greedy decoding is a robust correctness oracle:
logits are far from flat (clear top-1/top-2 gaps) and greedy continuations stay varied.
The built-in default, preset ``tiny-llama``, is the exception: it is trained to write readable
English by scripts/train_tiny_model.py (with this module's tokenizer pipeline, config and
writer) and shipped in ``pd_cluster/assets/tiny-llama`` rather than generated.

Tokenizer: byte-level BPE trained on ``corpus.CORPUS``; ids 0..3 are ``<unk> <s> </s> <pad>``.
``encode``/``__call__`` add NO special tokens (no BOS/EOS) with or without add_special_tokens,
so ``decode(encode(s)) == s`` (for NFC text, e.g. any ASCII). The chat template adds none either.
If the corpus cannot supply ``vocab_size`` BPE tokens (it tops out near 1.7k), the tokenizer is
padded with special ``<unused_N>`` tokens so ``len(tokenizer) == config.vocab_size``; their
embedding and lm_head rows are zero, so greedy decoding never emits them (sampling rarely can).
With untied embeddings the lm_head rows of <unk>/<s>/<pad> are zero too; </s> can be generated.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

from pd_cluster.paths import cache_root

from .corpus import CORPUS
# Re-exported: callers import the checkpoint writer and the presets from here.
from .writer import (CHAT_TEMPLATE, MAKER_FILE, param_count,  # noqa: F401
                                save_checkpoint)
from .presets import ASSETS, PRESETS, TRAINED_PRESETS, preset_names, trained_model_path  # noqa: F401

# Bump when anything that changes the generated files changes; cached presets are regenerated.
GENERATOR_VERSION = 2  # 2: tiny-deepseek-v3 has an MTP layer
ARCHS = ("llama", "qwen2", "mistral", "qwen3", "gemma2", "gemma3", "phi3", "olmo2", "deepseek_v3")
# HF config class and architecture of each arch (Gemma 3: the text-only causal LM).
_HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
               "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
               "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
               "phi3": ("Phi3Config", "Phi3ForCausalLM"),
               "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
               "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0, 1, 2, 3
MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 40  # byte alphabet + specials + some merges
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                     r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Init scales (see _init_weights): residual stream RMS ~1, sublayers O(1), logits std ~LOGIT_STD.
EMBED_STD = 1.0
LINEAR_GAIN = 1.0
QK_GAIN = 1.5  # sharper attention -> position/context-dependent outputs, fewer greedy loops
BIAS_STD = 0.1  # non-zero q/k/v biases (qwen2) so an engine that drops them is caught
NORM_STD = 0.1  # norm weights 1 + N(0, NORM_STD) so an engine that ignores them is caught
LOGIT_STD = 6.0
# Tied lm_head = embedding: logits contain <h, e_current>, so a large embedding share of the
# residual makes the model echo its input token forever; boost the sublayer outputs instead.
TIED_RESID_GAIN = 8.0
# Projections whose output is a query or key (latent attention: q_b_proj, kv_b_proj's keys).
_QK_PROJS = ("q_proj", "k_proj", "q_b_proj", "kv_b_proj")


def _validate(arch: str, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int,
              num_kv_heads: int, head_dim: int | None, intermediate_size: int,
              max_position_embeddings: int, rope_theta: float) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (byte alphabet + specials), got {vocab_size}")
    for name, v in (("hidden_size", hidden_size), ("num_layers", num_layers), ("num_heads", num_heads),
                    ("num_kv_heads", num_kv_heads), ("intermediate_size", intermediate_size),
                    ("max_position_embeddings", max_position_embeddings)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim is None:
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}) "
                             "unless head_dim is given")
        head_dim = hidden_size // num_heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even int (RoPE rotates pairs), got {head_dim!r}")
    if not rope_theta > 0:
        raise ValueError(f"rope_theta must be > 0, got {rope_theta!r}")


def build_tokenizer(vocab_size: int, texts: Iterable[str] | None = None) -> tuple[Any, int]:
    """(PreTrainedTokenizerFast, number of trained non-padding tokens) for vocab_size, trained
    on ``texts`` (default: the built-in ``corpus.CORPUS``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # Exactly the pipeline transformers 5's Qwen2Tokenizer rebuilds (AutoTokenizer forces that class
    # for model_type qwen2, ignoring tokenizer.json's pre-tokenizer), so every arch encodes
    # identically. add_prefix_space=False keeps decode(encode(s)) == s.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=0, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(keepends=True) if texts is None else texts,
                            trainer=trainer)
    n = tok.get_vocab_size()
    if n < vocab_size:  # corpus exhausted its merges: fill with never-produced special tokens
        tok.add_special_tokens([AddedToken(f"<unused_{i}>", special=True) for i in range(vocab_size - n)])
    if tok.get_vocab_size() != vocab_size:  # below the byte alphabet and special tokens
        raise ValueError(f"vocab_size: {vocab_size} is too small for the byte-level tokenizer "
                         f"(it needs {tok.get_vocab_size()})")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", clean_up_tokenization_spaces=False, chat_template=CHAT_TEMPLATE), n


def _init_weights(model, n_real_tokens: int, seed: int) -> None:
    """Re-initialise every parameter from our own seeded generator (independent of HF init)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    tied = getattr(cfg, "tie_word_embeddings", False)
    head_std = LOGIT_STD / math.sqrt(cfg.hidden_size)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied lm_head appears once, as embed_tokens
            if name.endswith("embed_tokens.weight"):
                std = head_std if tied else EMBED_STD
            elif name.startswith("lm_head."):
                std = head_std
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + NORM_STD * torch.randn(p.shape, generator=gen))
                continue
            elif name.endswith(".bias"):
                std = BIAS_STD
            else:
                gain = QK_GAIN if any(f".{n}." in name for n in _QK_PROJS) else LINEAR_GAIN
                if tied and (".o_proj." in name or ".down_proj." in name):
                    gain *= TIED_RESID_GAIN
                std = gain / math.sqrt(p.shape[-1])  # fan-in (stacked experts: [E, out, in])
            p.copy_(std * torch.randn(p.shape, generator=gen))
            if "embed_tokens" in name or name.startswith("lm_head."):
                p[n_real_tokens:] = 0.0  # padded <unused_N> ids: never chosen by greedy decoding
            if name.startswith("lm_head."):
                p[[0, 1, 3]] = 0.0  # <unk>, <s>, <pad> are never predicted (</s> may be)
        for name, b in model.named_buffers():  # DeepSeek's router bias: non-zero, so it is checked
            if name.endswith("e_score_correction_bias"):
                b.copy_(BIAS_STD * torch.randn(b.shape, generator=gen))


def make_model(out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0, *, vocab_size: int = 512,
               hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
               head_dim: int | None = None, intermediate_size: int = 128, tie_word_embeddings: bool = False,
               max_position_embeddings: int = 2048, rope_theta: float = 10000.0,
               config_overrides: dict[str, Any] | None = None,
               max_shard_size: str | None = None) -> Path:
    """Write a deterministic HF checkpoint (config, model.safetensors, tokenizer) to out_dir.

    ``config_overrides``: extra HF config fields (a sliding_window, rope_parameters,
    layer_types, soft-caps...); ``max_shard_size`` (e.g. "2MB") writes a sharded checkpoint
    with model.safetensors.index.json."""
    _validate(arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
              intermediate_size, max_position_embeddings, rope_theta)
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer, n_real = build_tokenizer(vocab_size)
    config = build_config(tokenizer, arch, vocab_size=vocab_size, hidden_size=hidden_size,
                          num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                          head_dim=head_dim, intermediate_size=intermediate_size,
                          tie_word_embeddings=tie_word_embeddings,
                          max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
                          overrides=config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    _init_weights(model, n_real, seed)
    from .mtp_weights import mtp_tensors
    return save_checkpoint(model, tokenizer, out_dir,
                           dict(generator_version=GENERATOR_VERSION, arch=arch, seed=seed,
                                tokenizer_trained_vocab=n_real), max_shard_size,
                           mtp_tensors(model, n_real, seed, _init_weights))


def build_config(tokenizer: Any, arch: str = "llama", *, vocab_size: int, hidden_size: int,
                 num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int | None = None,
                 intermediate_size: int, tie_word_embeddings: bool = False,
                 max_position_embeddings: int = 2048, rope_theta: float = 10000.0,
                 overrides: dict[str, Any] | None = None) -> Any:
    """The HF config (fp32, no biases beyond the arch's own) of a model using ``tokenizer``."""
    import torch
    import transformers

    ids = {k: tokenizer.convert_tokens_to_ids(t) for k, t in
           (("bos_token_id", "<s>"), ("eos_token_id", "</s>"), ("pad_token_id", "<pad>"))}
    common: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings, max_position_embeddings=max_position_embeddings,
        rope_theta=float(rope_theta), rms_norm_eps=1e-6, hidden_act="silu", **ids)
    if head_dim is not None or arch in ("gemma2", "gemma3"):  # Gemma's default head_dim is 256
        common["head_dim"] = head_dim or hidden_size // num_heads
    if arch == "llama":
        common.update(attention_bias=False, mlp_bias=False)
    elif arch in ("qwen2", "qwen3"):  # HF Qwen2 always has q/k/v biases
        common.update(use_sliding_window=False, sliding_window=None)
    elif arch == "mistral":  # sliding_window=None: plain full attention, same math as llama
        common.update(sliding_window=None)
    elif arch in ("gemma2", "gemma3"):
        del common["hidden_act"]
        common.update(hidden_activation="gelu_pytorch_tanh",
                      query_pre_attn_scalar=common["head_dim"])
    elif arch == "phi3":
        common.update(original_max_position_embeddings=max_position_embeddings)
    elif arch == "deepseek_v3":  # latent attention: every head reads the one latent
        common.update(num_key_value_heads=num_heads, attention_bias=False)
        common.pop("head_dim", None)  # HF derives it (qk_rope_head_dim)
    common.update(overrides or {})
    config_class, architecture = _HF_CLASSES[arch]
    config = getattr(transformers, config_class)(**common)
    config.dtype = torch.float32
    config.architectures = [architecture]
    return config


def _is_current(path: Path) -> bool:
    try:
        meta = json.loads((path / MAKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("generator_version") == GENERATOR_VERSION and (path / "model.safetensors").is_file()


def default_model_path(name: str = "tiny-llama") -> Path:
    """The preset's checkpoint dir: a trained preset's shipped copy, else the cached generated one,
    ($PD_CLUSTER_CACHE or ~/.cache/pd_cluster)/models/name, made on first use."""
    if name not in PRESETS:
        raise ValueError(f"name must be one of {preset_names()}, got {name!r}")
    if name in TRAINED_PRESETS:
        return trained_model_path(name)
    path = cache_root() / "models" / name
    if _is_current(path):
        return path
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.parent / f".{name}.lock")):  # racing processes: one builds, others reuse
        if not _is_current(path):
            make_model(path, **PRESETS[name])
    return path
