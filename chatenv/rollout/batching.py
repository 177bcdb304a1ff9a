"""A batching queue: requests submitted one at a time, run together in one call on a worker thread.

Async rollouts submit each episode's next request the moment it is ready; backends that work in batches (a
transformers ``generate``, a reference model's forward) take whatever requests are waiting when they are free, or
that arrive within a short window, as one batch. The queue is generic: it calls ``run(items)`` with a list of
submitted items and hands each caller its own result through a :class:`~concurrent.futures.Future`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

__all__ = ["Batcher"]

_STOP = object()


class Batcher:
    """Collects submitted items into batches and runs each batch on one daemon thread.

    Args:
        run: Called with a list of items; returns one result per item, in order (or raises: every item of the
            batch then fails with that error).
        max_batch: Most items per call (None: no limit).
        window: Seconds to wait for more items after the first one of a batch arrives (items that queue up while a
            batch runs are taken at once, without waiting).
        name: Name of the worker thread.

    Raises:
        ValueError: For a ``max_batch`` below 1 or a negative ``window``.
    """

    def __init__(
        self,
        run: Callable[[list[Any]], Sequence[Any]],
        *,
        max_batch: int | None = None,
        window: float = 0.005,
        name: str = "chatenv-batcher",
    ):
        if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
        if isinstance(window, bool) or not isinstance(window, (int, float)) or window < 0:
            raise ValueError(f"window must be a number of seconds >= 0, got {window!r}")
        self._run, self.max_batch, self.window = run, max_batch, float(window)
        self._items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self.batches: list[int] = []  # the size of every batch run, in order (for tests and statistics)
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: Any) -> Future[Any]:
        """Queue ``item``; the future of its result.

        Raises:
            RuntimeError: If the batcher is closed.
        """
        if self._closed:
            raise RuntimeError("this batcher is closed")
        future: Future[Any] = Future()
        self._items.put((future, item))
        return future

    def close(self) -> None:
        """Stop the worker once the queued items are run (idempotent)."""
        if not self._closed:
            self._closed = True
            self._items.put(_STOP)

    def _take(self) -> tuple[list[tuple[Future[Any], Any]], bool]:
        """The next batch (blocking for its first item) and whether the batcher was stopped."""
        first = self._items.get()
        if first is _STOP:
            return [], True
        batch, stopped = [first], False
        deadline = time.monotonic() + self.window
        while self.max_batch is None or len(batch) < self.max_batch:
            try:
                job = self._items.get_nowait()
            except queue.Empty:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    job = self._items.get(timeout=left)
                except queue.Empty:
                    break
            if job is _STOP:
                stopped = True
                break
            batch.append(job)
        return batch, stopped

    def _work(self) -> None:
        stopped = False
        while not stopped:
            batch, stopped = self._take()
            jobs = [(f, item) for f, item in batch if f.set_running_or_notify_cancel()]
            if not jobs:
                continue
            self.batches.append(len(jobs))
            try:
                results = list(self._run([item for _, item in jobs]))
                if len(results) != len(jobs):
                    raise RuntimeError(f"a batch of {len(jobs)} items gave {len(results)} results")
            except BaseException as e:  # every caller of the batch gets the error
                for f, _ in jobs:
                    f.set_exception(e)
                continue
            for (f, _), result in zip(jobs, results):
                f.set_result(result)
