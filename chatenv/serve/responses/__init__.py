"""OpenAI's Responses dialect: ``POST /v1/responses`` (request in :mod:`.request`, replies in :mod:`.output`)."""

from __future__ import annotations

from typing import Any

from chatenv.serve.dialect import Dialect
from chatenv.serve.request import ChatRequest
from chatenv.serve.responses.output import ResponsesRequest, ResponsesStreamWriter, response_body
from chatenv.serve.responses.request import parse_responses_request

__all__ = ["DIALECT"]


def _chat(parsed: ResponsesRequest) -> ChatRequest:
    return parsed.chat


def _body(parsed: ResponsesRequest, done: Any) -> dict[str, Any]:
    return response_body(parsed, done)


DIALECT = Dialect(
    "responses", ("/v1/responses",), parse_responses_request, _chat, _body, ResponsesStreamWriter, user_field="'user'"
)
