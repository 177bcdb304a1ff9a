"""One background asyncio event loop per process, for async tools and MCP sessions called from sync env steps.

Env steps are synchronous; async tools (and the MCP client, which is async) run on a daemon thread's loop.
:func:`run_coroutine` submits a coroutine and waits for it with a timeout, cancelling it if the time runs out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["background_loop", "run_coroutine"]

_LOCK = threading.Lock()
_LOOP: list[asyncio.AbstractEventLoop] = []

_T = TypeVar("_T")


def background_loop() -> asyncio.AbstractEventLoop:
    """The process's background event loop (started on first use, on a daemon thread)."""
    with _LOCK:
        if _LOOP and _LOOP[0].is_running():
            return _LOOP[0]
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        threading.Thread(target=run, name="chatenv-tools-loop", daemon=True).start()
        ready.wait()
        _LOOP[:] = [loop]
        return loop


def run_coroutine(coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
    """Run ``coro`` on the background loop and return its result.

    Raises:
        TimeoutError: If it does not finish within ``timeout`` seconds (it is then cancelled).
        RuntimeError: If called from the background loop itself (it would wait on itself).
    """
    loop = background_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise RuntimeError("run_coroutine was called from the tools' own event loop; await the coroutine instead")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError as e:
        future.cancel()
        raise TimeoutError(f"did not finish within {timeout} s") from e
