"""Anthropic's Messages dialect: ``POST /v1/messages`` (request: :mod:`.request`; replies, errors: :mod:`.output`).

``POST /v1/messages/count_tokens`` counts a request's prompt (registered by the app beside the dialect's route).
"""

from __future__ import annotations

from typing import Any

from chatenv.serve.anthropic.output import MessagesStreamWriter, anthropic_error, message_body
from chatenv.serve.anthropic.request import parse_count_request, parse_messages_request
from chatenv.serve.dialect import Dialect
from chatenv.serve.request import ChatRequest

__all__ = ["DIALECT", "anthropic_error", "parse_count_request"]


def _same(req: ChatRequest) -> ChatRequest:
    return req


def _body(req: ChatRequest, done: Any) -> dict[str, Any]:
    return message_body(done, req)


DIALECT = Dialect(
    "anthropic",
    ("/v1/messages",),
    parse_messages_request,
    _same,
    _body,
    MessagesStreamWriter,
    user_field="metadata.user_id",
    error=anthropic_error,
)
