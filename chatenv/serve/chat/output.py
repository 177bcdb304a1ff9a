"""Chat Completions replies: the ``chat.completion`` body and its streaming chunks, fed token by token.

A streaming response (:class:`ChatStreamWriter`, driven by :func:`chatenv.serve.streaming.sse`) sends each choice's
role, then its reasoning (``reasoning_content``, where the template writes one) and content as the policy generates
them (only text no later token can change: see :class:`~chatenv.serve.streaming.LiveReply`), each content chunk
with the log-probs of the tokens generated since the previous one where the policy reports them while generating;
once the reply is complete, the rest of its content, its tool calls and its finish reason with the remaining
log-probs. Joined, the chunks give the non-streaming response.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.messages import api_message
from chatenv.serve.request import ChatRequest
from chatenv.serve.service import Completion
from chatenv.serve.sessions import Choice
from chatenv.serve.streaming import LiveCompletion, LiveReply
from chatenv.serve.tokens.extras import token_label
from chatenv.tokenization import ChatTokenizer

__all__ = ["ChatStreamWriter", "completion_body", "token_logprobs"]


def token_logprobs(
    ct: ChatTokenizer,
    ids: Sequence[int],
    log_probs: Sequence[float],
    as_ids: bool = False,
    top: Sequence[Sequence[tuple[int, float]]] | None = None,
) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` entries: one per generated token, the end-of-turn token included.

    ``as_ids``: each token written as ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``). ``top``: per token,
    the policy's most likely tokens (``top_logprobs``; those the distribution excludes are left out).
    """

    def entry(i: int, lp: float) -> dict[str, Any]:
        return {"token": token_label(i) if as_ids else ct.decode([i]), "logprob": _finite(lp), "bytes": None}

    alternatives = top if top is not None else [[]] * len(ids)
    return [
        {**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in alt if not math.isinf(v)]}
        for i, lp, alt in zip(ids, log_probs, alternatives)
    ]


def _finite(lp: float) -> float:
    return -9999.0 if math.isnan(lp) or lp == -math.inf else float(lp)


def _usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def completion_body(
    meta: dict[str, Any],
    ct: ChatTokenizer,
    choices: Sequence[Choice],
    prompt_tokens: int,
    logprobs: bool,
    *,
    as_ids: bool = False,
    top: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """The ``chat.completion`` object of a non-streaming response (``meta``: id, created, model).

    ``as_ids``: log-prob tokens written as ``token_id:<id>``. ``top``: per choice, its top log-probs (or None).
    """
    tops = list(top or []) + [None] * (len(choices) - len(top or []))
    return {
        **meta,
        "object": "chat.completion",
        "system_fingerprint": None,
        "choices": [
            {
                "index": k,
                "message": api_message(c.message),
                "finish_reason": c.finish_reason,
                "logprobs": {"content": token_logprobs(ct, c.ids, c.log_probs, as_ids, tops[k]), "refusal": None}
                if logprobs
                else None,
            }
            for k, c in enumerate(choices)
        ],
        "usage": _usage(prompt_tokens, choices),
    }


class ChatStreamWriter:
    """A streaming chat completion: ``chat.completion.chunk`` events as the replies are generated, ``[DONE]`` last.

    Args:
        request: The request (``n`` replies; log-probs and usage asked for or not).
    """

    def __init__(self, request: ChatRequest):
        self.request = request
        self.meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": request.model}
        self.ct: ChatTokenizer | None = None
        self.replies: list[LiveReply] = []
        self.pending: list[list[dict[str, Any]]] = []  # log-prob entries not sent yet, per reply
        self.sent: list[int] = []  # log-prob entries sent, per reply

    def _event(self, index: int | None, delta: dict[str, Any] | None, **extra: Any) -> str:
        chunk: dict[str, Any] = {**self.meta, "object": "chat.completion.chunk", "system_fingerprint": None}
        chunk["choices"] = []
        if index is not None:
            choice = {"index": index, "delta": delta, "finish_reason": extra.pop("finish_reason", None)}
            choice["logprobs"] = extra.pop("logprobs", None)
            chunk["choices"] = [choice]
        if self.request.include_usage:
            chunk["usage"] = extra.pop("usage", None)
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def start(self, live: LiveCompletion) -> list[str]:  # noqa: D102
        self.ct = live.chat_tokenizer
        n = self.request.n
        self.replies = [LiveReply(self.ct, self.request) for _ in range(n)]
        self.pending, self.sent = [[] for _ in range(n)], [0] * n
        self.prompt_tokens = live.prompt_tokens
        return [self._event(k, {"role": "assistant", "content": ""}) for k in range(n)]

    def delta(self, index: int, ids: list[int], log_probs: list[float] | None) -> list[str]:  # noqa: D102
        assert self.ct is not None
        if self.request.logprobs and log_probs is not None and not self.request.settings.top_logprobs:
            # (with top_logprobs every entry comes with the last chunk: the alternatives arrive with the reply)
            self.pending[index] += token_logprobs(self.ct, ids, log_probs, self.request.tokens_as_ids)
        thought, piece = self.replies[index].feed_parts(ids)
        out = [self._event(index, {"reasoning_content": thought})] if thought else []
        if not piece:
            return out
        lp = None
        if self.request.logprobs:
            lp = {"content": self.pending[index], "refusal": None}
            self.sent[index] += len(self.pending[index])
            self.pending[index] = []
        return [*out, self._event(index, {"content": piece}, logprobs=lp)]

    def finish(self, done: Completion) -> list[str]:  # noqa: D102
        assert self.ct is not None
        out = []
        for k, c in enumerate(done.choices):
            message = api_message(c.message)
            thought = self.replies[k].finish_reasoning(c)
            if thought:
                out.append(self._event(k, {"reasoning_content": thought}))
            rest = self.replies[k].finish(c, message["content"] or "")
            if rest:
                out.append(
                    self._event(
                        k,
                        {"content": rest},
                        logprobs={"content": [], "refusal": None} if self.request.logprobs else None,
                    )
                )
            if message.get("tool_calls"):
                calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
                out.append(self._event(k, {"tool_calls": calls}))
            lp = None
            if self.request.logprobs:
                top = done.top[k] if k < len(done.top) else None
                entries = token_logprobs(self.ct, c.ids, c.log_probs, self.request.tokens_as_ids, top)
                lp = {"content": entries[self.sent[k] :], "refusal": None}
            out.append(self._event(k, {}, finish_reason=c.finish_reason, logprobs=lp))
        if self.request.include_usage:
            out.append(self._event(None, None, usage=_usage(self.prompt_tokens, done.choices)))
        return [*out, "data: [DONE]\n\n"]

    def error(self, error: APIError) -> list[str]:  # noqa: D102
        return [f"data: {json.dumps(error.body(), ensure_ascii=False)}\n\n", "data: [DONE]\n\n"]
