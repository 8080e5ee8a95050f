"""A request inside one engine: its tokens, status and KV blocks."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from connectors.transfer_params import KVTransferParams, RecvKV
from pd_cluster.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated, KV arriving from a peer
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | tuple[int, ...] | None = None  # several: any of them ends the request
    arrival_time: float = field(default_factory=time.monotonic)
    # Connector instructions from the proxy: SendKV / RecvKV (connectors/transfer_params.py).
    kv_transfer_params: KVTransferParams | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    # With sampling_params.prompt_logprobs: entry i is prompt token i's top-k (None for i=0),
    # filled as prefill chunks run here; complete only if this engine computed the whole prompt.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first schedule
    num_preemptions: int = 0
    # The prompt's KV is computed here, whatever kv_transfer_params say (set after a KV
    # fallback or a preemption: the remote KV will not come again).
    prefill_locally: bool = False
    block_ids: list[int] = field(default_factory=list)  # KV cache group 0's table
    # Every group's table (kv_groups.py), group 0's first; [block_ids] with one group.
    group_block_ids: list[list[int]] = field(default_factory=list)
    # Chain hashes of the leading full blocks, computed once (block_manager.py): a full
    # block's tokens never change, and admission asks for them more than once.
    block_hashes: list[int] = field(default_factory=list, repr=False)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Seeded requests draw token i from a generator seeded by (seed, i): the result does not
    # depend on where earlier tokens were sampled (another engine, before a preemption).
    generator: torch.Generator | None = None
    # With sampling_params.structured_outputs: the matcher that masks this request's logits
    # (engine/structured/request_grammar.py).
    grammar: Any = None
    # Speculative decoding (engine/spec/): the tokens proposed for the next step (verified
    # there, never part of the output until accepted), and the proposer's per-request state.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_state: Any = None
    # When this engine appended its first output token (monotonic s), and how many output
    # tokens the request had before it (a resumed request arrives with some): its TPOT, as
    # the mixed steps keep it, counts from there.
    first_token_time: float | None = None
    first_token_index: int = 0

    def generator_for_next_token(self, device: torch.device) -> torch.Generator | None:
        return self.generator_for_token(device, self.num_output_tokens)

    def generator_for_token(self, device: torch.device, index: int) -> torch.Generator | None:
        """The generator that draws output token ``index`` (seeded by (seed, index)), or None
        for an unseeded request."""
        seed = self.sampling_params.seed
        if seed is None:
            return None
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device)
        mixed = (seed * 0x9E3779B97F4A7C15 + index) % (1 << 63)
        return self.generator.manual_seed(mixed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def mark_token_time(self, now: float) -> None:
        """Called as output tokens are appended here: the first one starts the TPOT clock."""
        if self.first_token_time is None:
            self.first_token_time = now
            self.first_token_index = len(self.output_token_ids) - 1

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without concatenating whole lists."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def kv_from_remote(self) -> bool:
        """The prompt's KV (beyond this engine's prefix-cache hits) comes from a producer."""
        return isinstance(self.kv_transfer_params, RecvKV) and not self.prefill_locally

    @property
    def is_decoding(self) -> bool:
        """Past its prompt (and any resumed output): each step computes one new token."""
        return bool(self.output_token_ids) and self.num_computed_tokens >= self.num_tokens - 1
