"""``speculative: {method: mtp}``: the served checkpoint's MTP layer (models/mtp.py) as a
hidden-state head, its own KV pool, and the proposer; the target keeps its hidden states."""
from __future__ import annotations

from typing import Any

from pd_cluster.config import EngineConfig
from pd_cluster.engine.spec.head_runner import HeadRunner
from pd_cluster.engine.spec.hidden_proposer import HiddenStateProposer
from pd_cluster.models.layers.cpu_gemm import prepare_model
from pd_cluster.models.mtp import load_mtp


def mtp_proposer(config: EngineConfig, hf_config: dict[str, Any], target: Any,
                 target_blocks: int, max_model_len: int) -> HiddenStateProposer:
    """``target``: rank 0's ModelRunner (its backend; it keeps each step's hidden states)."""
    spec = config.speculative
    assert spec is not None
    dtype, device = config.torch_dtype, config.torch_device
    head = load_mtp(config.model, hf_config, dtype, device)
    prepare_model(head, dtype, device, config.cpu_gemm)
    # As many tokens as the target's cache, plus each sequence's lookahead.
    lookahead = -(-spec.num_speculative_tokens // config.block_size) + 1
    runner = HeadRunner(head, config, max_model_len,
                        target_blocks + config.max_num_seqs * lookahead,
                        lambda: target.backend, dtype)
    target.keep_hidden = True
    return HiddenStateProposer(spec, runner, max_model_len)
