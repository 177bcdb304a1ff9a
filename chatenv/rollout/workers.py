"""Daemon worker threads for env steps: a step that never returns can be abandoned without hanging the process.

``concurrent.futures.ThreadPoolExecutor`` joins its (non-daemon) workers at interpreter exit, so a reward that
hangs forever would also hang the exit; these workers are daemons, and :meth:`Workers.abandon` walks away from
whatever is still running.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

__all__ = ["Workers"]

#: a submitted call: its future, the function and its arguments
_Call = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class Workers:
    """A fixed set of daemon threads running submitted calls.

    Args:
        n: Number of threads.
        name: Thread name prefix.
    """

    def __init__(self, n: int, name: str = "chatenv-step"):
        self._jobs: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller through the future
                future.set_exception(e)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on a worker; its future."""
        future: Future[Any] = Future()
        self._jobs.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """Stop the workers once they finish what they run (a stuck one is left to die with the process)."""
        for _ in self._threads:
            self._jobs.put(None)
