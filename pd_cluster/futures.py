"""Resolving a ``concurrent.futures.Future`` that a caller on another thread may have given up on.

A caller that waits with a bound (``asyncio.wait_for`` over ``asyncio.wrap_future``, or
``Future.result(timeout)`` followed by ``cancel()``) cancels the future when the bound runs out.
The thread that owns the work must then neither run it for nobody nor raise on
``set_result``: a cancelled future is the caller's decision, never the owner's error.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Optional


def run_into(fut: Future, fn: Callable[[], Any]) -> bool:
    """Run ``fn`` for whoever waits on ``fut`` and hand them its result or exception.
    False (``fn`` not run) when the caller cancelled ``fut`` before it could start: once
    started it can no longer be cancelled, so the result always lands."""
    if not fut.set_running_or_notify_cancel():
        return False
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - the caller's to handle
        fut.set_exception(e)
    except BaseException as e:  # SystemExit, KeyboardInterrupt: the caller hears, then we stop
        fut.set_exception(e)
        raise
    else:
        fut.set_result(result)
    return True


def settle(fut: Optional[Future], exc: Optional[BaseException] = None) -> None:
    """Resolve a future once; ignores None and futures already resolved or cancelled."""
    if fut is None or fut.done():
        return
    try:
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
    except Exception:  # noqa: BLE001 - InvalidStateError: raced with cancel()
        pass


def settle_with(fut: Future, result: Any) -> None:
    """``fut.set_result(result)`` unless the future was resolved or cancelled meanwhile."""
    if fut.done():
        return
    try:
        fut.set_result(result)
    except Exception:  # noqa: BLE001 - InvalidStateError: raced with cancel()
        pass
