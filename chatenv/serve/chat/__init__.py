"""OpenAI's Chat Completions dialect: ``POST /v1/chat/completions`` (:mod:`.request`, :mod:`.output`)."""

from __future__ import annotations

from typing import Any

from chatenv.serve.chat.output import ChatStreamWriter, completion_body
from chatenv.serve.chat.request import parse_request
from chatenv.serve.dialect import Dialect
from chatenv.serve.request import ChatRequest
from chatenv.serve.tokens.extras import with_token_ids

__all__ = ["DIALECT"]


def _body(req: ChatRequest, done: Any) -> dict[str, Any]:
    body = completion_body(
        done.meta,
        done.chat_tokenizer,
        done.choices,
        done.prompt_tokens,
        req.logprobs,
        as_ids=req.tokens_as_ids,
        top=done.top,
    )
    return with_token_ids(body, req, done.choices)


def _same(req: ChatRequest) -> ChatRequest:
    return req


DIALECT = Dialect("chat", ("/v1/chat/completions",), parse_request, _same, _body, ChatStreamWriter, user_field="'user'")
