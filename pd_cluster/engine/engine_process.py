"""Run an LLMEngine in its own OS process, driven over ZMQ + msgpack (no Ray, no pickle).

Used to run a producer and a consumer engine as two processes (tests, benchmarks). The parent
binds a ROUTER socket; the child connects a DEALER, reports ready with its KV endpoint, then
alternates between handling commands and stepping the engine, streaming outputs back.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

import msgpack
import zmq

from pd_cluster.config import EngineConfig

_READY_TIMEOUT = 120.0


def _pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


class EngineProcess:
    """Parent-side handle of an engine subprocess."""

    def __init__(self, config: EngineConfig, env: dict[str, str] | None = None):
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        cfg = config.model_dump_json()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd_cluster.engine.engine_process", "--config", cfg,
             "--control", f"tcp://127.0.0.1:{port}"], env={**os.environ, **(env or {})})
        self._ident: bytes | None = None
        self.outputs: dict[str, dict[str, Any]] = {}  # latest output per request
        self._replies: list[dict[str, Any]] = []
        self.kv_endpoint: str | None = None

    def wait_ready(self, timeout: float = _READY_TIMEOUT) -> "EngineProcess":
        """Block until the child loaded its model (start several first, then wait)."""
        self._wait(lambda: self._ident is not None, timeout, "engine start")
        self.kv_endpoint = self._ready["kv_endpoint"]
        return self

    # ---- commands ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any,
                    kv_transfer_params: dict[str, Any] | None = None) -> None:
        self._send({"op": "add", "request_id": request_id, "prompt_token_ids": prompt_token_ids,
                    "params": params.to_dict(), "kv_transfer_params": kv_transfer_params})

    def connect_kv_peer(self, endpoint: str, timeout: float = 30.0) -> None:
        """Producer: handshake with a consumer before sending it requests."""
        self.call("connect", timeout, endpoint=endpoint)

    def abort(self, request_ids: list[str]) -> None:
        self._send({"op": "abort", "request_ids": list(request_ids)})

    def call(self, op: str, timeout: float = 30.0, **kwargs: Any) -> Any:
        """Synchronous query: "stats", "check_no_leaks", "timings"."""
        self._send({"op": op, **kwargs})
        self._wait(lambda: bool(self._replies), timeout, op)
        reply = self._replies.pop(0)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply["result"]

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
                self._send({"op": "shutdown"})
                self.proc.wait(timeout=timeout)
            except (subprocess.TimeoutExpired, zmq.ZMQError):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._sock.close(0)

    # ---- plumbing ------------------------------------------------------------------------
    def _send(self, msg: dict[str, Any]) -> None:
        self._sock.send_multipart([self._ident, _pack(msg)])

    def _wait(self, done: Any, timeout: float, what: str) -> bool:
        deadline = time.monotonic() + timeout
        while not done():
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine process exited ({self.proc.returncode}) during {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            if self._sock.poll(min(left, 0.1) * 1000):
                ident, raw = self._sock.recv_multipart()
                self._on_message(ident, msgpack.unpackb(raw, raw=False))
        return True

    def _on_message(self, ident: bytes, msg: dict[str, Any]) -> None:
        kind = msg.pop("kind")
        if kind == "ready":
            self._ident, self._ready = ident, msg
        elif kind == "output":
            self.outputs[msg["request_id"]] = msg
        else:
            self._replies.append(msg)


def _serve(config: EngineConfig, control: str) -> None:
    """Child side: one loop owning the engine."""
    from pd_cluster.engine.llm_engine import LLMEngine
    from pd_cluster.sampling_params import SamplingParams
    engine = LLMEngine(config)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(control)
    sock.send(_pack({"kind": "ready", "kv_endpoint": engine.kv_endpoint()}))
    queries = {"stats": engine.stats, "check_no_leaks": lambda: engine.check_no_leaks() or True,
               "timings": lambda: _timings(engine),
               "connect": lambda endpoint: engine.connect_kv_peer(endpoint) or True}
    while True:
        busy = engine.has_unfinished_requests()
        while sock.poll(0 if busy else 50):
            msg = msgpack.unpackb(sock.recv(), raw=False)
            op = msg["op"]
            try:
                if op == "shutdown":
                    engine.close()
                    return
                if op == "add":
                    engine.add_request(msg["request_id"], msg["prompt_token_ids"],
                                       SamplingParams.from_dict(msg["params"]),
                                       msg["kv_transfer_params"])
                elif op == "abort":
                    _emit(sock, engine.abort_request(msg["request_ids"]))
                else:
                    args = {k: v for k, v in msg.items() if k != "op"}
                    sock.send(_pack({"kind": "reply", "result": queries[op](**args)}))
            except (ValueError, AssertionError, KeyError, RuntimeError) as e:
                error = f"{type(e).__name__}: {e}"
                if op == "add":  # the caller waits on this request's output, not a reply
                    sock.send(_pack({"kind": "output", "request_id": msg["request_id"],
                                     "token_ids": [], "text": "", "finished": True,
                                     "finish_reason": "error", "error": error}))
                else:
                    sock.send(_pack({"kind": "reply", "error": error}))
            busy = True
        if engine.has_unfinished_requests():
            _emit(sock, engine.step())


def _emit(sock: zmq.Socket, outputs: list[Any]) -> None:
    for out in outputs:
        c = out.outputs[0]
        sock.send(_pack({"kind": "output", "request_id": out.request_id,
                         "token_ids": c.token_ids, "text": c.text, "finished": out.finished,
                         "finish_reason": c.finish_reason}))


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
    args = parser.parse_args()
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    _serve(EngineConfig.model_validate_json(args.config), args.control)
