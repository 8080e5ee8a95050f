"""Run an LLMEngine in its own OS process, driven over ZMQ (no Ray, no pickle).

Used to run a producer and a consumer engine as two processes (tests, benchmarks). The child
runs the same driver as the Ray engine actor (EngineLoop: same message types, same error
semantics) and speaks the same msgspec messages: the parent sends EngineRequests and control
calls; the child streams EngineDelta batches back on a socket owned by the engine thread.
The child exits when its parent dies (an aborted test or benchmark leaves no orphan engine).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from pd_cluster.config import EngineConfig
from pd_cluster.driver.cpu_setup import CoreClaim, CpuPolicy, claim_cores, preload_env

_READY_TIMEOUT = 120.0
_CALL_TIMEOUT = 60.0
_PARENT_CHECK = 0.5  # s between the child's checks that its parent still lives


class Control(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Parent -> child: run ``op`` ("add", "abort", "stats", "check_no_leaks", "timings",
    "cpu_setup", "connect", "shutdown") with ``args``."""
    op: str
    args: dict[str, Any] = {}
    request: bytes = b""  # an encoded EngineRequest for "add"


class Reply(msgspec.Struct, tag=True):
    """Child -> parent: "ready" (with the KV endpoint), a control call's result or error."""
    kind: str
    result: Any = None
    error: str | None = None


_encoder = msgspec.msgpack.Encoder()
_control = msgspec.msgpack.Decoder(Control)
_reply = msgspec.msgpack.Decoder(Reply)


class EngineProcess:
    """Parent-side handle of an engine subprocess."""

    def __init__(self, config: EngineConfig, env: dict[str, str] | None = None,
                 cpu: CpuPolicy = CpuPolicy()):
        """``cpu``: whether the child pins its compute threads (OMP_NUM_THREADS of them,
        default 1) to cores of its own and starts with tcmalloc / Intel OpenMP preloaded."""
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        child_env = {**os.environ, **(env or {})}
        if cpu.preload_libraries:
            child_env.update(preload_env(child_env.get("LD_PRELOAD"))[0])
        pin = ["--pin-reserve", str(cpu.reserve_cores)] if cpu.pin_threads else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd_cluster.engine.engine_process", "--config",
             config.on_device(config.torch_device).model_dump_json(),  # resolved here
             "--control", f"tcp://127.0.0.1:{port}", "--parent-pid", str(os.getpid()), *pin],
            env=child_env)
        self._ctl: bytes | None = None  # the child's control identity (its output one differs)
        self.outputs: dict[str, dict[str, Any]] = {}  # per request: assembled from its deltas
        self._replies: list[Reply] = []
        self.kv_endpoint: str | None = None

    def wait_ready(self, timeout: float = _READY_TIMEOUT) -> "EngineProcess":
        """Block until the child loaded its model (start several first, then wait)."""
        self._wait(lambda: self._ctl is not None, timeout, "engine start")
        return self

    # ---- commands ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    kv_transfer_params: Any = None) -> None:
        """``kv_transfer_params``: SendKV / RecvKV (connectors/transfer_params.py)."""
        from pd_cluster.driver.messages import EngineRequest, encode
        req = EngineRequest(request_id, list(prompt_token_ids), params, kv_transfer_params,
                            timeout=3600.0)
        self._send(Control("add", request=encode(req)))

    def connect_kv_peer(self, endpoint: str, timeout: float = 30.0) -> None:
        """Producer: handshake with a consumer before sending it requests."""
        self.call("connect", timeout, endpoint=endpoint)

    def abort(self, request_ids: list[str]) -> None:
        self._send(Control("abort", {"request_ids": list(request_ids)}))

    def call(self, op: str, timeout: float = _CALL_TIMEOUT, **kwargs: Any) -> Any:
        """Synchronous query: "stats", "check_no_leaks", "timings", "cpu_setup", "connect"."""
        self._send(Control(op, kwargs))
        self._wait(lambda: bool(self._replies), timeout, op)
        reply = self._replies.pop(0)
        if reply.error is not None:
            raise RuntimeError(reply.error)
        return reply.result

    def check_no_leaks(self, timeout: float = _CALL_TIMEOUT) -> None:
        """AssertionError unless no request and no KV block is held (LLMEngine's contract)."""
        try:
            self.call("check_no_leaks", timeout)
        except RuntimeError as e:
            kind, _, message = str(e).partition(": ")
            if kind == "AssertionError":
                raise AssertionError(message) from None
            raise

    def wait_finished(self, request_ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
        self._wait(lambda: all(self.outputs.get(r, {}).get("finished") for r in request_ids),
                   timeout, f"{len(request_ids)} requests")
        return {r: self.outputs[r] for r in request_ids}

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self._send(Control("shutdown"))
                self.proc.wait(timeout=timeout)
            except (subprocess.TimeoutExpired, zmq.ZMQError):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._sock.close(0)

    # ---- plumbing ------------------------------------------------------------------------
    def _send(self, msg: Control) -> None:
        self._sock.send_multipart([self._ctl, _encoder.encode(msg)])

    def _wait(self, done: Any, timeout: float, what: str) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine process exited ({self.proc.returncode}) during {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            if self._sock.poll(min(left, 0.1) * 1000):
                ident, kind, raw = self._sock.recv_multipart()
                self._on_message(ident, kind, raw)
        return True

    def _on_message(self, ident: bytes, kind: bytes, raw: bytes) -> None:
        if kind == b"deltas":
            from pd_cluster.driver.messages import decode_deltas
            for d in decode_deltas(raw):
                out = self.outputs.setdefault(d.request_id, {"token_ids": [], "text": "",
                                                             "finished": False})
                out["token_ids"] = out["token_ids"] + list(d.token_ids)
                out["text"] += d.text
                out.update(finished=d.finished, finish_reason=d.finish_reason, error=d.error)
            return
        reply = _reply.decode(raw)
        if reply.kind == "ready":
            self._ctl, self.kv_endpoint = ident, reply.result
        else:
            self._replies.append(reply)


def exit_with_parent(parent_pid: int, interval: float = _PARENT_CHECK) -> threading.Thread:
    """Exit this process once ``parent_pid`` is no longer its parent (it died: this process
    was re-parented), checked every ``interval`` seconds on a daemon thread, whatever the
    main thread blocks in (loading the model, a recv). Not prctl's PDEATHSIG: that fires when
    the parent's spawning *thread* ends, which a parent that starts engines from a worker
    thread would see as its engine dying."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(1)  # no clean-up: its socket files are swept by the next engine to start
    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def _serve(config: EngineConfig, control: str, pin_reserve: int | None) -> None:
    """Child side: the EngineLoop driver owns the engine; this thread answers the parent.
    ``pin_reserve``: claim cores for the engine thread, the node's lowest that many last."""
    import torch

    from pd_cluster.engine.llm_engine import LLMEngine
    from pd_cluster.driver.engine_loop import EngineLoop, build_engine
    from pd_cluster.driver.messages import decode_request, encode

    engine = build_engine(lambda: LLMEngine(config),
                          int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = zmq.Context.instance()
    outputs: dict[str, zmq.Socket] = {}

    def emit(deltas: list[Any]) -> None:  # always on the engine thread: it owns its socket
        sock = outputs.get("s")
        if sock is None:
            sock = outputs["s"] = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(control)
        sock.send_multipart([b"deltas", encode(deltas)])

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    claim = CoreClaim() if pin_reserve is None else claim_cores(threads, pin_reserve)
    loop = EngineLoop(engine, emit, on_fatal=lambda e: os._exit(1), num_threads=threads,
                      cores=claim.cores)
    loop.start()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(control)
    sock.send_multipart([b"reply", _encoder.encode(Reply("ready", engine.kv_endpoint()))])
    queries = {"stats": lambda e: e.stats(),
               "check_no_leaks": lambda e: e.check_no_leaks() or True,
               "timings": _timings,
               "cpu_setup": lambda e: {"pid": os.getpid(), "engine_thread_id": loop.thread_id,
                                       "cores": list(claim.cores),
                                       "why_not_pinned": claim.why_not,
                                       "torch_threads": torch.get_num_threads()}}
    while True:
        msg = _control.decode(sock.recv())
        if msg.op == "shutdown":
            loop.stop()
            engine.close()
            return
        if msg.op == "add":
            loop.submit(decode_request(msg.request))
        elif msg.op == "abort":
            loop.abort(msg.args["request_ids"])
        else:
            try:
                if msg.op == "connect":  # a handshake: off the engine thread, as in a cluster
                    result = engine.connect_kv_peer(msg.args["endpoint"]) or True
                else:
                    result = loop.call(queries[msg.op]).result(timeout=_CALL_TIMEOUT)
                reply = Reply("result", result)
            except Exception as e:  # noqa: BLE001 - handed to the caller
                reply = Reply("result", error=f"{type(e).__name__}: {e}")
            sock.send_multipart([b"reply", _encoder.encode(reply)])


def _timings(engine: Any) -> dict[str, dict[str, float]]:
    conn = engine.runner.connector
    if conn is None:
        return {}
    return {"last_layer_saved": dict(conn.last_layer_times),
            "first_layer_received": dict(conn.receiver.first_layer_times)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--control", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--pin-reserve", type=int, default=None)
    args = parser.parse_args()
    exit_with_parent(args.parent_pid)  # first: the imports and the model load take seconds
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _serve(EngineConfig.model_validate_json(args.config), args.control, args.pin_reserve)
