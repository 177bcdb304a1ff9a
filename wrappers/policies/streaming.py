"""Token streaming: a policy's generation read token by token while it runs.

:meth:`~wrappers.policies.base.LLMWrapperBase.stream` reads and checks the input on the caller's thread (a bad input
raises there, before anything runs), then generates on a worker thread. The returned :class:`PolicyStream` yields a
:class:`TokenDelta` whenever a row's reply grows, and :meth:`PolicyStream.result` gives the output tensordict, the
same layout (and, for the same settings and seed, the same values) as calling the policy.

Backends hand new tokens to a callback ``on_tokens(row, ids, log_probs)`` from their ``_generate_ids`` (``row``:
the prompt's index times ``num_samples`` plus the sample's index). Only tokens that the final reply keeps are handed
on, so for every row the deltas joined equal its reply's ids. The transformers backend streams through
``generate``'s streamer (log-probs come with the final output: ``generate`` hands a streamer tokens, not scores);
vLLM's async engine streams its requests' outputs with their log-probs; ``vllm.LLM`` cannot stream, so its rows
arrive as one delta each when the batch ends.
"""

from __future__ import annotations

import inspect
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDictBase

__all__ = ["OnTokens", "PolicyStream", "TokenDelta", "streamed_generation"]

#: what backends call with each row's new tokens: ``(row, ids, log_probs or None)``
OnTokens = Callable[[int, list[int], "list[float] | None"], None]


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of one row's reply.

    Attributes:
        row: The input row (batch index).
        sample: The sample of that row (0 unless the policy has ``num_samples``).
        ids: The new token ids, in order.
        log_probs: Their log-probs where the backend knows them while generating (vLLM), else None (they are in
            the final output).
    """

    row: int
    sample: int
    ids: tuple[int, ...]
    log_probs: tuple[float, ...] | None = None


_END = object()


class PolicyStream:
    """A running generation: iterate it for :class:`TokenDelta` s, then read :meth:`result`.

    Args:
        run: Runs the generation (on a worker thread) with the callback for new tokens; returns the output.
        num_samples: Samples per input row (rows of the backend's callback are ``row * num_samples + sample``).

    Iterating ends when the generation does; an error of the generation is raised by the iteration (and by
    :meth:`result`). Deltas not iterated are kept, so :meth:`result` can be read without iterating.
    """

    def __init__(self, run: Callable[[OnTokens], TensorDictBase], num_samples: int):
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._n = num_samples
        self._done = threading.Event()
        self._output: TensorDictBase | None = None
        self._error: BaseException | None = None
        self._run = run
        self._thread = threading.Thread(target=self._work, name="chatenv-stream", daemon=True)
        self._thread.start()

    def _put(self, row: int, ids: list[int], log_probs: list[float] | None) -> None:
        lps = None if log_probs is None else tuple(float(v) for v in log_probs)
        self._queue.put(TokenDelta(row // self._n, row % self._n, tuple(int(i) for i in ids), lps))

    def _work(self) -> None:
        try:
            self._output = self._run(self._put)
        except BaseException as e:  # handed to the reader
            self._error = e
        finally:
            self._done.set()
            self._queue.put(_END)

    def __iter__(self) -> Iterator[TokenDelta]:
        while True:
            item = self._queue.get()
            if item is _END:
                self._queue.put(_END)  # a second iteration ends at once
                if self._error is not None:
                    raise self._error
                return
            yield item

    def __enter__(self) -> PolicyStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.wait()

    @property
    def done(self) -> bool:
        """Whether the generation has ended."""
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> TensorDictBase:
        """The output tensordict (as calling the policy returns it), once the generation ends.

        Raises:
            TimeoutError: If it has not ended within ``timeout`` seconds.
            Exception: The generation's own error.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"the generation did not end within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._output is not None
        return self._output


class RowTracker:
    """What was streamed of each row: a backend's callback wrapped, and the tails it missed handed on at the end.

    Args:
        on_tokens: Where deltas go.
    """

    def __init__(self, on_tokens: OnTokens):
        self.on_tokens = on_tokens
        self.sent: dict[int, list[int]] = {}

    def __call__(self, row: int, ids: list[int], log_probs: list[float] | None) -> None:  # noqa: D102
        if ids:
            self.sent.setdefault(row, []).extend(ids)
            self.on_tokens(row, ids, log_probs)

    def finish(self, replies: list[list[int]], log_probs: list[Any]) -> None:
        """Hand on what each row's final reply has beyond what was streamed (all of it, if the backend cannot stream).

        The streamed ids must be a prefix of the reply.

        Raises:
            RuntimeError: If a row streamed ids its final reply does not start with (a backend fault).
        """
        for row, ids in enumerate(replies):
            sent = self.sent.get(row, [])
            if ids[: len(sent)] != sent:
                raise RuntimeError(f"row {row} streamed ids that its final reply does not start with")
            if len(ids) > len(sent):
                lp = log_probs[row]
                tail = None if lp is None else [float(v) for v in lp[len(sent) :]]
                self(row, list(ids[len(sent) :]), tail)


def streamed_generation(
    generate: Callable[..., Any], prompts: list[list[int]], settings: Any, finish: Callable[[Any], TensorDictBase]
) -> Callable[[OnTokens], TensorDictBase]:
    """What a :class:`PolicyStream` runs for ``policy.stream``: generate handing tokens on, then the output.

    Args:
        generate: The backend's ``_generate_ids``; one without an ``on_tokens`` parameter (a subclass written
            before streaming) hands each reply on whole when it ends.
        prompts: The prompts' ids.
        settings: The generation settings.
        finish: The output of the samples, as calling the policy writes it.
    """
    streams = "on_tokens" in inspect.signature(generate).parameters

    def run(on_tokens: OnTokens) -> TensorDictBase:
        tracker = RowTracker(on_tokens)
        samples = generate(prompts, settings, on_tokens=tracker) if streams else generate(prompts, settings)
        flat = [s for per_prompt in samples for s in per_prompt]
        tracker.finish([s.ids for s in flat], [s.log_probs for s in flat])
        return finish(samples)

    return run
