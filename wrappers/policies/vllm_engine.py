"""vLLM's async engine driven from a background event loop (what :class:`~wrappers.policies.VLLMWrapper` submits to)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import threading
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

__all__ = ["EngineLoop"]


class EngineLoop:
    """Drives an ``AsyncLLM`` from an event loop on a daemon thread; other threads submit requests to it.

    One loop per engine (:meth:`of`): the engine's output handler runs on the loop of its first request.

    Args:
        engine: The async engine.
    """

    _running: dict[int, EngineLoop] = {}
    _lock = threading.Lock()

    @classmethod
    def of(cls, engine: Any) -> EngineLoop:
        """The loop driving ``engine`` (started on first use)."""
        with cls._lock:
            loop = cls._running.get(id(engine))
            if loop is None or loop.engine is not engine:
                loop = cls._running[id(engine)] = cls(engine)
            return loop

    def __init__(self, engine: Any):
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.final_only = RequestOutputKind.FINAL_ONLY
        self.cumulative = RequestOutputKind.CUMULATIVE
        self.loop = asyncio.new_event_loop()
        self.prefix = uuid.uuid4().hex[:8]
        self.ids = itertools.count()
        self.keys = itertools.count(1 << 40)  # seed keys of requests submitted without one
        self.thread = threading.Thread(target=self.loop.run_forever, name="chatenv-vllm-loop", daemon=True)
        self.thread.start()

    def call(self, coroutine: Coroutine) -> Any:
        """Run ``coroutine`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def submit(self, prompt: Any, params: Any, watch: Callable[[Any], None] | None = None) -> Future:
        """Send one request to the engine; the future of its final ``RequestOutput``.

        With ``watch``, the engine streams the request's cumulative outputs and ``watch`` reads each one (on the
        loop's thread) as it comes.
        """
        params.output_kind = self.final_only if watch is None else self.cumulative
        request_id = f"chatenv-{self.prefix}-{next(self.ids)}"
        return asyncio.run_coroutine_threadsafe(self._generate(prompt, params, request_id, watch), self.loop)

    async def _generate(self, prompt: Any, params: Any, request_id: str, watch: Any) -> Any:
        final = None
        async for out in self.engine.generate(prompt, params, request_id):
            final = out
            if watch is not None:
                watch(out)
        return final

    def close(self) -> None:
        """Shut the engine down and stop the loop (idempotent)."""
        with self._lock:
            if self._running.get(id(self.engine)) is self:
                del self._running[id(self.engine)]
        if not self.thread.is_alive():
            return

        async def stop() -> None:
            self.engine.shutdown()
            await asyncio.sleep(0)  # let the output handler's cancellation run

        try:
            self.call(stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
        if not self.thread.is_alive():
            self.loop.close()
        # shut down once: AsyncLLM.__del__ shuts down again, which fails noisily at interpreter exit
        self.engine.shutdown = _already_shut_down
        gc.collect()


def _already_shut_down(*args: Any, **kwargs: Any) -> None:
    """What an engine's ``shutdown`` becomes once :meth:`EngineLoop.close` has shut it down."""
