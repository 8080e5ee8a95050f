"""Building an engine's speculative proposer from its config, and the piece that ships the
proposer's own KV (or state) through P/D beside the target's."""
from __future__ import annotations

from typing import Any

from pd_cluster.config import EngineConfig
from pd_cluster.engine.spec.ngram import NgramProposer


def make_proposer(config: EngineConfig, hf_config: dict[str, Any], executor: Any,
                  tokenizer: Any, max_model_len: int) -> Any:
    """The speculative proposer (None: speculation off)."""
    spec = config.speculative
    if spec is None:
        return None
    runner = executor.runner
    if spec.method == "ngram":
        return NgramProposer(spec, max_model_len)
    if spec.method == "mtp":
        from pd_cluster.engine.spec.mtp_setup import mtp_proposer
        return mtp_proposer(config, hf_config, runner, executor.num_blocks, max_model_len)
    from pd_cluster.engine.spec.draft_model import DraftModelProposer
    from pd_cluster.engine.spec.draft_runner import DraftRunner
    # As many tokens as the target's cache, plus each sequence's lookahead.
    lookahead = -(-spec.num_speculative_tokens // config.block_size) + 1
    blocks = executor.num_blocks + config.max_num_seqs * lookahead
    draft = DraftRunner(config, hf_config, tokenizer, max_model_len, blocks,
                        lambda: runner.backend)
    return DraftModelProposer(spec, draft, max_model_len)


def proposer_through_pd(config: EngineConfig, hf_config: dict[str, Any], executor: Any,
                        proposer: Any) -> Any:
    """With a draft model or the MTP layer and the P/D connector: what ships its KV with the
    target's (spec/draft_pd.py, spec/mtp_pd.py); None otherwise."""
    runner = executor.runner
    worker = runner.connector
    method = config.speculative.method if config.speculative else None
    if method not in ("draft_model", "mtp") or worker is None \
            or not hasattr(worker, "register_draft_caches"):
        return None
    if method == "mtp":
        from pd_cluster.engine.spec.mtp_pd import MTPStateThroughPD
        return MTPStateThroughPD(proposer, worker, executor.scheduler_connector,
                                 int(hf_config["hidden_size"]), config.torch_dtype, runner)
    from pd_cluster.engine.spec.draft_pd import DraftKVThroughPD
    return DraftKVThroughPD(proposer, worker, executor.scheduler_connector)
