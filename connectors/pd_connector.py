"""Worker half of the P/D connector (push, per layer) and its registration.

Producer: after each attention layer, the request's new blocks of that layer are gathered
into one contiguous tensor and handed to the pipe without waiting, so layer i is on the wire
while layer i+1 computes. When the request finishes, a FIN carries the first sampled token;
the consumer's ACK (or the timeout) releases the producer's blocks.
Consumer: a receiver thread writes arriving layers into pre-allocated blocks (KVReceiver).

Decode-side prefix reuse: when the producer first schedules a request it sends an OFFER; the
consumer answers (as soon as it admitted the request) with a HOLD naming the prompt tokens its
own prefix cache covers, and the producer ships only the blocks after them. Layers computed
before the answer came are deferred (the producer's blocks stay pinned until the consumer's
ACK, so their KV is still there) and sent when it comes, or in full after ``_OFFER_WAIT`` of
the transfer timeout; the consumer drops any block it holds, so a late answer costs bytes,
never correctness. The FIN goes after the request's deferred layers.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, wait
from typing import Any

import torch

from connectors.base import FinishedTransfers, KVConnectorBase_Worker
from connectors.config import KVTransferConfig
from connectors.factory import ConnectorPair, register_connector
from connectors.kv_receiver import KVReceiver
from connectors.layer_sender import LayerSender
from connectors.metadata import (AckHeader, FinHeader, FinishSpec, HoldHeader,
                                 KVConnectorMetadata, OfferHeader, RenewHeader, SendSpec,
                                 decode_header, encode_header)
from connectors.pd_scheduler import PDConnectorScheduler
from connectors.hello import hello_mismatch, make_hello
from connectors.send_leases import SendLeases
from connectors.tp_topology import Route, num_feeders, routes_for, split_endpoint
from connectors.pipes.base import PipeError, create_pipe

logger = logging.getLogger(__name__)
_OFFER_WAIT = 0.5  # of kv_transfer_timeout: how long layers wait for the consumer's HOLD
_SKIP_ALL = 1 << 62  # "held" tokens after a NACK: the consumer wants nothing of the request


class PDConnectorWorker(KVConnectorBase_Worker):
    def __init__(self, config: KVTransferConfig, engine_info: dict[str, Any]):
        self.config = config
        # Tensor parallelism: this rank's place; num_kv_heads in the hello is the model's total.
        self.tp_rank, self.tp_size = engine_info.get("tp_rank", 0), engine_info.get("tp_size", 1)
        self.block_size = engine_info["block_size"]
        self.hello = make_hello(engine_info)
        self._routes: dict[str, list[tuple[str, Route]]] = {}  # consumer -> its ranks I feed
        self.pipe = create_pipe(config.pipe, config.pipe_config)
        self.receiver = KVReceiver(engine_info["num_layers"], engine_info["block_size"],
                                   config.kv_transfer_timeout, config.max_staging_bytes,
                                   config.record_timings)
        self._endpoint = None
        if config.is_consumer:
            self.pipe.set_handshake_validator(self._validate_hello, info=self.hello)
            self._endpoint = self.pipe.listen()
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
        self.num_send_timeouts = 0
        self.last_layer_times: OrderedDict[str, float] = OrderedDict()
        self._running = True
        self._thread = threading.Thread(target=self._recv_loop, name="kv-recv", daemon=True)
        self._thread.start()

    # ---- set-up --------------------------------------------------------------------------
    def endpoint(self) -> str | None:
        return self._endpoint

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.receiver.kv_caches = kv_caches
        if self.config.is_producer and kv_caches:
            self.sender.use_device(kv_caches[0].device)

    def _validate_hello(self, hello: dict) -> str | None:
        return hello_mismatch(self.hello, hello)

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

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        if self._meta is None or not self._meta.sends:
            return
        if self._deferred:
            self._flush_deferred()
        for spec in self._meta.sends:
            if spec.request_id in self._failed_sends or not self._usable(spec.peer):
                self._failed_sends.add(spec.request_id)
                continue
            held = self._held_tokens(spec.request_id)
            if held is None:  # no answer yet: send once the consumer said what it holds
                self._deferred.setdefault(spec.request_id, []).append((layer, spec))
                continue
            self._send_unheld(spec, layer, kv_layer, held)
        if layer == len(self.kv_caches) - 1 and self.config.record_timings:
            now = time.time()
            for spec in self._meta.sends:
                self.last_layer_times[spec.request_id] = now
            while len(self.last_layer_times) > 4096:
                self.last_layer_times.popitem(last=False)

    def _send_unheld(self, spec: SendSpec, layer: int, kv_layer: torch.Tensor,
                     held: int) -> None:
        """Send ``layer`` of the spec's blocks the consumer's cache does not hold."""
        skip = max(0, held // self.block_size - spec.first_block)
        if skip >= len(spec.block_ids):
            return
        if skip:
            spec = dataclasses.replace(spec, block_ids=spec.block_ids[skip:],
                                       first_block=spec.first_block + skip)
        for endpoint, r in self._routes.get(spec.peer, []):
            if not self._send_layer(spec, layer, endpoint,
                                    self.sender.layer_messages(spec, layer, kv_layer,
                                                               (r.src, r.count, r.dst))):
                break

    # ---- producer: what the consumer holds (decode-side prefix reuse) --------------------
    def _offer(self, spec: SendSpec) -> None:
        """Ask the consumer which prompt tokens it holds (answered by a HoldHeader)."""
        self._offered[spec.request_id] = (time.monotonic()
                                          + _OFFER_WAIT * self.config.kv_transfer_timeout)
        if not self._usable(spec.peer):
            return
        for endpoint, _ in self._routes.get(spec.peer, []):
            try:
                self.sender.send(endpoint, encode_header(OfferHeader(spec.request_id)), None)
            except PipeError as e:
                logger.error("offer of %s failed: %s", spec.request_id, e)
                self._failed_sends.add(spec.request_id)
                self._broken.add(spec.peer)
                return

    def _held_tokens(self, request_id: str) -> int | None:
        """Prompt tokens the consumer holds; None while its answer may still come (after the
        wait, 0: everything is sent and the consumer drops what it holds)."""
        with self._holds_lock:
            held = self._holds.get(request_id)
        if held is not None:
            return held
        deadline = self._offered.get(request_id)
        return 0 if deadline is None or time.monotonic() > deadline else None

    def _send_ready_fins(self) -> None:
        """A FIN goes once its layers went out and their sends settled (a failed one turns
        it into "recompute"), in FIN order."""
        ready = [f for rid, f in self._waiting_fins.items() if rid not in self._deferred]
        if ready:
            self._settle_sends()
            for fin in ready:
                del self._waiting_fins[fin.request_id]
                self._send_fin(fin)

    def _flush_deferred(self) -> None:
        """Send deferred layers whose consumer answered (or stopped being waited for)."""
        for rid in list(self._deferred):
            held = self._held_tokens(rid)
            if held is None:
                continue
            for layer, spec in self._deferred.pop(rid):
                if rid not in self._failed_sends:
                    self._send_unheld(spec, layer, self.kv_caches[layer], held)

    def _send_layer(self, spec: Any, layer: int, endpoint: str, msgs: list) -> bool:
        for msg in msgs:
            try:
                future = self.sender.send_layer(endpoint, msg)
            except PipeError as e:
                logger.error("send of %s layer %d failed: %s", spec.request_id, layer, e)
                self._failed_sends.add(spec.request_id)
                self._broken.add(spec.peer)
                return False
            self._step_futures.append((spec.request_id, spec.peer, future))
            self.leases.sending(spec.request_id)
            self.bytes_sent += msg.tensor.nbytes
        return True

    def wait_for_save(self) -> None:
        """Every payload of this step released by the pipe: zero-copy views point into the
        cache, which the next step may write. A send that failed, or is still pending after
        the timeout, fails its request: the FIN tells the consumer to recompute at once."""
        if self._deferred:  # answers that came during the forward: send before waiting
            self._flush_deferred()
        self._settle_sends()

    def _settle_sends(self) -> None:
        if not self._step_futures:
            return
        done, pending = wait([f for _, _, f in self._step_futures],
                             timeout=self.config.kv_transfer_timeout)
        bad = [(rid, peer) for rid, peer, f in self._step_futures
               if f in pending or f.cancelled() or f.exception() is not None]
        if pending:
            self.num_send_timeouts += 1
            logger.error("%d KV sends still pending after %.1fs", len(pending),
                         self.config.kv_transfer_timeout)
        elif bad:
            logger.error("KV sends of %s failed: %s", sorted({r for r, _ in bad}), next(
                f.exception() for _, _, f in self._step_futures if f in done
                and not f.cancelled() and f.exception() is not None))
        self._failed_sends.update(rid for rid, _ in bad)
        self._broken.update(peer for _, peer in bad)
        self._step_futures = []

    def _send_fin(self, fin: Any) -> None:
        ok = fin.request_id not in self._failed_sends and fin.first_token is not None
        self._failed_sends.discard(fin.request_id)
        self._offered.pop(fin.request_id, None)
        with self._holds_lock:
            self._holds.pop(fin.request_id, None)
        routes = self._routes.get(fin.peer, []) if self._usable(fin.peer) else []
        if not routes:  # no consumer can answer (or this rank fed none of its ranks): free now
            self.leases.drop(fin.request_id)
            return
        if ok:  # held before the FINs leave: the answers can come back before send returns
            self.leases.hold(fin.request_id, len(routes))
        n_ranks = len(split_endpoint(fin.peer))
        for endpoint, r in routes:
            header = FinHeader(fin.request_id, fin.first_token if ok else None,
                               fin.num_prompt_tokens, self.config.lease_seconds, num_feeders(
                                   r.dst_rank, self.tp_size, n_ranks, self.hello["num_kv_heads"]))
            try:
                self.sender.send(endpoint, encode_header(header), None)
            except PipeError as e:
                logger.error("FIN for %s failed: %s", fin.request_id, e)
                ok = False
        if not ok:  # a failed transfer's FIN makes the consumer recompute: nothing reads ours
            self.leases.drop(fin.request_id)

    def get_finished(self) -> FinishedTransfers:
        if self._deferred or self._waiting_fins:  # every engine step asks: send what can go
            self._flush_deferred()
            self._send_ready_fins()
        recving = self.receiver.take_finished()
        self._ack(self.receiver.take_nacks())  # gave up: the producers free at once
        return FinishedTransfers(self.leases.take_done(), recving)

    # ---- receiver thread -----------------------------------------------------------------
    def _recv_loop(self) -> None:
        while self._running:
            try:
                msg = self.pipe.recv_tensor(timeout=0.05)
            except PipeError:
                if self._running:
                    logger.exception("KV pipe receive failed")
                return
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
                self._record_hold(header.request_id, header.num_tokens)
            elif isinstance(header, RenewHeader):
                self.leases.renew(list(header.request_ids))
            else:
                if isinstance(header, FinHeader) and header.lease_seconds > 0:
                    self._renew_every = min(self._renew_every, header.lease_seconds / 3)
                self._ack(self.receiver.on_message(header, tensor, peer))
                self._send_holds()

    def _record_hold(self, request_id: str, num_tokens: int) -> None:
        with self._holds_lock:
            self._holds[request_id] = num_tokens
            while len(self._holds) > 4096:  # answers to requests already finished here
                self._holds.popitem(last=False)

    def _send_holds(self) -> None:
        """Consumer: answer producers' offers with the prompt tokens held here."""
        for peer, rid, num_tokens in self.receiver.take_holds():
            try:
                self.pipe.send_tensor(peer, encode_header(HoldHeader(rid, num_tokens)), None)
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
        return {"kv_bytes_sent": self.bytes_sent, "kv_bytes_received": self.receiver.bytes_received,
                "kv_send_seconds": self.leases.send_seconds,
                "kv_recv_seconds": self.receiver.recv_seconds,
                "kv_send_timeouts": self.num_send_timeouts + self.leases.num_expired,
                "kv_dropped_messages": self.receiver.num_dropped,
                "kv_prefix_hit_tokens": self.receiver.prefix_hit_tokens,
                "kv_bytes_skipped": self.receiver.bytes_skipped}

    def close(self) -> None:
        self._running = False
        self.sender.close()
        self.pipe.close()
        self._thread.join(timeout=2)


@register_connector("pd")
def _make_pd(config: KVTransferConfig, engine_info: dict[str, Any]) -> ConnectorPair:
    return PDConnectorScheduler(engine_info["block_size"]), PDConnectorWorker(config, engine_info)
