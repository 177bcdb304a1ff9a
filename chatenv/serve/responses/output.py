"""Responses API replies: the ``response`` object and its streaming events, fed token by token.

The output side of :mod:`chatenv.serve.responses.request`. The ``output`` is an assistant ``message`` item
(``output_text``; left out when the reply only calls tools), then one ``function_call`` item per call. A streaming
response (:class:`ResponsesStreamWriter`, driven by :func:`chatenv.serve.streaming.sse`) sends ``response.created``
and ``response.in_progress``, then the message item's text as the policy generates it (only text no later token can
change: :class:`~chatenv.serve.streaming.LiveReply`), and once the reply is complete the rest of it, the function
calls and ``response.completed`` (``response.incomplete`` for a reply cut by its budget). Every event has its
``sequence_number``; joined, the events give the non-streaming response.
"""

from __future__ import annotations

import base64
import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.messages import api_message
from chatenv.serve.request import ChatRequest
from chatenv.serve.service import Completion
from chatenv.serve.sessions import Choice
from chatenv.serve.streaming import LiveCompletion, LiveReply

__all__ = [
    "ResponsesRequest",
    "ResponsesStreamWriter",
    "open_reasoning",
    "output_items",
    "response_body",
    "seal_reasoning",
]


@dataclass
class ResponsesRequest:
    """A checked Responses request: the chat request it is served as, and what the response echoes.

    Attributes:
        chat: The request as the endpoint serves it.
        echo: The request's settings as the response object repeats them (instructions, tools, tool_choice, ...).
        include: What the response adds (``reasoning.encrypted_content``, ``message.output_text.logprobs``).
    """

    chat: ChatRequest
    echo: dict[str, Any] = field(default_factory=dict)
    include: tuple[str, ...] = ()


#: the mark of a reasoning item's ``encrypted_content`` written here
_SEAL = "chatenv-reasoning-v1:"


def seal_reasoning(text: str) -> str:
    """A reasoning item's ``encrypted_content``: the reasoning itself, base64-encoded (nothing is encrypted or stored).

    A client that keeps no reasoning text (``store: false`` clients send back what they received: this blob) gets
    the reasoning back to the endpoint verbatim, so its session continues the recorded reply.
    """
    return _SEAL + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def open_reasoning(blob: Any) -> str | None:
    """The reasoning a :func:`seal_reasoning` blob holds, or None for anything else."""
    if not isinstance(blob, str) or not blob.startswith(_SEAL):
        return None
    try:
        return base64.urlsafe_b64decode(blob[len(_SEAL) :].encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def output_items(
    choice: Choice, message_id: str | None = None, reasoning_id: str | None = None
) -> list[dict[str, Any]]:
    """A reply as output items: its reasoning (if any), its message (unless it only calls tools), its calls."""
    message = api_message(choice.message)
    calls = message.get("tool_calls") or []
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if message.get("reasoning_content"):  # a closed reasoning is complete even when the content was cut
        closed = choice.finish_reason != "length" or bool(message["content"]) or bool(calls)
        thought = "completed" if closed else status
        items.append(_reasoning_item(reasoning_id or _id("rs"), message["reasoning_content"], thought))
    if message["content"] or not calls:
        part = _text_part(message["content"] or "")
        msg_id = message_id or _id("msg")
        items.append({"id": msg_id, "type": "message", "role": "assistant", "status": status, "content": [part]})
    for c in calls:
        fn = c["function"]
        items.append(
            {
                "id": _id("fc"),
                "type": "function_call",
                "status": "completed",
                "call_id": c["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
            }
        )
    return items


def _head(request: ResponsesRequest, response_id: str, created: int) -> dict[str, Any]:
    """The response object's fields that do not depend on the reply."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": request.chat.model,
        "output": [],
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": None,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": {},
        **request.echo,
        "usage": None,
    }


def response_body(
    request: ResponsesRequest,
    done: Completion,
    response_id: str | None = None,
    message_id: str | None = None,
    created: int | None = None,
    reasoning_id: str | None = None,
) -> dict[str, Any]:
    """The ``response`` object of a served request (its first reply)."""
    choice = done.choices[0]
    prompt, generated = done.prompt_tokens, len(choice.ids)
    cut = choice.finish_reason == "length"
    body = _head(request, response_id or _id("resp"), done.meta["created"] if created is None else created)
    body["status"] = "incomplete" if cut else "completed"
    body["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
    body["output"] = _included(request, done, output_items(choice, message_id, reasoning_id))
    body["usage"] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(done)},
        "total_tokens": prompt + generated,
    }
    return body


def _included(request: ResponsesRequest, done: Completion, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items with what ``include`` asks for: sealed reasoning, the message text's log-probs."""
    for item in items:
        if item["type"] == "reasoning" and "reasoning.encrypted_content" in request.include:
            item["encrypted_content"] = seal_reasoning("".join(p["text"] for p in item["content"]))
        if item["type"] == "message" and "message.output_text.logprobs" in request.include:
            from chatenv.serve.chat.output import token_logprobs

            choice, top = done.choices[0], done.top[0] if done.top else None
            entries = token_logprobs(done.chat_tokenizer, choice.ids, choice.log_probs, top=top)
            item["content"][0]["logprobs"] = entries
    return items


def _reasoning_tokens(done: Completion) -> int:
    """Tokens of the reply's reasoning (up to its closing marker), where the template writes one."""
    choice = done.choices[0]
    if not choice.message.get("reasoning_content"):
        return 0
    ct = done.chat_tokenizer
    close = ct.closing_id()
    ids = choice.ids
    if close is not None and close in ids:
        return ids.index(close) + 1
    if not choice.message.get("content"):
        return len(ids)  # never closed: all of it is reasoning
    lo, hi = 0, len(ids)  # the fewest ids whose text closes the reasoning (closed stays closed as ids grow)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ct.reasoning_closed(ids[:mid]) else (mid + 1, hi)
    return lo


#: per item type with text: its content part's type and its text events' prefix
_PARTS = {
    "message": ("output_text", "response.output_text"),
    "reasoning": ("reasoning_text", "response.reasoning_text"),
}


def _part(kind: str, text: str) -> dict[str, Any]:
    return _text_part(text) if kind == "message" else {"type": "reasoning_text", "text": text}


def _item_events(emit: Callable[..., str], index: int, item: dict[str, Any], opened: bool = False) -> Iterator[str]:
    """The events that build one output item: added, its text or arguments, done (``opened``: added already)."""
    where = {"item_id": item["id"], "output_index": index}
    if item["type"] == "function_call":
        yield emit("response.output_item.added", output_index=index, item={**item, "arguments": ""})
        yield emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
        yield emit("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
    else:
        kind, events = _PARTS[item["type"]]
        extra: dict[str, Any] = {"logprobs": []} if kind == "output_text" else {}
        if not opened:
            yield emit("response.output_item.added", output_index=index, item={**item, "content": []})
        for k, part in enumerate(item["content"]):
            if not opened:
                yield emit("response.content_part.added", **where, content_index=k, part=_part(item["type"], ""))
                if part["text"]:
                    yield emit(f"{events}.delta", **where, content_index=k, delta=part["text"], **extra)
            yield emit(f"{events}.done", **where, content_index=k, text=part["text"], **extra)
            yield emit("response.content_part.done", **where, content_index=k, part=part)
    yield emit("response.output_item.done", output_index=index, item=item)


class ResponsesStreamWriter:
    """A streaming Responses reply: its reasoning and message text as generated, then the calls and the result.

    Args:
        request: The parsed request.
    """

    def __init__(self, request: ResponsesRequest):
        self.request = request
        self.id, self.created = _id("resp"), int(time.time())
        self.ids = {"reasoning": _id("rs"), "message": _id("msg")}
        self.numbers = itertools.count()
        self.reply: LiveReply | None = None
        self.open: str | None = None  # the item whose text is streaming ("reasoning" or "message")
        self.done: list[str] = []  # items streamed and finished, in order
        self.index = -1

    def _emit(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(self.numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self, live: LiveCompletion) -> list[str]:  # noqa: D102
        self.reply = LiveReply(live.chat_tokenizer, self.request.chat)
        head = _head(self.request, self.id, self.created)
        return [self._emit("response.created", response=head), self._emit("response.in_progress", response=head)]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.ids[self.open], "output_index": self.index}

    def _piece(self, kind: str, piece: str) -> list[str]:
        """A piece of the reasoning or message text (its item added first, the other one finished)."""
        out = []
        if self.open != kind:
            out += self._close_reasoning() if self.open == "reasoning" else []
            self.open, self.index = kind, self.index + 1
            item = {"id": self.ids[kind], "type": kind, "status": "in_progress", "content": []}
            if kind == "message":
                item["role"] = "assistant"
            else:
                item["summary"] = []
            out.append(self._emit("response.output_item.added", output_index=self.index, item=item))
            part = _part(kind, "")
            out.append(self._emit("response.content_part.added", **self._where(), content_index=0, part=part))
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        event = _PARTS[kind][1] + ".delta"
        return [*out, self._emit(event, **self._where(), content_index=0, delta=piece, **extra)]

    def _close_reasoning(self) -> list[str]:
        """The streamed reasoning item's end (the content has begun: the reasoning is complete)."""
        assert self.reply is not None
        item = _reasoning_item(self.ids["reasoning"], self.reply.sent_reasoning, "completed")
        self.done.append("reasoning")
        return list(_item_events(self._emit, self.index, item, opened=True))

    def delta(self, index: int, ids: list[int], log_probs: list[float] | None) -> list[str]:  # noqa: D102
        assert self.reply is not None
        thought, piece = self.reply.feed_parts(ids)
        out = self._piece("reasoning", thought) if thought else []
        return out + self._piece("message", piece) if piece else out

    def finish(self, done: Completion) -> list[str]:  # noqa: D102
        assert self.reply is not None
        ids = self.ids
        body = response_body(self.request, done, self.id, ids["message"], self.created, ids["reasoning"])
        out: list[str] = []
        choice = done.choices[0]
        for index, item in enumerate(body["output"]):
            kind = item["type"]
            if kind in self.done:  # streamed and finished already: it must be what the reply says
                self.reply.finish_reasoning(choice)
                continue
            opened = kind == self.open
            if opened:
                rest = (
                    self.reply.finish_reasoning(choice)
                    if kind == "reasoning"
                    else self.reply.finish(choice, item["content"][0]["text"])
                )
                out += self._piece(kind, rest) if rest else []
            out += _item_events(self._emit, index, item, opened)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [*out, self._emit(kind, response=body)]

    def error(self, error: APIError) -> list[str]:  # noqa: D102
        return [self._emit("error", code=error.code, message=error.message, param=error.param)]
