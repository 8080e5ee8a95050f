"""The MTP layer's state through P/D (speculative ``mtp``): draft_pd.py's path (the
proposer's blocks reserved on D at admission, taken on P at the first send, its layer shipped
after the target's: connectors/draft_layers.py), with the MTP layer's prefill in place of a
draft model's, and the one hidden state D's first proposal needs riding in the FIN.

What D's first proposal reads (hidden_proposer.py): a request of n = L + 1 tokens (the prompt
of L and the first token t_L, from P's FIN) catches the head up on positions computed .. n - 2,
each with the target's hidden state h_p and token t_{p+1}; the last one (p = L - 1, fed h_{L-1}
and t_L) gives the first draft, the chain the rest. P has h_0 .. h_{L-1} (its own forward,
after the final norm) and the prompt, so it runs positions 0 .. L - 2 (t_L is sampled after
the forward) and ships their KV; the FIN carries h_{L-1} (one row, in the model's dtype). D
then starts at computed = L - 1 with that row: its first proposal runs one position, exactly
the colocated engine's last catch-up position, over the same KV. P's prefix caching is off
with mtp (llm_engine.py): it computes every prompt position, so every hidden state is there.

Where the MTP state does not land (TP > 1, nixl, a full pool on either side, a failed send:
the FIN says "no draft") D has no hidden states for the prompt, which only a second target
prefill would give back: that request decodes without drafts (lossless: the target decides
every token). A transfer that fails closed is recomputed on D, which then has every hidden
state and speculates as colocated."""
from __future__ import annotations

import logging
from typing import Any

import torch

from pd_cluster.engine.spec.draft_pd import DraftKVThroughPD, _Shipping
from pd_cluster.engine.spec.head_runner import HeadChunk
from pd_cluster.engine.spec.hidden_head import target_rows
from pd_cluster.engine.spec.hidden_proposer import HiddenStateProposer
from pd_cluster.engine.step_input import batch_order

logger = logging.getLogger(__name__)


def encode_hidden(row: torch.Tensor, dtype: torch.dtype) -> bytes:
    """One hidden state [hidden] as raw bytes in ``dtype`` (the engines' model dtype)."""
    return row.detach().to("cpu", dtype).contiguous().view(torch.uint8).numpy().tobytes()


def decode_hidden(data: bytes, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """encode_hidden's bytes as a [1, hidden] tensor (their length checked by the receiver)."""
    return torch.frombuffer(bytearray(data), dtype=dtype).view(1, -1).to(device)


class MTPStateThroughPD(DraftKVThroughPD):
    def __init__(self, proposer: HiddenStateProposer, worker: Any, scheduler_connector: Any,
                 hidden_size: int, dtype: torch.dtype, target: Any) -> None:
        """``target``: rank 0's ModelRunner (its ``last_hidden``: the step's hidden states)."""
        state_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
        super().__init__(proposer, worker, scheduler_connector, state_bytes)
        self.dtype, self.target = dtype, target
        proposer.decode_landed = lambda data: decode_hidden(data, dtype, proposer.runner.device)

    def _prefill(self, todo: list[tuple[_Shipping, Any, int]], out: Any) -> None:
        """The MTP layer over prompt positions computed .. min(end, L - 1) - 1 of each request
        (this step's hidden states, token p + 1 from the prompt); at the prompt's end, h_{L-1}
        goes to its FIN."""
        hidden = self.target.last_hidden
        rows = {r.request.request_id: r for r in target_rows(batch_order(out.scheduled))}
        chunks: list[HeadChunk] = []
        for state, item, end in todo:
            request, start = state.request, state.computed
            r = rows[request.request_id]
            last = request.num_prompt_tokens - 1
            if r.start > start or r.start + r.count < end:  # positions with no hidden state
                logger.warning("MTP state of %s not shipped: hidden states %d.. missing",
                               request.request_id, start)
                self.worker.drop_draft(request.request_id)
                state.computed = request.num_prompt_tokens  # nothing more to run
                continue
            stop = min(end, last)  # position L - 1 needs t_L: D runs it
            if stop > start:
                chunks.append(HeadChunk(state.blocks, start,
                                        request.token_ids_range(start + 1, stop + 1),
                                        hidden[r.first + start - r.start:
                                               r.first + stop - r.start],
                                        request.num_prompt_tokens))
                self.proposer.prefill_tokens += stop - start
            if end > last:
                self.worker.ship_draft_state(
                    request.request_id, encode_hidden(hidden[r.first + last - r.start],
                                                      self.dtype))
            state.computed = end
        if chunks:
            self.runner.prefill(chunks)
