"""What the proposers with a model and a KV pool of their own share (draft_model.py,
hidden_proposer.py): per-request state keyed by request id (a reused id is another request),
the room a request leaves for drafts, giving blocks back, their stats and leak check."""
from __future__ import annotations

from typing import Any

from pd_cluster.engine.spec.backoff import Backoff
from pd_cluster.engine.spec.block_pool import BlockPool
from pd_cluster.request import Request


class PooledProposer:
    def __init__(self, k: int, runner: BlockPool, max_model_len: int, new_state: Any) -> None:
        self.k = k
        self.runner = runner
        self.max_model_len = max_model_len
        self.states: dict[str, Any] = {}
        self.backoff = Backoff()
        self._new_state = new_state  # request -> its state (with a ``blocks`` list)

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verification's outcome, for the backoff."""
        state = self.states.get(request.request_id)
        if state is not None and state.request is request:
            self.backoff.observe(state, num_drafts, num_accepted)

    def _room(self, request: Request) -> int:
        """Drafts this request may take: k, fewer near max_tokens or max_model_len."""
        if not request.is_decoding or request.is_finished:
            return 0
        room = self.max_model_len - request.num_tokens - 1
        params = request.sampling_params
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - request.num_output_tokens - 1)
        return min(self.k, room)

    def _state(self, request: Request) -> Any:
        state = self.states.get(request.request_id)
        if state is not None and state.request is not request:
            self.release([request.request_id])
            state = None
        if state is None:
            state = self.states[request.request_id] = self._new_state(request)
        return state

    def reserve(self, request: Request) -> tuple[int, ...]:
        """The pool's blocks for the prompt of a request whose KV comes from a prefill engine
        (the proposer's KV may come with it: draft_pd.py, mtp_pd.py), kept while it waits;
        () when the pool lacks them. Its state is marked ``receiving`` until it lands."""
        self.release([request.request_id])
        state = self._new_state(request)
        state.receiving = True
        if not self.runner.grow(state.blocks, request.num_prompt_tokens):
            return ()
        self.states[request.request_id] = state
        return tuple(state.blocks)

    def release(self, request_ids: list[str]) -> None:
        """Give back the blocks (and state) of requests that left (finished, aborted,
        preempted)."""
        for rid in request_ids:
            state = self.states.pop(rid, None)
            if state is not None:
                self.runner.release(state.blocks)

    def stats(self) -> dict[str, Any]:
        return {"spec_draft_kv_blocks_total": self.runner.num_blocks,
                "spec_draft_kv_blocks_free": self.runner.num_free_blocks}

    def check_no_leaks(self) -> None:
        """AssertionError unless no request holds the proposer's blocks and all are free."""
        if self.states or self.runner.num_free_blocks != self.runner.num_blocks:
            raise AssertionError(f"draft KV blocks held: {sorted(self.states)[:10]}, "
                                 f"{self.runner.num_blocks - self.runner.num_free_blocks} "
                                 f"blocks not free")
