"""The one engine driver: a thread that owns an LLMEngine (which is not thread safe).

Used by the Ray engine actor and by the stand-alone engine process alike. Requests, aborts and
inspection calls come in through one queue, in order; each step's outputs go out through
``emit`` (called on the engine thread) as incremental EngineDeltas, numbered per request.
Nothing else touches the engine, so the engine needs no locks.
"""
from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from pd_cluster.fault_sites import InjectedFault, fault_site
from pd_cluster.futures import run_into
from pd_cluster.outputs import RequestOutput
from pd_cluster.driver.messages import (ERROR_ENGINE, ERROR_INVALID_REQUEST, EngineDelta,
                                        EngineRequest)

logger = logging.getLogger(__name__)

_IDLE_WAIT = 0.05  # s: block this long for a command when the engine has nothing to do
_PARKED_SLEEP = 0.001  # s: only remote-KV / send waits pending: poll, but do not spin


def build_engine(factory: Callable[[], Any], num_threads: int) -> Any:
    """``factory()`` run on a thread of its own that ends with it, so that the one OpenMP
    team left in the process is the engine thread's. OpenMP keeps a team per thread that ran
    a parallel region; once the teams' threads outnumber the cores, GNU OpenMP stops
    spinning at its barriers and sleeps in them, which made every multi-threaded step of an
    engine built on one thread and stepped on another ~1.5x slower."""
    box: dict[str, Any] = {}

    def run() -> None:
        import torch
        torch.set_num_threads(num_threads)
        try:
            box["engine"] = factory()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            box["error"] = e
    builder = threading.Thread(target=run, name="engine-build")
    builder.start()
    builder.join()  # the factory's own waits are bounded (model load, KV handshake)
    if "error" in box:
        raise box["error"]
    return box["engine"]


class EngineLoop:
    def __init__(self, engine: Any, emit: Callable[[list[EngineDelta]], None],
                 on_fatal: Callable[[BaseException], None] | None = None,
                 num_threads: int = 1, cores: tuple[int, ...] = (), lending: Any = None):
        """``cores``: pin the engine thread (and the OpenMP threads it starts) to them
        (driver/cpu_setup.py); empty: leave its placement to the OS. ``lending``: this
        engine's part in core sharing (driver/core_lending.py: a CoreSharing)."""
        self.engine = engine
        self._emit = emit
        self._on_fatal = on_fatal
        self._num_threads = num_threads
        self._cores = cores
        self._lending = lending
        self._cmds: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._active: dict[str, int] = {}  # request id -> seq of its next delta
        self._stop = threading.Event()
        self.error: BaseException | None = None
        # steps/step_seconds: every step() call; output_*: only steps that produced tokens
        # (parked steps, e.g. waiting for remote KV, would dilute the per-token step time).
        self.counters = {"requests_total": 0, "requests_finished": 0, "requests_rejected": 0,
                         "tokens_generated": 0, "steps": 0, "step_seconds": 0.0,
                         "output_steps": 0, "output_step_seconds": 0.0, "calls_dropped": 0}
        self.snapshot: dict[str, Any] = {}
        # Test-only: the control calls' injected faults (engine.faults.control); None: off.
        faults = getattr(getattr(engine, "config", None), "faults", None)
        self._control = fault_site(faults, "control", self.counters)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- called from other threads -------------------------------------------------------
    def start(self) -> None:
        self._refresh_snapshot()
        # The model, torch and the KV cache's bookkeeping live as long as the engine: out of
        # the collector's sight, a full collection no longer walks them between steps.
        gc.freeze()
        self._thread.start()

    def submit(self, request: EngineRequest) -> None:
        self._cmds.put(("add", request))

    def abort(self, request_ids: list[str]) -> None:
        self._cmds.put(("abort", list(request_ids)))

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run ``fn(engine)`` on the engine thread; the Future holds its result."""
        fut: Future = Future()
        self._cmds.put(("call", fn, fut))
        return fut

    def end_lending(self) -> Future:
        """This engine no longer lends or borrows cores (its role changed: lending is set up
        per role at start); done on the engine thread, between steps."""
        def end(_engine: Any) -> None:
            if self._lending is not None:
                self._lending.close()
                self._lending = None
        return self.call(end)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout)
        if self._lending is not None and not self._thread.is_alive():
            self._lending.close()

    @property
    def thread_id(self) -> int | None:
        """The engine thread's OS thread id (for reading its CPU affinity); None before start."""
        return self._thread.native_id

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ---- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        import torch
        if self._cores:
            from pd_cluster.driver.cpu_setup import pin_thread
            pin_thread(self._cores)
        torch.set_num_threads(self._num_threads)  # OpenMP thread count is per calling thread
        if self._lending is not None:
            self._lending.prepare()  # on this thread: its OpenMP pool is the one lent
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished_requests()
                if self._lending is not None and not busy:
                    self._lending.idle(self.engine)  # what a newcomer absorbs (every wait)
                self._drain(block=not busy)
                if not self.engine.has_unfinished_requests():
                    continue
                t0 = time.perf_counter()
                if self._lending is not None:  # (None once end_lending ran: a role switch)
                    outputs = self._lending.step(self.engine)
                else:
                    outputs = self.engine.step()
                dt = time.perf_counter() - t0
                self.counters["steps"] += 1
                self.counters["step_seconds"] += dt
                if outputs:
                    self.counters["output_steps"] += 1
                    self.counters["output_step_seconds"] += dt
                    self._emit_outputs(outputs)
                    time.sleep(0)  # hand the GIL to the event loop now: it streams the outputs
                self._refresh_snapshot()
                if not outputs and not (self.snapshot.get("num_running")
                                        or self.snapshot.get("num_waiting")):
                    time.sleep(_PARKED_SLEEP)
        except BaseException as e:  # noqa: BLE001 - the engine state is unknown now: fail loudly
            logger.exception("engine loop died")
            self.error = e
            failed = [EngineDelta(rid, seq, finished=True, finish_reason="abort",
                                  error_type=ERROR_ENGINE,
                                  error=f"engine failed: {type(e).__name__}: {e}",
                                  emit_time=time.time()) for rid, seq in
                      sorted(self._active.items())]
            self._active.clear()
            if failed:
                self._emit(failed)
            if self._on_fatal is not None:
                self._on_fatal(e)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=_IDLE_WAIT) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
        self._refresh_snapshot()

    def _handle(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(cmd[1])
        elif kind == "abort":
            ids = [rid for rid in cmd[1] if rid in self._active]
            if ids:
                self._emit_outputs(self.engine.abort_request(ids))
        elif kind == "call":
            fn, fut = cmd[1], cmd[2]
            if self._control is not None:
                fn = self._faulted(fn)
            # A caller whose bound ran out cancelled its future: its call is dropped, counted.
            if not run_into(fut, lambda: fn(self.engine)):
                self.counters["calls_dropped"] += 1

    def _faulted(self, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """A control call under the fault hook: failed (it raises InjectedFault for its
        caller) or delayed (this thread waits first), or as it is."""
        kind = self._control.pick(("fail", "delay"))
        if kind == "delay":
            self._control.wait()
        if kind != "fail":
            return fn

        def failed(_engine: Any) -> Any:
            raise InjectedFault("control call failed (injected fault)")
        return failed

    def _add(self, req: EngineRequest) -> None:
        try:
            if req.request_id in self._active:
                raise ValueError(f"request_id {req.request_id!r} is already running here")
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.params,
                                    kv_transfer_params=req.kv_transfer_params,
                                    resume_token_ids=req.resume_token_ids,
                                    resume_text_len=req.resume_text_len)
        except (ValueError, TypeError) as e:  # the request is bad, not the engine
            self.counters["requests_rejected"] += 1
            self._emit([EngineDelta(req.request_id, finished=True, finish_reason="abort",
                                    error=str(e), error_type=ERROR_INVALID_REQUEST,
                                    emit_time=time.time())])
            return
        self._active[req.request_id] = 0
        self.counters["requests_total"] += 1
        if self._lending is not None:
            self._lending.added(req.request_id, req.params.max_tokens or 1)

    def _emit_outputs(self, outputs: list[RequestOutput]) -> None:
        now, mono = time.time(), time.monotonic()
        deltas = []
        for out in outputs:
            comp = out.outputs[0]
            rid = out.request_id
            seq = self._active.get(rid)
            if seq is None:  # not (or no longer) ours: nothing to number it by
                continue
            self.counters["tokens_generated"] += len(comp.delta_token_ids)
            if self._lending is not None:
                self._lending.emitted(rid, len(comp.delta_token_ids), out.finished, mono)
            if out.finished:
                del self._active[rid]
                self.counters["requests_finished"] += 1
            else:
                self._active[rid] = seq + 1
            deltas.append(EngineDelta(
                rid, seq, comp.delta_token_ids, comp.delta_text, out.finished,
                comp.finish_reason, comp.stop_reason, len(out.prompt_token_ids),
                out.num_cached_tokens, now, logprobs=comp.delta_logprobs,
                prompt_logprobs=out.prompt_logprobs, error=comp.error,
                # (the engine's only ended requests: a grammar that failed; not retried)
                error_type=ERROR_INVALID_REQUEST if comp.error else None))
        self._emit(deltas)

    def _refresh_snapshot(self) -> None:
        # Read by other threads without a lock: a whole new dict is swapped in atomically.
        lent = self._lending.counters if self._lending is not None else {}
        self.snapshot = {**self.engine.stats(), **self.counters, **lent,
                         "num_active": len(self._active)}
