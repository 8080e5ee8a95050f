"""Worker half of the P/D connector (push, per layer) and its pair (connectors/factory.py).

Producer: after each attention layer, the request's new blocks of that layer are gathered
into one contiguous tensor and handed to the pipe without waiting, so layer i is on the wire
while layer i+1 computes. When the request finishes, a FIN carries the first sampled token;
the consumer's ACK (or the timeout) releases the producer's blocks.
Consumer: a receiver thread writes arriving layers into pre-allocated blocks (KVReceiver).
Decode-side prefix reuse (OFFER / HOLD, what the producer skips): pd_producer.py, whose
producer methods this worker mixes in.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import torch

from connectors.base import ConnectorPair, FinishedTransfers, KVConnectorBase_Worker
from connectors.config import KVTransferConfig
from connectors.draft_layers import DraftLayers
from connectors.hello import make_hello
from connectors.kv_receiver import KVReceiver
from connectors.granted_writes import Grants
from connectors.group_tables import grant_groups_valid
from connectors.layer_sender import LayerSender
from connectors.metadata import (
    AckHeader,
    FinHeader,
    FinishSpec,
    HoldHeader,
    KVConnectorMetadata,
    RenewHeader,
    SendSpec,
    decode_header,
    encode_header,
)
from connectors.pd_producer import PDProducer
from connectors.pd_roles import PDRoles
from connectors.pd_scheduler import PDConnectorScheduler
from connectors.pipes.base import PipeClosed, PipeError, create_pipe
from connectors.pipes.faulty_pipe import with_faults
from connectors.send_leases import SendLeases
from connectors.staged_writes import StagingRanges, grant_staging, release_staging
from connectors.tp_topology import Route, routes_for, split_endpoint
from connectors.window_shipping import layer_windows

logger = logging.getLogger(__name__)
# A fenced receive's blocks (kv_receiver.py) come back at the latest after this many transfer
# timeouts: a writer's FIN lost with its connection up (a write starts only within the grant's
# cutoff, half a timeout, and a copy takes milliseconds).
FENCE_TIMEOUTS = 4
_SKIP_ALL = 1 << 62  # "held" tokens after a NACK: the consumer wants nothing of the request


class PDConnectorWorker(PDRoles, PDProducer, DraftLayers, KVConnectorBase_Worker):
    def __init__(self, config: KVTransferConfig, engine_info: dict[str, Any]):
        self.config = config
        # Tensor parallelism: this rank's place; num_kv_heads in the hello is the model's total.
        self.tp_rank, self.tp_size = engine_info.get("tp_rank", 0), engine_info.get("tp_size", 1)
        self.block_size = engine_info["block_size"]
        self.layer_groups = engine_info.get("layer_groups")  # None: one table (group_tables)
        self.hello = make_hello(engine_info)
        # Each layer's sliding window: those layers ship only what decodes read.
        self.windows = layer_windows(self.hello["kv_specs"])
        self._routes: dict[str, list[tuple[str, Route]]] = {}  # consumer -> its ranks I feed
        # With a KV fault site's rate set (test-only, pd_cluster/faults.py) the pipe comes
        # wrapped (faulty_pipe.py), else as it is.
        self.pipe = with_faults(create_pipe(config.pipe, config.pipe_config),
                                engine_info.get("faults"))
        # Pipes that write into the consumer's blocks (nixl): granted_writes.py.
        self._in_place = self.writes_in_place = getattr(self.pipe, "writes_in_place", False)
        self.grants = Grants(config.kv_transfer_timeout / 2)
        self.draft_grants = Grants(config.kv_transfer_timeout / 2)  # draft_layers.py
        self.staging_ranges = StagingRanges()  # producer: staged_writes.py
        self.receiver = KVReceiver(engine_info["num_layers"], engine_info["block_size"],
                                   config.kv_transfer_timeout, config.max_staging_bytes,
                                   config.record_timings, self.windows,
                                   min(5.0, config.kv_transfer_timeout) if self._in_place else 0,
                                   FENCE_TIMEOUTS * config.kv_transfer_timeout)
        self.receiver.layer_groups = self.layer_groups
        if self._in_place:
            self.receiver.check_written = self.pipe.check_written
            self.receiver.copy_staged = getattr(self.pipe, "copy_staged", None)
        self._endpoint: str | None = None
        self._listening = False
        if config.is_consumer:
            self._listen()
        self._meta: KVConnectorMetadata | None = None
        self.sender = LayerSender(self.pipe, config.pipe_config.max_inflight_bytes,
                                  config.kv_transfer_timeout)
        self._peers: dict[str, str | None] = {}  # connected consumer -> its tag
        self._connecting: dict[str, threading.Lock] = {}
        self._peer_lock = threading.Lock()
        self._warned: set[str] = set()
        self._step_futures: list[tuple[str, str, Future]] = []  # (request id, peer, send)
        # Peers a send to failed: re-linked from scratch (a fresh connection, for NCCL a fresh
        # communicator) once this step's FINs went out, by the cluster's peer linker.
        self._broken: set[str] = set()
        self.leases = SendLeases(config.lease_seconds)
        self._next_renewal = 0.0
        self._renew_every = config.lease_seconds / 3  # shortened by a producer's shorter lease
        self._failed_sends: set[str] = set()
        # Producer, decode-side reuse: consumer's answers (receiver thread writes, bounded),
        # and on the engine thread: when each offer stops waiting, deferred layer sends, FINs
        # waiting for them.
        self._holds: OrderedDict[str, int] = OrderedDict()
        self._holds_lock = threading.Lock()
        self._offered: dict[str, float] = {}
        self._deferred: dict[str, list[tuple[int, SendSpec]]] = {}
        self._waiting_fins: dict[str, FinishSpec] = {}
        self.bytes_sent = 0
        # A draft model's layers after the target's (draft_layers.py): none until registered.
        self.num_target_layers, self.num_draft_layers = engine_info["num_layers"], 0
        self._draft_sent: set[str] = set()  # producer: requests whose draft layers went
        self._draft_dropped: set[str] = set()  # ... save where the consumer granted none
        self._draft_states: dict[str, bytes] = {}  # producer: what their FINs carry (mtp)
        self._draft_in_place = False  # consumer: its in-place pipe has the draft's layers
        self.draft_bytes_sent = 0
        self.num_send_timeouts = 0
        self.last_layer_times: OrderedDict[str, float] = OrderedDict()
        self._running = True
        self._thread = threading.Thread(target=self._recv_loop, name="kv-recv", daemon=True)
        self._thread.start()

    # ---- set-up (endpoint, set_role, holds: pd_roles.py) ----------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.receiver.kv_caches = kv_caches
        if self._in_place:
            self.pipe.register_kv_caches(kv_caches)
        if self.config.is_producer and kv_caches:
            self.sender.use_device(kv_caches[0].device)

    # ---- peers: the consumers this producer sends to ------------------------------------
    def connect_peer(self, peer: str, tag: str | None = None) -> None:
        """Handshake with a consumer: at launch, or when the cluster finds a new or restarted
        one; never on the forward path. ``tag`` names the consumer's incarnation: a peer
        known under another tag is connected afresh (a restarted engine may reuse its
        address). Raises HandshakeError/PipeError with the reason."""
        with self._peer_lock:
            lock = self._connecting.setdefault(peer, threading.Lock())
        with lock:  # one handshake per peer at a time: a second would replace the first
            if peer in self._peers and self._peers[peer] == tag:
                return
            ranks = split_endpoint(peer)  # one endpoint per consumer rank
            routes = [(ranks[r.dst_rank], r) for r in routes_for(
                self.tp_rank, self.tp_size, len(ranks), self.hello["num_kv_heads"])]
            for endpoint, _ in routes:
                self.pipe.connect(endpoint, dict(self.hello))
            with self._peer_lock:  # swapped whole: the engine thread reads it without a lock
                self._routes = {**self._routes, peer: routes}
                self._peers = {**self._peers, peer: tag}
                self._warned.discard(peer)

    def disconnect_peer(self, peer: str) -> None:
        """Forget a consumer that is gone for good (a restarted one has a new endpoint)."""
        with self._peer_lock:
            self._peers = {k: v for k, v in self._peers.items() if k != peer}
            routes = self._routes.get(peer, [])
            self._routes = {k: v for k, v in self._routes.items() if k != peer}
        for endpoint, _ in routes:
            self.pipe.disconnect(endpoint)

    def peers(self) -> dict[str, str | None]:
        """Connected consumers (address -> tag)."""
        return dict(self._peers)

    def _usable(self, peer: str) -> bool:
        if peer in self._peers:
            return True
        if peer not in self._warned:  # a handshake here would stall the whole batch
            self._warned.add(peer)
            logger.error("KV for %s not sent: no handshake with it yet (the cluster connects "
                         "consumers at launch and when they (re)start)", peer)
        return False

    # ---- per step ------------------------------------------------------------------------
    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._meta = metadata
        for spec in metadata.recvs:
            self._ack(self.receiver.register(spec))
        for rid in metadata.cancels:
            self._ack(self.receiver.cancel(rid))
        release_staging(self.pipe, metadata.cancels)
        self._send_holds()
        for spec in metadata.sends:
            if spec.request_id not in self._offered:
                self._offer(spec)
        self._flush_deferred()
        for fin in metadata.finishes:
            if fin.first_token is None:  # aborted: its deferred layers are of no use
                self._deferred.pop(fin.request_id, None)
            self._waiting_fins[fin.request_id] = fin
        self._send_ready_fins()
        for peer in self._broken:  # after the FINs: they tell the consumer to recompute
            logger.warning("dropping the link to %s after a failed send; it is re-linked "
                           "(a fresh connection / communicator) in the background", peer)
            self.disconnect_peer(peer)
        self._broken.clear()

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def start_load_kv(self, kv_caches: list[torch.Tensor]) -> None:
        pass  # push design: the receiver thread writes as layers arrive

    def wait_for_layer_load(self, layer: int) -> None:
        pass  # requests run only after their whole prompt KV arrived

    def get_finished(self) -> FinishedTransfers:
        if self._deferred or self._waiting_fins:  # every engine step asks: send what can go
            self._flush_deferred()
            self._send_ready_fins()
        self.receiver.lose_peers(self.pipe.take_lost_peers())
        recving = self.receiver.take_finished()
        release_staging(self.pipe, recving)  # every end but a cancel comes through here
        self._ack(self.receiver.take_nacks())  # gave up: the producers free at once
        return FinishedTransfers(self.leases.take_done(), recving,
                                 frozenset(self.receiver.take_unfenced()))

    # ---- receiver thread -----------------------------------------------------------------
    def _recv_loop(self) -> None:
        while self._running:
            try:
                msg = self.pipe.recv_tensor(timeout=0.05)
            except PipeClosed:
                return
            except PipeError as e:  # one receive failed: its transfer fails closed or times out
                if self._running:
                    logger.warning("KV pipe receive failed: %s", e)
                continue
            self._renew_leases()
            if msg is None:
                continue
            peer, raw, tensor = msg
            try:
                header = decode_header(raw)
            except ValueError as e:
                logger.warning("dropped malformed KV message from %s: %s", peer, e)
                continue
            if isinstance(header, AckHeader):
                if not header.ok:  # before the FIN: the consumer wants none of its KV
                    self._record_hold(header.request_id, _SKIP_ALL)
                self.leases.release(header.request_id, header.ok)
            elif isinstance(header, HoldHeader):
                if self._in_place and grant_groups_valid(  # no grant: the writes fail
                        header.block_ids, header.group_block_ids, header.layer_groups):
                    # before the hold: the engine thread writes once it sees it
                    self.grants.record(peer, header.request_id,
                                       header.num_tokens // self.block_size, header.block_ids,
                                       header.group_block_ids, header.layer_groups)
                    self.staging_ranges.record(peer, header.request_id, header.staging)
                    if header.draft_block_ids:  # a draft model's blocks (draft_layers.py)
                        self.draft_grants.record(peer, header.request_id, 0,
                                                 header.draft_block_ids)
                self._record_hold(header.request_id, header.num_tokens)
            elif isinstance(header, RenewHeader):
                self.leases.renew(list(header.request_ids))
            else:
                if isinstance(header, FinHeader) and header.lease_seconds > 0:
                    self._renew_every = min(self._renew_every, header.lease_seconds / 3)
                self._ack(self.receiver.on_message(header, tensor, peer))
                self._send_holds()

    def _send_holds(self) -> None:
        """Consumer: answer producers' offers with the prompt tokens held here."""
        for peer, rid, num_tokens, granted, draft, groups in self.receiver.take_holds():
            hold = HoldHeader(rid, num_tokens, granted if self._in_place else (),
                              draft if self._in_place else (), groups if self._in_place else (),
                              tuple(self.layer_groups or ()) if self._in_place and groups
                              else (), grant_staging(self.pipe, self.receiver, rid, granted,
                                                     groups) if self._in_place else ())
            try:
                self.pipe.send_tensor(peer, encode_header(hold), None)
            except PipeError as e:
                logger.warning("HOLD for %s not sent: %s", rid, e)

    def _renew_leases(self) -> None:
        """Consumer: tell each producer which of its requests are still being received."""
        now = time.monotonic()
        if now < self._next_renewal:
            return
        self._next_renewal = now + self._renew_every
        for peer, rids in self.receiver.receiving_by_peer().items():
            try:
                self.pipe.send_tensor(peer, encode_header(RenewHeader(tuple(rids))), None)
            except PipeError as e:
                logger.warning("lease renewal to %s not sent: %s", peer, e)

    def _ack(self, ended: list[tuple[str, str, bool]]) -> None:
        """Tell the producers at once that they may free the request's blocks (ok=False: the
        request ended here before its KV was used)."""
        for peer, rid, ok in ended:
            try:
                self.pipe.send_tensor(peer, encode_header(AckHeader(rid, ok)), None)
            except PipeError as e:
                logger.warning("ACK for %s not sent: %s", rid, e)

    def stats(self) -> dict[str, Any]:
        pipe = self.pipe.stats()
        return {"kv_bytes_sent": self.bytes_sent, "kv_bytes_received": self.receiver.bytes_received,
                "kv_send_seconds": self.leases.send_seconds,
                "kv_recv_seconds": self.receiver.recv_seconds,
                "kv_send_timeouts": self.num_send_timeouts + self.leases.num_expired,
                "kv_dropped_messages": self.receiver.num_dropped,
                "kv_digest_failures": self.receiver.num_failed_closed,
                "kv_refused_messages": self.receiver.num_refused + pipe.get("refused", 0),
                "kv_auth_failures": pipe.get("auth_failures", 0),
                "kv_integrity_failures": pipe.get("integrity_failures", 0),
                "kv_prefix_hit_tokens": self.receiver.prefix_hit_tokens,
                "kv_bytes_skipped": self.receiver.bytes_skipped,
                # of kv_bytes_sent / _received: a draft model's layers (draft_layers.py)
                "kv_draft_bytes_sent": self.draft_bytes_sent,
                "kv_draft_bytes_received": self.receiver.draft_bytes_received,
                # Words, not series: the /metrics label pipe= of the kv_* series above, and
                # `pd-cluster status`'s per-link column (every link of an engine uses its pipe).
                "kv_pipe": self._pipe_label(),
                "kv_links": {peer: self._link_pipe(peer) for peer in self._peers},
                **getattr(self.pipe, "fault_counters", {})}  # test-only (faulty_pipe.py)

    def _link_pipe(self, peer: str) -> str:
        """The pipe a link uses: the configured one, or with pipe auto what its handshake
        chose for the consumer's ranks ("shm", "zmq", "shm+zmq" if they differ)."""
        link = getattr(self.pipe, "link", None)
        if link is None:
            return self.config.pipe
        return "+".join(sorted({link(ep)[0] for ep, _ in self._routes.get(peer, [])})) or "zmq"

    def _pipe_label(self) -> str:
        """/metrics' pipe= label: with pipe auto, the pipes this engine's links chose."""
        if getattr(self.pipe, "link", None) is None or not self._peers:
            return self.config.pipe
        return "+".join(sorted({p for peer in self._peers
                                for p in self._link_pipe(peer).split("+")}))

    def close(self) -> None:
        self._running = False
        self.sender.close()
        self.pipe.close()
        self._thread.join(timeout=2)


def make_pd(config: KVTransferConfig, engine_info: dict[str, Any]) -> ConnectorPair:
    """The "pd" connector's pair (connectors/factory.py names it)."""
    worker = PDConnectorWorker(config, engine_info)
    windows = layer_windows(make_hello(engine_info)["kv_specs"])
    return (PDConnectorScheduler(engine_info["block_size"], windows, worker.writes_in_place),
            worker)
