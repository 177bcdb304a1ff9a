"""Anthropic Messages API replies: the ``message`` body, its streaming events (fed token by token) and errors.

The output side of :mod:`chatenv.serve.anthropic.request`. A streaming reply's text goes out as the policy generates it
(:class:`MessagesStreamWriter`, driven by :func:`chatenv.serve.streaming.sse`); its tool calls, stop reason and
usage once it is complete. Joined, the events give the non-streaming ``message``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.request import ChatRequest
from chatenv.serve.service import Completion
from chatenv.serve.streaming import LiveCompletion, LiveReply

__all__ = ["EventWriter", "MessagesStreamWriter", "anthropic_error", "message_body"]

#: the error type Anthropic's API gives each status
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
#: how a reply finished, as Anthropic names it
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def anthropic_error(error: APIError) -> dict[str, Any]:
    """Anthropic's error body for a refusal: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message}}


def _stop(done: Completion, request: ChatRequest) -> tuple[str, str | None]:
    """Anthropic's stop reason of the reply, and the stop sequence that ended it (if one did)."""
    choice = done.choices[0]
    if choice.stop_string is not None:
        return "stop_sequence", choice.stop_string
    return _STOP_REASONS.get(choice.finish_reason, "end_turn"), None


def message_body(done: Completion, request: ChatRequest, message_id: str | None = None) -> dict[str, Any]:
    """The ``message`` object of a served request (its one reply as thinking, text and tool_use blocks)."""
    choice = done.choices[0]
    message = choice.message
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": function["name"], "input": function["arguments"]})
    stop_reason, stop_sequence = _stop(done, request)
    return {
        "id": message_id or f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": request.model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": done.prompt_tokens, "output_tokens": len(choice.ids)},
    }


class EventWriter:
    """Anthropic's streaming events for one message, fed block by block (or token by token) as the reply comes.

    Call :meth:`start` first, then :meth:`text`, :meth:`thinking` or :meth:`tool_use` per piece (a new block opens
    when the kind changes; each tool call is its own block), then :meth:`finish`. Each call returns the SSE lines.
    """

    def __init__(self, message: Mapping[str, Any]):
        self.head = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
        self.head["usage"] = {**message["usage"], "output_tokens": 0}
        self.index = -1
        self.open: str | None = None

    @staticmethod
    def event(kind: str, data: Mapping[str, Any]) -> str:
        """One server-sent event."""
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        """``message_start``: the message without content."""
        return [self.event("message_start", {"message": self.head})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", {"index": self.index})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = kind
        return [*out, self.event("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return self.event("content_block_delta", {"index": self.index, "delta": delta})

    def text(self, piece: str) -> list[str]:
        """A piece of the reply's text."""
        out = [] if self.open == "text" else self._open("text", {"type": "text", "text": ""})
        return [*out, self._delta({"type": "text_delta", "text": piece})]

    def thinking(self, piece: str) -> list[str]:
        """A piece of the reply's reasoning."""
        out = (
            []
            if self.open == "thinking"
            else self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        )
        return [*out, self._delta({"type": "thinking_delta", "thinking": piece})]

    def tool_use(self, call_id: str, name: str, arguments: Mapping[str, Any]) -> list[str]:
        """A whole tool call: its block, its input as one JSON delta, its end."""
        out = self._open("tool_use", {"type": "tool_use", "id": call_id, "name": name, "input": {}})
        out.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(arguments, ensure_ascii=False)}))
        return [*out, *self._close()]

    def finish(self, stop_reason: str, stop_sequence: str | None, output_tokens: int) -> list[str]:
        """The last block's end, ``message_delta`` (stop reason, usage) and ``message_stop``."""
        delta = {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}}
        usage = {"usage": {"output_tokens": output_tokens}}
        return [*self._close(), self.event("message_delta", {**delta, **usage}), self.event("message_stop", {})]


class MessagesStreamWriter:
    """A streaming Messages response: text blocks as the reply is generated, then its calls and stop reason.

    Args:
        request: The request (one reply).
    """

    def __init__(self, request: ChatRequest):
        self.request = request
        self.id = f"msg_{uuid.uuid4().hex}"
        self.events: EventWriter | None = None
        self.reply: LiveReply | None = None

    def start(self, live: LiveCompletion) -> list[str]:  # noqa: D102
        self.reply = LiveReply(live.chat_tokenizer, self.request)
        head = {"id": self.id, "type": "message", "role": "assistant", "model": self.request.model, "content": []}
        self.events = EventWriter({**head, "usage": {"input_tokens": live.prompt_tokens, "output_tokens": 0}})
        return self.events.start()

    def delta(self, index: int, ids: list[int], log_probs: list[float] | None) -> list[str]:  # noqa: D102
        assert self.reply is not None and self.events is not None
        thought, piece = self.reply.feed_parts(ids)
        out = self.events.thinking(thought) if thought else []
        return out + self.events.text(piece) if piece else out

    def finish(self, done: Completion) -> list[str]:  # noqa: D102
        assert self.reply is not None and self.events is not None
        body = message_body(done, self.request, self.id)
        out: list[str] = []
        for block in body["content"]:
            if block["type"] == "text":
                rest = self.reply.finish(done.choices[0], block["text"])
                out += self.events.text(rest) if rest else []
            elif block["type"] == "thinking":
                rest = self.reply.finish_reasoning(done.choices[0])
                out += self.events.thinking(rest) if rest else []
            else:
                out += self.events.tool_use(block["id"], block["name"], block["input"])
        return out + self.events.finish(body["stop_reason"], body["stop_sequence"], body["usage"]["output_tokens"])

    def error(self, error: APIError) -> list[str]:  # noqa: D102
        return [EventWriter.event("error", {"error": anthropic_error(error)["error"]})]
