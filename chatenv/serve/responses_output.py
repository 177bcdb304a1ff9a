"""Responses API replies: the ``response`` object and its streaming events, fed token by token.

The output side of :mod:`chatenv.serve.responses_api`. The ``output`` is an assistant ``message`` item
(``output_text``; left out when the reply only calls tools), then one ``function_call`` item per call. A streaming
response (:class:`ResponsesStreamWriter`, driven by :func:`chatenv.serve.streaming.sse`) sends ``response.created``
and ``response.in_progress``, then the message item's text as the policy generates it (only text no later token can
change: :class:`~chatenv.serve.streaming.LiveReply`), and once the reply is complete the rest of it, the function
calls and ``response.completed`` (``response.incomplete`` for a reply cut by its budget). Every event has its
``sequence_number``; joined, the events give the non-streaming response.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.messages import api_message
from chatenv.serve.params import ChatRequest
from chatenv.serve.service import Completion
from chatenv.serve.sessions import Choice
from chatenv.serve.streaming import LiveCompletion, LiveReply

__all__ = ["ResponsesRequest", "ResponsesStreamWriter", "output_items", "response_body"]


@dataclass
class ResponsesRequest:
    """A checked Responses request: the chat request it is served as, and what the response echoes.

    Attributes:
        chat: The request as the endpoint serves it.
        echo: The request's settings as the response object repeats them (instructions, tools, tool_choice, ...).
    """

    chat: ChatRequest
    echo: dict[str, Any] = field(default_factory=dict)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_items(choice: Choice, message_id: str | None = None) -> list[dict[str, Any]]:
    """A reply as output items: its message (unless it only calls tools), then its function calls."""
    message = api_message(choice.message)
    calls = message.get("tool_calls") or []
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
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
) -> dict[str, Any]:
    """The ``response`` object of a served request (its first reply)."""
    choice = done.choices[0]
    prompt, generated = done.prompt_tokens, len(choice.ids)
    cut = choice.finish_reason == "length"
    body = _head(request, response_id or _id("resp"), done.meta["created"] if created is None else created)
    body["status"] = "incomplete" if cut else "completed"
    body["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
    body["output"] = output_items(choice, message_id)
    body["usage"] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }
    return body


def _item_events(emit: Callable[..., str], index: int, item: dict[str, Any], opened: bool = False) -> Iterator[str]:
    """The events that build one output item: added, its text or arguments, done (``opened``: added already)."""
    where = {"item_id": item["id"], "output_index": index}
    if item["type"] == "function_call":
        yield emit("response.output_item.added", output_index=index, item={**item, "arguments": ""})
        yield emit("response.function_call_arguments.delta", **where, delta=item["arguments"])
        yield emit("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"])
    else:
        for k, part in enumerate(item["content"]):
            if not opened:
                yield emit("response.output_item.added", output_index=index, item={**item, "content": []})
                yield emit("response.content_part.added", **where, content_index=k, part=_text_part(""))
                if part["text"]:
                    yield emit("response.output_text.delta", **where, content_index=k, delta=part["text"], logprobs=[])
            yield emit("response.output_text.done", **where, content_index=k, text=part["text"], logprobs=[])
            yield emit("response.content_part.done", **where, content_index=k, part=part)
    yield emit("response.output_item.done", output_index=index, item=item)


class ResponsesStreamWriter:
    """A streaming Responses reply: the message item's text as it is generated, then the calls and the result.

    Args:
        request: The parsed request.
    """

    def __init__(self, request: ResponsesRequest):
        self.request = request
        self.id, self.message_id, self.created = _id("resp"), _id("msg"), int(time.time())
        self.numbers = itertools.count()
        self.reply: LiveReply | None = None
        self.opened = False  # the message item was added (its text is streaming)

    def _emit(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": next(self.numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def start(self, live: LiveCompletion) -> list[str]:  # noqa: D102
        self.reply = LiveReply(live.chat_tokenizer, self.request.chat)
        head = _head(self.request, self.id, self.created)
        return [self._emit("response.created", response=head), self._emit("response.in_progress", response=head)]

    def _text(self, piece: str) -> list[str]:
        where = {"item_id": self.message_id, "output_index": 0}
        out = []
        if not self.opened:
            self.opened = True
            item = {"id": self.message_id, "type": "message", "role": "assistant", "status": "in_progress"}
            out.append(self._emit("response.output_item.added", output_index=0, item={**item, "content": []}))
            out.append(self._emit("response.content_part.added", **where, content_index=0, part=_text_part("")))
        out.append(self._emit("response.output_text.delta", **where, content_index=0, delta=piece, logprobs=[]))
        return out

    def delta(self, index: int, ids: list[int], log_probs: list[float] | None) -> list[str]:  # noqa: D102
        assert self.reply is not None
        piece = self.reply.feed(ids)
        return self._text(piece) if piece else []

    def finish(self, done: Completion) -> list[str]:  # noqa: D102
        assert self.reply is not None
        body = response_body(self.request, done, self.id, self.message_id, self.created)
        out: list[str] = []
        for index, item in enumerate(body["output"]):
            opened = self.opened and item["type"] == "message"
            if opened:
                rest = self.reply.finish(done.choices[0], item["content"][0]["text"])
                out += self._text(rest) if rest else []
            out += _item_events(self._emit, index, item, opened)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [*out, self._emit(kind, response=body)]

    def error(self, error: APIError) -> list[str]:  # noqa: D102
        return [self._emit("error", code=error.code, message=error.message, param=error.param)]
