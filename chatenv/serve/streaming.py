"""Streaming responses while the policy generates: every API dialect's events fed token by token.

A streaming request runs as any other (:meth:`CaptureService.complete`: one plan, one generation, one commit), with
a callback that receives each reply's new tokens from the policy worker (policies with a ``stream`` method stream;
others hand each reply on when it ends). :class:`LiveCompletion` carries them to the event loop;
:func:`sse` drives a dialect's :class:`StreamWriter` (chat completions, Messages, Responses) from them.

What a client reads must join to the non-streaming response exactly, though a reply is only read (tool calls, stop
strings, end of turn) once it is complete. :class:`LiveReply` sends only text that no later token can change:

- nothing past the reply's end (its first stop id) or a stop string, and not the end of the text where a stop string
  may be starting;
- not a character still split across tokens, nor trailing whitespace (a parsed reply's content drops the newline
  before its calls);
- with tools, nothing from where a tool call could begin (:meth:`~chatenv.templates.tool_calls.ToolCallFormat.
  call_start`: a marker, or the start of one at the end of the text);
- with a reasoning format, the reasoning as it grows (not the start of its closing marker), then the content once
  the reasoning is closed; with a reply prefix, nothing while the text may still be that prefix. (With stop strings
  as well, such replies are sent when complete: a stop string is looked for in the whole text.)

The rest comes when the reply is complete (:meth:`LiveReply.finish`), followed by its tool calls and finish reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from chatenv.serve.errors import APIError
from chatenv.serve.request import ChatRequest
from chatenv.serve.service import Completion
from chatenv.serve.sessions import Choice
from chatenv.tokenization import ChatTokenizer

__all__ = ["LiveCompletion", "LiveReply", "StreamWriter", "sse"]

#: what the policy worker calls with a reply's new tokens: ``(reply index, ids, log-probs or None)``
OnDelta = Callable[[int, list[int], "list[float] | None"], None]


class LiveReply:
    """One reply's text as it is generated: what can be sent now, and the rest once the reply is complete.

    Where the template has a reasoning format, the reasoning goes out first (:meth:`feed_parts`), as the message's
    ``reasoning_content``; the content once the reasoning is closed.

    Args:
        ct: The chat tokenizer the request was rendered with.
        request: The request (its stop strings, and whether replies are read for tool calls).
    """

    def __init__(self, ct: ChatTokenizer, request: ChatRequest):
        self.ct = ct
        self.stops = request.stop
        self.format = ct.tool_format if request.parse_tools else None
        derived = ct.template.derived_profile
        self.prefix = derived.reply_prefix if derived is not None else ""
        fmt = ct.reasoning_format
        self.reasoning = fmt if fmt is not None and fmt.prompt != "closed" else None
        # a stop string is found in the whole text, reasoning and prefix included: such replies are read at the end
        self.hold_all = bool(self.stops) and (self.reasoning is not None or bool(self.prefix))
        self.ids: list[int] = []
        self.sent = ""
        self.sent_reasoning = ""
        self.closed = False  # the reply ended (stop id or stop string): the rest comes with finish()
        self._reply = _Decoded(ct.decode)  # the reply's ids (up to its end) and their text
        self._close_id = ct.closing_id() if self.reasoning is not None else None
        self._before: str | None = None  # the text before the reasoning's closing token, once it came
        self._after = _Decoded(ct.decode)  # the ids after it, and their text

    def feed(self, ids: Sequence[int]) -> str:
        """Take new ids of the reply; the content that can be sent now (``""`` when none).

        For templates with a reasoning format use :meth:`feed_parts` (this drops the reasoning pieces).
        """
        return self.feed_parts(ids)[1]

    def feed_parts(self, ids: Sequence[int]) -> tuple[str, str]:
        """Take new ids of the reply; ``(reasoning, content)`` that can be sent now (``""`` where none)."""
        new = [int(i) for i in ids]
        self.ids.extend(new)
        if self.closed:
            return "", ""
        stops = self.ct.stop_set
        end = next((k for k, i in enumerate(new) if i in stops), None)  # the reply's end (ids before were read)
        self.closed = end is not None
        self._take(new if end is None else new[:end])
        if self.hold_all:
            return "", ""
        reasoning, content = self._read()
        thought = "" if reasoning is None else self._advance_reasoning(reasoning, done=content is not None)
        return thought, "" if content is None else self._advance_content(content)

    def _take(self, ids: list[int]) -> None:
        """Add ids of the reply (before its end) to its text, and to the text after a closed reasoning."""
        if self._close_id is not None and self._before is None and self._close_id in ids:
            k = ids.index(self._close_id)
            self._reply.extend(ids)
            self._before = self.ct.decode(self._reply.ids[: len(self._reply.ids) - len(ids) + k])
            self._after.extend(ids[k + 1 :])
            return
        self._reply.extend(ids)
        if self._before is not None:
            self._after.extend(ids)

    def _read(self) -> tuple[str | None, str | None]:
        """The reply's reasoning and content as if it ended here; content None while it is not known yet.

        As :meth:`~chatenv.tokenization.ChatTokenizer.split_reply` reads a whole reply, from texts kept up to date
        token by token (a long reply is not decoded again for every new token).
        """
        text = self._reply.text()
        if self.reasoning is None and not self.prefix:
            return None, text
        reasoning: str | None = None
        content: str | None = text
        closed = False
        if self.reasoning is not None:
            if self._close_id is None:  # the closing marker is text
                reasoning, content = self.reasoning.split(text)
                close = self.reasoning.close.strip() or self.reasoning.close
                closed = bool(close) and close in text
            elif self._before is None:
                reasoning, content = self.reasoning.split_at(text, None)
            else:
                reasoning, content = self.reasoning.split_at(self._before, self._after.text())
                closed = True
        if reasoning is not None:
            return reasoning, content if closed else None
        if self.prefix and content is not None and content.startswith(self.prefix):
            return None, content[len(self.prefix) :]  # the template's own start of a reply is not content
        stripped = text.lstrip()
        opening = self.reasoning.open.strip() or self.reasoning.open if self.reasoning is not None else ""
        if (opening and opening.startswith(stripped)) or (self.prefix and self.prefix.startswith(text)):
            return None, None  # the reply may still open its reasoning, or be the template's reply prefix
        return None, text

    def _advance_reasoning(self, reasoning: str, done: bool) -> str:
        if not reasoning.startswith(self.sent_reasoning):
            self.hold_all = True  # the reasoning read so far changed under what was sent: wait for the end
            return ""
        safe = len(reasoning)
        if not done and self.reasoning is not None:  # not a split character, nor the start of the closing marker
            base = reasoning.rstrip("\ufffd")
            close = self.reasoning.close.strip() or self.reasoning.close
            safe = min(len(base), _partial_suffix(base, (close,)))
            safe = len(reasoning[:safe].rstrip())
        piece = reasoning[len(self.sent_reasoning) : safe] if safe > len(self.sent_reasoning) else ""
        self.sent_reasoning += piece
        return piece

    def _advance_content(self, text: str) -> str:
        if not text.startswith(self.sent):  # the decoded text changed under what was sent: wait for the end
            self.hold_all = True
            return ""
        safe = self._safe_length(text)
        if safe <= len(self.sent):
            return ""
        piece = text[len(self.sent) : safe]
        self.sent = text[:safe]
        return piece

    def _safe_length(self, text: str) -> int:
        """How much of ``text`` (the content so far) no later token can change in the returned content."""
        base = text.rstrip("\ufffd")  # a character still split across tokens: what follows it is not known
        safe = len(base)
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0:
                self.closed = True
                safe = min(safe, at)
        safe = min(safe, _partial_suffix(base, self.stops))
        if self.format is not None:
            start = self.format.call_start(base)
            if start is not None:
                safe = min(safe, start)
        return len(text[:safe].rstrip())

    @staticmethod
    def _rest(final: str, sent: str, what: str) -> str:
        if not final.startswith(sent):
            raise APIError(
                f"the streamed {what} is not the start of the reply's {what} (this tokenizer's decoding of a prefix "
                "is not a prefix of its decoding); request without stream",
                status=500,
                type="server_error",
            )
        return final[len(sent) :]

    def finish(self, choice: Choice, content: str) -> str:
        """The rest of the reply's returned ``content`` once it is complete.

        Raises:
            APIError: If what was sent is not the start of ``content`` (a tokenizer whose text of a prefix of ids is
                not a prefix of the whole text; the reply is recorded all the same).
        """
        return self._rest(content, self.sent, "content")

    def finish_reasoning(self, choice: Choice) -> str:
        """The rest of the reply's ``reasoning_content`` once it is complete (as :meth:`finish`)."""
        return self._rest(choice.message.get("reasoning_content") or "", self.sent_reasoning, "reasoning")


class _Decoded:
    """The text of a growing list of ids, decoded a few new ids at a time (with a few ids before them as context).

    ``text()`` equals decoding all the ids (tokenizers whose text of a prefix is a prefix of the whole text; where
    that fails for a window, the whole list is decoded again).

    Args:
        decode: Ids to text.
    """

    CONTEXT = 4  # ids decoded again before the new ones (how a tokenizer writes a token can depend on the one before)

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self._text = ""
        self._upto = 0  # ids whose text is in _text (it never ends in a character still split across tokens)

    def extend(self, ids: Sequence[int]) -> None:  # noqa: D102
        self.ids.extend(ids)

    def text(self) -> str:
        """The text of every id so far."""
        if self._upto == len(self.ids):
            return self._text
        start = max(0, self._upto - self.CONTEXT)
        head = self.decode(self.ids[start : self._upto]) if self._upto > start else ""
        window = self.decode(self.ids[start:])
        # a window that reads differently in context, or starts inside a run of bytes (byte-fallback tokenizers
        # write a whole run as replacement characters until it is valid): decode everything
        if "\ufffd" in head or not window.startswith(head):
            whole = self.decode(self.ids)
            if not whole.endswith("\ufffd"):
                self._text, self._upto = whole, len(self.ids)
            return whole
        tail = window[len(head) :]
        if tail.endswith("\ufffd"):
            return self._text + tail  # a character still split across tokens: its text may change
        self._text, self._upto = self._text + tail, len(self.ids)
        return self._text


def _partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Where the longest end of ``text`` that begins one of ``markers`` starts (``len(text)`` if none does)."""
    start = len(text)
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:k]):
                start = min(start, len(text) - k)
                break
    return start


class StreamWriter(Protocol):
    """A dialect's streaming events (each method returns server-sent event strings)."""

    def start(self, live: LiveCompletion) -> list[str]:
        """The events before any token (the response's head)."""

    def delta(self, index: int, ids: list[int], log_probs: list[float] | None) -> list[str]:
        """Events for new tokens of reply ``index``."""

    def finish(self, done: Completion) -> list[str]:
        """The events after the last token: the rest of each reply, tool calls, finish reasons, usage."""

    def error(self, error: APIError) -> list[str]:
        """The events of a failure after the stream began."""


class LiveCompletion:
    """A streaming request under way: its session, prompt size, and the new tokens of its replies as they come.

    Made by :meth:`start` once the policy has begun the request's replies (their first tokens came): a request
    refused before that, by the endpoint's checks or by the policy (settings it cannot take), raises there (and gets
    an ordinary error response, as without streaming).

    Attributes:
        session_id: The request's session.
        prompt_tokens: Tokens of the prompt it is generated after.
        chat_tokenizer: The chat tokenizer it was rendered with.
        completion: The finished request, once :meth:`deltas` has ended.
    """

    def __init__(self, chat_tokenizer: ChatTokenizer):
        self.chat_tokenizer = chat_tokenizer
        self.session_id = ""
        self.prompt_tokens = 0
        self.completion: Completion | None = None
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task: asyncio.Task[Completion] | None = None

    @classmethod
    async def start(
        cls,
        chat_tokenizer: ChatTokenizer,
        run: Callable[[OnDelta, asyncio.Future[tuple[str, int]]], Awaitable[Completion]],
        wait: Callable[[Awaitable[Any]], Awaitable[Any]],
    ) -> LiveCompletion | None:
        """Start ``run(on_delta, ready)`` and return once its first tokens came (None if ``wait`` gave up).

        Args:
            chat_tokenizer: The request's chat tokenizer.
            run: Serves the request, calling ``on_delta`` (from any thread) with new tokens and setting ``ready`` to
                ``(session id, prompt tokens)`` once its checks passed.
            wait: Awaits something unless the client hung up first (then None, the work cancelled).

        Raises:
            APIError: A refusal before generation (the policy's too: it refuses on its worker, after ``ready``).
        """
        live = cls(chat_tokenizer)
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[tuple[str, int]] = loop.create_future()
        begun: asyncio.Future[None] = loop.create_future()  # the first tokens came: the policy took the request

        def put(item: tuple[int, list[int], list[float] | None]) -> None:
            live._queue.put_nowait(item)
            if not begun.done():
                begun.set_result(None)

        def on_delta(index: int, ids: list[int], log_probs: list[float] | None) -> None:
            loop.call_soon_threadsafe(put, (index, ids, log_probs))

        task = live._task = asyncio.ensure_future(run(on_delta, ready))
        task.add_done_callback(lambda _: live._queue.put_nowait(None))

        async def until_begun() -> bool:
            either: set[asyncio.Future[Any]] = {begun, task}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not begun.done():
                task.result()  # raises the refusal
            return True

        try:
            if await wait(until_begun()) is None:
                task.cancel()
                return None
        except BaseException:
            task.cancel()
            raise
        live.session_id, live.prompt_tokens = ready.result()
        return live

    async def deltas(self) -> AsyncIterator[tuple[int, list[int], list[float] | None]]:
        """``(reply index, ids, log-probs or None)`` as the policy generates; :attr:`completion` set at the end.

        Raises:
            APIError: If generation failed.
        """
        assert self._task is not None
        ended = False
        while not ended:
            items = [await self._queue.get()]
            while not self._queue.empty():  # everything that came meanwhile: one read per reply, not per token
                items.append(self._queue.get_nowait())
            ended = items[-1] is None
            for index, ids, log_probs in _merged([i for i in items if i is not None]):
                yield index, ids, log_probs
        self.completion = self._task.result()

    def cancel(self) -> None:
        """Cancel the request if it is still running (nothing is recorded then)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()


def _merged(
    items: list[tuple[int, list[int], list[float] | None]],
) -> list[tuple[int, list[int], list[float] | None]]:
    """Deltas joined per reply, in the order the replies first appear (log-probs NaN where a delta had none)."""
    joined: dict[int, tuple[list[int], list[float] | None]] = {}
    for index, ids, log_probs in items:
        before = joined.get(index)
        if before is None:
            joined[index] = (list(ids), None if log_probs is None else list(log_probs))
            continue
        old_ids, old_lps = before
        if old_lps is not None or log_probs is not None:
            old_lps = (old_lps if old_lps is not None else [math.nan] * len(old_ids)) + (
                list(log_probs) if log_probs is not None else [math.nan] * len(ids)
            )
        joined[index] = (old_ids + list(ids), old_lps)
    return [(index, ids, lps) for index, (ids, lps) in joined.items()]


async def sse(live: LiveCompletion, writer: StreamWriter) -> AsyncIterator[str]:
    """The server-sent events of a streaming request, written by ``writer`` as the tokens come.

    A client that hangs up while the reply is being generated cancels the request (nothing is recorded; the
    policy finishes the rows it was generating, for nobody). Once the reply is complete it is recorded, whether or
    not the client reads the last events.
    """
    try:
        for event in writer.start(live):
            yield event
        async for index, ids, log_probs in live.deltas():
            for event in writer.delta(index, ids, log_probs):
                yield event
        assert live.completion is not None
        for event in writer.finish(live.completion):
            yield event
    except APIError as e:
        for event in writer.error(e):
            yield event
    finally:
        with contextlib.suppress(Exception):
            live.cancel()
