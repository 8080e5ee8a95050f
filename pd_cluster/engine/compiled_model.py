"""The decoder's forward compiled once (``torch.compile``, inductor), attention left out of the
graph as an opaque op (models/layers/paged_call.py), kept on disk for the next start.

One graph covers the whole decoder (embedding, every layer's projections, norms, rotary and
MLP or MoE, the final norm), dynamic in the number of tokens (unbacked: one graph for every
step, one token included). It is compiled ahead of the first step, while the engine starts,
from example inputs (tracing runs the opaque ops' fake forms only: no cache, no collective), and
saved as one artifact (``torch.compile(...).aot_compile``: dynamo's bytecode and guards with
inductor's code) named by ``compile_cache.artifact_key``. A later start with the same key loads
it (about a second) instead of tracing and compiling again; a stale or unreadable one is
deleted and compiled again. Engines that start together with the same key (P and D of one
model) compile once: the others wait for the artifact and load it.

A step whose inputs fail the graph's guards (never in the engine's own steps) runs eagerly,
with a warning, and so does every step of a model that failed to compile (logged): the result
is the same, only slower.

``engine.compile`` turns it on or off; unset, ``$PD_CLUSTER_COMPILE`` decides; neither: on for
CPUs, off on GPUs (``compile_enabled``).
"""
from __future__ import annotations

import copyreg
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from pd_cluster.config import COMPILE_MODES
from pd_cluster.engine import artifact_store
from pd_cluster.engine.compile_cache import (artifact_dir, artifact_key, drop_corrupt_kernel,
                                             inductor_cache_dir, remember_isa_probe,
                                             skip_known_isa_probe)
from pd_cluster.models.context import ForwardContext
from pd_cluster.models.layers.paged_call import step_scope
from pd_cluster.private_files import UnsafePath

logger = logging.getLogger(__name__)

COMPILE_ENV = "PD_CLUSTER_COMPILE"
COMPILE_MODE_ENV = "PD_CLUSTER_COMPILE_MODE"
_LOCK_WAIT_S = 600.0  # another process compiling the same artifact (the launcher's own bound)
_EXAMPLE_TOKENS = 8


def compile_enabled(setting: bool | None, device: torch.device | str = "cpu") -> bool:
    """``engine.compile`` when set, else ``$PD_CLUSTER_COMPILE``; neither: on for CPUs (where
    it was measured to win), off on GPUs until measured there (scripts/gpu_check.sh)."""
    if setting is not None:
        return setting
    env = os.environ.get(COMPILE_ENV, "").strip().lower()
    if env:
        return env not in ("0", "false", "no", "off")
    return torch.device(device).type == "cpu"


def compile_mode(setting: str | None) -> str:
    """``engine.compile_mode`` when set, else ``$PD_CLUSTER_COMPILE_MODE``, else background."""
    mode = setting or os.environ.get(COMPILE_MODE_ENV, "").strip().lower() or "background"
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode: must be one of {list(COMPILE_MODES)}, got {mode!r} "
                         f"(from ${COMPILE_MODE_ENV})")
    return mode


class CompiledModel:
    """Calls like the model (``(input_ids, positions, ctx) -> hidden``) through one compiled
    graph (the logits stay eager: one matmul on the rows that sample).

    ``background`` (an EngineConfig, the engine's): the graph is made off the step loop
    (background_compile.py) and every call runs eagerly until it is ready; the call after
    that switches (a whole step runs one or the other). Else it is loaded or compiled here,
    before the first call. ``expect_path``: the compile child's check that its key is its
    engine's (nothing is compiled otherwise)."""

    def __init__(self, model: Any, device: torch.device, background: Any = None,
                 expect_path: Path | None = None) -> None:
        self.model, self.decoder = model, model.model
        self._layers = [layer.self_attn for layer in self.decoder.layers]
        for rotary in self.decoder.rotary.values():
            rotary.frequencies(device)  # computed before tracing: inputs, not a guard
        self.compiled_steps = self.eager_steps = 0
        self._fn: Any = None  # what the steps call (None: eager)
        self._next: Any = None  # the background compile's result, taken by the next call
        self.state = "compiling"  # -> compiled | failed (serving eagerly)
        self.compile_seconds: float | None = None
        self._background: Any = None
        self._guard_warned = False
        limits = artifact_store.limits_from_env()  # a bad setting fails before a compile
        try:
            folder: Path | None = artifact_dir()
        except UnsafePath as e:  # another user's or a shared folder: nothing read or kept
            artifact_store.warn_unsafe(e)
            folder = None
        self.path: Path | None = None  # the artifact (named by its key: see locate)
        if background is not None and folder is not None:  # else no artifact to hand over
            from pd_cluster.engine.background_compile import BackgroundCompile
            self._background = BackgroundCompile(self, background, device)
            return
        self.locate(device, folder)
        if expect_path is not None and self.path != expect_path:
            logger.error("the compile child's key (%s) is not its engine's (%s): not compiled",
                         self.path.name, expect_path.name)
            self.state = "failed"
            return
        start = time.monotonic()
        skip_known_isa_probe()
        with torch.inference_mode():  # the engine's steps run in it: so do the guards' checks
            for attempt in range(2):
                try:
                    self._fn = (self._load_or_compile(device) if folder is not None
                                else self._compile(device, save=False))
                    break
                except Exception as e:  # a graph break in a new model, an inductor error
                    dropped = drop_corrupt_kernel(e) if attempt == 0 else None
                    if dropped is None:
                        logger.exception("compiling the model failed: it runs eagerly")
                        break
                    logger.warning("removed a truncated kernel from inductor's cache (%s); "
                                   "compiling again", dropped)
        self.state = "compiled" if self._fn is not None else "failed"
        self.compile_seconds = time.monotonic() - start
        remember_isa_probe()
        if folder is not None:  # after this engine's artifact was used: it is the newest
            artifact_store.prune_once(folder, limits)

    def locate(self, device: torch.device, folder: Path | None) -> Path:
        """Sets ``path``: the artifact named by this model's key (a second or two: inductor's
        settings are part of it)."""
        key = artifact_key(self.decoder, self.model.spec, self.model.tp.rank,
                           self.model.tp.size, device)
        name = f"{key}{artifact_store.SUFFIX}"
        self.path = (folder or inductor_cache_dir() / "pd_cluster") / name
        return self.path

    @property
    def ready(self) -> bool:
        """Whether the steps run (or the next one will run) the compiled graph."""
        return self._fn is not None or self._next is not None

    def offer(self, fn: Any, seconds: float) -> None:
        """The background compile's result: the next call switches to it."""
        self.compile_seconds = seconds
        self._next = fn

    def close(self, timeout: float = 10.0) -> None:
        """Ends a background compile still running (its process included), within ``timeout``."""
        if self._background is not None:
            self._background.stop(timeout)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        args = (self.decoder, input_ids, positions, ctx)
        fn = self._fn
        if fn is None and self._next is not None:  # the switch: between two steps
            fn = self._fn = self._next
            self.state = "compiled"
            logger.info("switched to the compiled step after %d eager steps (compiled in %.1f s "
                        "off the step loop)", self.eager_steps, self.compile_seconds or 0.0)
        with step_scope(ctx, self._layers, self.model.tp):
            if fn is not None and fn.guard_check(*args):
                self.compiled_steps += 1
                return fn(*args)
            if fn is not None and not self._guard_warned:
                self._guard_warned = True
                logger.warning("a step did not match the compiled graph's guards (%s); it runs "
                               "eagerly", fn._artifacts.guard_manager.check_verbose(
                                   fn.prepare_f_locals(*args)))
            self.eager_steps += 1
            return self.decoder(input_ids, positions, ctx)

    # ---- the artifact ----------------------------------------------------------------------
    def _load_or_compile(self, device: torch.device) -> Any:
        from filelock import FileLock, Timeout
        lock = FileLock(f"{self.path}.lock")
        try:
            lock.acquire(timeout=_LOCK_WAIT_S)
        except Timeout:
            logger.warning("%s stayed locked for %.0f s: compiling without it", lock.lock_file,
                           _LOCK_WAIT_S)
            return self._compile(device, save=False)
        try:
            fn = self._load()
            return fn if fn is not None else self._compile(device, save=True)
        finally:
            lock.release()

    def _load(self) -> Any:
        start = time.monotonic()
        try:
            data = artifact_store.read_artifact(self.path)
        except UnsafePath as e:  # not loaded; the compile's artifact is renamed over it
            artifact_store.warn_unsafe(e)
            return None
        if data is None:
            return None
        try:
            fn = _deserialize(data, self.decoder)
        except Exception as e:  # another torch, a truncated file: compile it again
            logger.warning("compiled model %s not usable (%s: %s); compiling again", self.path,
                           type(e).__name__, e)
            self.path.unlink(missing_ok=True)
            return None
        logger.info("loaded the compiled model from %s in %.1f s", self.path,
                    time.monotonic() - start)
        return fn

    def _compile(self, device: torch.device, save: bool) -> Any:
        # Warnings: the one start that waits on it says why, in an engine actor's log too.
        logger.warning("compiling the model (first start, cached for the next) ...")
        start = time.monotonic()
        with torch.inference_mode(False):  # like the runner's input buffers (guarded)
            ids = torch.zeros(_EXAMPLE_TOKENS, dtype=torch.long, device=device)
            positions = torch.arange(_EXAMPLE_TOKENS, device=device)
            ctx = ForwardContext(None, [], None, rope_lens=positions + 1)  # type: ignore[arg-type]
        for t in (ids, positions, ctx.rope_lens):
            torch._dynamo.decorators.mark_unbacked(t, 0)  # any token count, 0 and 1 included
        with _unpicklable_as_none(self.model.tp.group):
            compiled = torch.compile(type(self.decoder).forward, fullgraph=True,
                                     options={"guard_filter_fn": _savable_guards}).aot_compile(
                ((self.decoder, ids, positions, ctx), {}))
        try:
            data = type(compiled).serialize(compiled, {"decoder": self.decoder}).serialized_data
            fn = _deserialize(data, self.decoder)  # what every later start runs: run it now
        except Exception as e:
            logger.warning("compiled model not cacheable (%s: %s): the next start compiles again",
                           type(e).__name__, e)
            compiled.disable_guard_check()
            return compiled
        if save:
            artifact_store.write_artifact(self.path, data)
        logger.warning("compiled the model in %.1f s%s", time.monotonic() - start,
                       f" (cached in {self.path})" if save else "")
        return fn


def _savable_guards(guards: Sequence[Any]) -> list[bool]:
    """The guards an artifact keeps: dynamo's own choice for saved graphs (no globals, no
    object identities), less those on cpu_gemm.py's packed weights: the oneDNN tensor (not
    strided: its guard state cannot be saved) and the released dense weight left on the meta
    device (never read). The artifact's key covers their shapes, dtypes, devices and layouts,
    and the model they belong to is the one passed to every call."""
    from torch._dynamo.guards import CheckFunctionManager
    unsupported = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [not (g.is_global or g.guard_type in unsupported or _opaque_weight(g.value))
            for g in guards]


def _opaque_weight(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.layout != torch.strided
                                                or value.device.type == "meta")


@contextmanager
def _unpicklable_as_none(*objects: Any) -> Iterator[None]:
    """Pickle these objects' types as None while compiling: the guards' saved state holds the
    module tree, whose tensor-parallel group (a ProcessGroup) cannot be pickled and is never
    guarded on (the collectives are opaque ops)."""
    types = {type(o) for o in objects if o is not None} - set(copyreg.dispatch_table)
    for t in types:
        copyreg.pickle(t, lambda _: (type(None), ()))
    try:
        yield
    finally:
        for t in types:
            copyreg.dispatch_table.pop(t, None)


def _deserialize(data: bytes, decoder: torch.nn.Module) -> Any:
    from torch._dynamo.aot_compile import AOTCompiledFunction
    fn = AOTCompiledFunction.deserialize(data, type(decoder).forward.__globals__,
                                         {"decoder": decoder})
    fn.disable_guard_check()  # __call__ checks them once itself, and falls back to eager
    return fn

