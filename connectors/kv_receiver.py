"""Consumer state of the P/D connector: writes arriving layers into the request's blocks.

Messages may arrive before the scheduler has registered the request (the producer can be
faster than the consumer's next step); those wait in a bounded staging area. With tensor
parallelism several producer ranks may feed this rank, each a slice of its heads: a request
is in when every (layer, K/V, block, head) was written and every feeder's FIN arrived.
Blocks this engine's prefix cache already holds (RecvSpec.num_cached_tokens) count as written
from the start and are never written over: producers are told to skip them (a HoldHeader
answering their OfferHeader), and any that arrive anyway are dropped.
A receive that ends without its KV (timed out, failed closed, cancelled) while a producer that
writes in place (shm, nixl) holds a grant of its blocks and has not sent its FIN is *fenced*:
that producer may be stalled inside a write that lands later. The scheduler keeps such blocks
out of use until the fence lifts (take_unfenced): the producer's late FIN, its connection lost
(a dead process writes nothing), or, past ``fence_limit`` seconds (a FIN that was lost),
a logged give-up.
A draft model's layers (layers num_layers.., into RecvSpec.draft_block_ids: draft_layers.py)
count too when the FIN says they come; every one of their blocks is written (no prefix cache).
An MTP layer's also, and its FIN carries the hidden state D's first proposal reads (its length
checked here: a wrong one fails the transfer closed). How a message lands in the blocks:
kv_landing.py.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

import numpy as np
import torch

from connectors.granted_writes import Checker
from connectors.group_tables import layer_table
from connectors.kv_landing import KVLanding, Receiving
from connectors.kv_staging import Staging
from connectors.metadata import FinHeader, KVLayerHeader, KVWrittenHeader, OfferHeader, RecvSpec
from connectors.window_shipping import first_shipped_token

logger = logging.getLogger(__name__)
Ack = tuple[str, str, bool]  # (producer peer, request id, ok)
# (producer peer, request id, prompt tokens held here, the blocks granted after them, the
# draft model's blocks granted: draft_layers.py, each KV cache group's granted: group_tables.py)
Hold = tuple[str, str, int, tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]


class KVReceiver(KVLanding):
    def __init__(self, num_layers: int, block_size: int, timeout: float, max_staging_bytes: int,
                 record_timings: bool = False, windows: tuple[int | None, ...] = (),
                 fin_grace: float = 0.0, fence_limit: float = 120.0):
        self.num_layers, self.block_size = num_layers, block_size
        # Sliding layers' windows: their blocks before it are not shipped (window_shipping.py)
        self.windows = windows
        # Pipes that write in place (nixl): each write's notification checked by the pipe
        # (granted_writes.check_written), and layers still missing at the FIN are waited for
        # ``fin_grace`` seconds (notifications and FINs travel apart); else 0: failed at once.
        self.check_written: Checker | None = None
        self.copy_staged = None  # the pipe's, for writes into its staging slab (nixl)
        self.fin_grace = fin_grace
        self.timeout, self.max_staging_bytes = timeout, max_staging_bytes
        self.kv_caches: list[torch.Tensor] = []  # the target's layers, then a draft's
        self.num_draft_layers = 0  # layers num_layers.. of kv_caches: a draft model's
        self.layer_groups: list[int] | None = None  # each layer's KV cache group (None: one)
        # the state that came with each landed draft KV (b"": none), taken once, bounded
        self._draft_landed: OrderedDict[str, bytes] = OrderedDict()
        self.draft_state_bytes = 0  # what a FIN with draft KV carries (mtp's hidden state)
        self.draft_bytes_received = 0
        self._lock = threading.Lock()
        # Staged copies into a request's blocks running now (the receiver thread's, outside
        # the lock): a receive that ends waits for its copy before its blocks are freed.
        self._copying: set[str] = set()
        self._copied = threading.Condition(self._lock)
        self._active: dict[str, Receiving] = {}
        self._staging = Staging(max_staging_bytes)  # early arrivals, bounded per peer
        # Requests whose KV failed before they were registered: (why, peer), bounded.
        self._poisoned: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._done: dict[str, int | None] = {}
        self._cancelled: OrderedDict[str, float] = OrderedDict()  # ended here, bounded
        self._nacks: list[tuple[str, str, bool]] = []  # gave up: tell those producers
        self._holds: list[Hold] = []  # answers to producers' offers, not yet sent
        # Wall-clock arrival of each request's first layer, for overlap measurements (bounded;
        # only with record_timings).
        self.record_timings = record_timings
        self.first_layer_times: OrderedDict[str, float] = OrderedDict()
        self.bytes_received = 0
        self.prefix_hit_tokens = 0  # prompt tokens served by this engine's own prefix cache
        self.bytes_skipped = 0  # payload bytes that arrived for blocks held here (dropped)
        self.recv_seconds = 0.0  # first message to complete, summed over requests
        self.num_dropped = 0
        self.num_failed_closed = 0  # transfers failed closed: recomputed, never decoded on
        self.num_refused = 0  # messages refused by a per-peer bound or for unknown requests
        # Ended receives whose in-place writers may still write: request -> (them, since).
        self._fences: dict[str, tuple[set[str], float]] = {}
        self._unfenced: set[str] = set()  # ended receives no producer can write into now
        self.fence_limit = fence_limit
        self.num_fences_expired = 0

    # ---- scheduler-driven ----------------------------------------------------------------
    def register(self, spec: RecvSpec) -> list[Ack]:
        """Start receiving; returns what to ACK if staged messages completed it."""
        blocks = -(-spec.num_prompt_tokens // self.block_size)
        state = Receiving(spec, torch.tensor(spec.block_ids[:blocks], dtype=torch.long),
                           time.monotonic() + self.timeout, self._unwritten(blocks))
        state.written[:self.num_layers, :, :spec.num_cached_tokens // self.block_size] = True
        state.group_index = [torch.tensor(ids[:blocks], dtype=torch.long)
                             for ids in spec.group_block_ids]
        if self.num_draft_layers and len(spec.draft_block_ids) >= blocks:
            state.draft_index = torch.tensor(spec.draft_block_ids[:blocks], dtype=torch.long)
        else:  # no draft KV taken: its layers are not waited for (and dropped if they come)
            state.written[self.num_layers:] = True
        for layer, window in enumerate(self.windows):  # not shipped: nothing to wait for
            first = first_shipped_token(spec.num_prompt_tokens, window, self.block_size)
            state.written[layer, :, :first // self.block_size] = True
        with self._lock:
            if spec.request_id in self._active:
                logger.warning("duplicate receive registration for %s dropped", spec.request_id)
                return []
            self._active[spec.request_id] = state
            self.prefix_hit_tokens += spec.num_cached_tokens
            staged = self._staging.pop(spec.request_id)
            acks: list[Ack] = []
            poisoned = self._poisoned.pop(spec.request_id, None)
            if poisoned is not None:
                peers = {p for _, _, p in staged}
                acks = self._fail_closed(state, poisoned[0], poisoned[1], peers)
            for header, tensor, peer in staged:
                if spec.request_id in self._active:
                    acks += self._apply(state, header, tensor, peer)
            return acks

    def cancel(self, request_id: str) -> list[Ack]:
        """Stop receiving (the request ended here). Returns a NACK for the producer if we
        know it, so it frees its blocks now; a FIN arriving later is answered the same way."""
        with self._lock:
            state = self._active.pop(request_id, None)
            self._done.pop(request_id, None)
            staged_peers = self._staging.peers(request_id)
            self._staging.pop(request_id)
            self._cancelled[request_id] = time.monotonic()
            while len(self._cancelled) > 4096:
                self._cancelled.popitem(last=False)
            peers = state.peers if state else staged_peers
            self._wait_copies((request_id,))
            self._ended(request_id, state)
            return [(peer, request_id, False) for peer in sorted(peers)]

    def staging_bytes(self) -> int:
        return self._staging.nbytes

    def num_receiving(self) -> int:
        return len(self._active)

    def is_receiving(self, request_id: str) -> bool:
        return request_id in self._active

    def take_finished(self) -> dict[str, int | None]:
        """Completed receives (first token) and expired ones (None: fall back)."""
        now = time.monotonic()
        with self._lock:
            for rid, state in list(self._active.items()):
                if now > state.deadline:
                    logger.warning("KV for %s incomplete after %.1fs: falling back", rid,
                                   self.timeout)
                    del self._active[rid]
                    self._done[rid] = None
                    self._cancelled[rid] = now  # a late FIN is NACKed at once
                    # the producers may free their blocks now
                    self._nacks += [(peer, rid, False) for peer in sorted(state.peers)]
                    self._ended(rid, state)
            self._wait_copies(self._done)
            self._expire_fences(now)
            for rid in self._staging.expired(now, self.timeout):
                # never claimed: an unknown request (or one that ended before it was staged)
                n = len(self._staging.pop(rid))
                self.num_refused += n
                logger.warning("refused %d KV messages for %s: no such request here", n,
                               rid[:80])
            done, self._done = self._done, {}
            return done

    def take_holds(self) -> list[Hold]:
        """Answers to producers' offers (what to skip), since the last call."""
        with self._lock:
            holds, self._holds = self._holds, []
            return holds

    def take_draft_landed(self, request_id: str) -> bytes | None:
        """The state that came with the request's draft KV (b"" for a draft model), None when
        its draft KV did not land with its target KV (once per request)."""
        with self._lock:
            return self._draft_landed.pop(request_id, None)

    def take_nacks(self) -> list[tuple[str, str, bool]]:
        """(peer, request id, False) for receives given up since the last call."""
        with self._lock:
            nacks, self._nacks = self._nacks, []
            return nacks

    def take_unfenced(self) -> set[str]:
        """Ended receives (since the last call) whose blocks no producer can write into."""
        with self._lock:
            unfenced, self._unfenced = self._unfenced, set()
            return unfenced

    @property
    def num_fenced(self) -> int:
        return len(self._fences)

    def lose_peers(self, peers: list[str]) -> None:
        """Producers whose connection is gone: a dead process writes nothing more."""
        if not peers:
            return
        with self._lock:
            for state in self._active.values():
                state.writers.difference_update(peers)
            for rid in list(self._fences):
                for peer in peers:
                    self._writer_done(rid, peer)

    def receiving_by_peer(self) -> dict[str, list[str]]:
        """Requests still being received, per producer (to renew their leases)."""
        with self._lock:
            out: dict[str, list[str]] = {}
            for rid, state in self._active.items():
                for peer in state.peers:
                    out.setdefault(peer, []).append(rid)
            return out

    # ---- receiver-thread-driven ----------------------------------------------------------
    def on_message(self, header: KVLayerHeader | FinHeader, tensor: torch.Tensor | None,
                   peer: str) -> list[Ack]:
        """Apply or stage one message; returns what to ACK when the request ended. Its bytes
        passed the pipe's integrity check (pipes/integrity.py); a message that failed it
        never comes, and the FIN then fails the transfer closed (a layer missing)."""
        rid = header.request_id
        if isinstance(header, KVWrittenHeader) and self.check_written is not None:
            checked = self._check_unlocked(header, peer)
            if checked is not None:
                with self._lock:
                    state = self._active.get(rid)
                    if state is checked[0]:  # still the request whose blocks were checked
                        return self._apply(state, header, tensor, peer, checked[1])
                return []  # it ended while its blocks were checked: nothing to mark
        with self._lock:
            state = self._active.get(rid)
            if state is not None:
                return self._apply(state, header, tensor, peer)
            if isinstance(header, FinHeader):
                self._writer_done(rid, peer)
            if rid in self._cancelled:
                # NACK a FIN, and an offer too: the producer then sends nothing for it.
                return [(peer, rid, False)] \
                    if isinstance(header, (FinHeader, OfferHeader)) else []
            if isinstance(header, KVLayerHeader) and tensor is None:
                self._poisoned[rid] = ("no payload", peer)  # fails it when it is registered
                while len(self._poisoned) > 4096:
                    self._poisoned.popitem(last=False)
                return []
            refused = self._staging.add(rid, (header, tensor, peer))
            if refused is not None:
                self.num_refused += 1
                logger.warning("staging full (%s): refused %s for %s", refused,
                               type(header).__name__, rid[:80])
            return []

    # ---- internals (lock held) -----------------------------------------------------------
    def _apply(self, state: Receiving, header: KVLayerHeader | FinHeader | OfferHeader,
               tensor: torch.Tensor | None, peer: str,
               checked: int | ValueError | None = None) -> list[Ack]:
        rid = state.spec.request_id
        state.peers.add(peer)
        if isinstance(header, OfferHeader):
            held = state.spec.num_cached_tokens // self.block_size
            draft = state.spec.draft_block_ids[:len(state.block_index)] \
                if state.draft_index is not None else ()
            n = len(state.block_index)
            self._holds.append((peer, rid, state.spec.num_cached_tokens,
                                state.spec.block_ids[held:n], draft,
                                tuple(ids[held:n] for ids in state.spec.group_block_ids)))
            if self.check_written is not None:  # granted to write in place
                state.writers.add(peer)
            return []
        state.first_arrival = state.first_arrival or time.monotonic()
        if isinstance(header, FinHeader):
            state.fins.append(header)
            state.writers.discard(peer)  # its writes all went before its FIN
            if header.first_token is None:  # a producer aborted: fall back now
                del self._active[rid]
                self._done[rid] = None
                self._cancelled[rid] = time.monotonic()  # the other feeders' FINs: NACKed
                self._ended(rid, state)
                return [(p, rid, False) for p in sorted(state.peers - {peer})]
            if len(state.fins) >= state.fins[0].num_fins and not all(
                    f.draft for f in state.fins):  # no draft KV comes: D runs its prefill
                state.written[self.num_layers:] = True
                state.draft_index = None
            elif header.draft and state.draft_index is not None \
                    and len(header.draft_state) != self.draft_state_bytes:
                return self._fail_closed(state, f"draft state of {len(header.draft_state)} "
                                         f"bytes, not {self.draft_state_bytes}", peer, {peer})
        elif isinstance(header, KVWrittenHeader):
            try:
                self._mark_written(state, header, peer, checked)
            except ValueError as e:
                return self._fail_closed(state, f"layer {header.layer}: {e}", peer, {peer})
        elif header.layer >= self.num_layers:  # a draft model's layer: all its blocks
            try:
                self._write_draft_layer(state, header, tensor)
            except ValueError as e:
                return self._fail_closed(state, f"draft layer {header.layer}: {e}", peer, {peer})
        else:
            try:
                header, tensor = self._skip_held(state, header, tensor)
                if header is not None:
                    self._write_layer(state, header, tensor, layer_table(
                        state.block_index, state.group_index, self.layer_groups, header.layer))
            except ValueError as e:  # e.g. blocks the request does not own
                return self._fail_closed(state, f"layer {header.layer}: {e}", peer, {peer})
        if state.fins and len(state.fins) >= state.fins[0].num_fins and not state.written.all():
            if self.fin_grace > 0:  # written in place: their notifications may still come
                state.deadline = min(state.deadline, time.monotonic() + self.fin_grace)
                return []
            return self._fail_closed(state, "layers missing at the FIN", peer, {peer})
        if (state.fins and len(state.fins) >= state.fins[0].num_fins
                and state.written.all()):
            del self._active[rid]
            self._done[rid] = state.fins[0].first_token
            self._ended(rid, state)
            if state.draft_index is not None:
                landed = state.fins[0].draft_state
                self._draft_landed[rid] = landed
                self.draft_bytes_received += len(landed)
                self.bytes_received += len(landed)
                while len(self._draft_landed) > 4096:  # requests that ended before decoding
                    self._draft_landed.popitem(last=False)
            self.recv_seconds += time.monotonic() - state.first_arrival
            return [(p, rid, True) for p in sorted(state.peers)]
        return []

    def _ended(self, rid: str, state: Receiving | None) -> None:
        """The receive of ``rid`` ended: fenced while an in-place writer may still write."""
        if rid in self._fences:
            return  # an earlier end's fence: it lifts by itself
        if state is not None and state.writers:
            self._fences[rid] = (set(state.writers), time.monotonic())
        else:
            self._unfenced.add(rid)

    def _writer_done(self, rid: str, peer: str) -> None:
        fence = self._fences.get(rid)
        if fence is None:
            return
        fence[0].discard(peer)
        if not fence[0]:
            del self._fences[rid]
            self._unfenced.add(rid)

    def _expire_fences(self, now: float) -> None:
        for rid, (writers, since) in list(self._fences.items()):
            if now - since > self.fence_limit:
                logger.warning("KV blocks of %s released after %.0fs though %s may still "
                               "write into them (no FIN, connection up: a FIN lost, or a "
                               "producer stalled that long)", rid[:80], now - since,
                               sorted(writers))
                del self._fences[rid]
                self._unfenced.add(rid)
                self.num_fences_expired += 1

    def _unwritten(self, blocks: int) -> np.ndarray:
        """bool [layers, parts, blocks, heads], False where a layer's cache has something to
        receive (layers may differ in parts and heads: what they lack counts as written)."""
        caches = self.kv_caches or [torch.empty(2, 0, 0, 1, 0)] * self.num_layers
        parts, heads = max(c.shape[0] for c in caches), max(c.shape[3] for c in caches)
        written = np.ones((len(caches), parts, blocks, heads), dtype=bool)
        for layer, cache in enumerate(caches):
            written[layer, :cache.shape[0], :, :cache.shape[3]] = False
        return written

    def _fail_closed(self, state: Receiving, why: str, peer: str, peers: set[str]
                     ) -> list[Ack]:
        """The request's KV cannot be trusted: it is recomputed here (as after a timeout),
        never decoded on; its producers are told to free their blocks."""
        rid = state.spec.request_id
        del self._active[rid]
        self._done[rid] = None
        self._cancelled[rid] = time.monotonic()  # what still comes for it is NACKed/ignored
        while len(self._cancelled) > 4096:
            self._cancelled.popitem(last=False)
        self.num_failed_closed += 1
        self._ended(rid, state)
        logger.warning("KV for %s from %s failed closed (%s): recomputing", rid[:80],
                       peer[:120], why)
        return [(p, rid, False) for p in sorted(state.peers | peers)]
