"""Generated ids into replies: the assistant message (tool calls read from the ids), and the API's response bodies.

The message of a reply comes from its ids (:meth:`~chatenv.tokenization.ChatTokenizer.parse_tool_calls`): a
complete reply whose calls are exactly as the template writes them becomes ``content`` + ``tool_calls``; anything
else keeps its text. A stop string cuts the returned content (the recorded ids keep every generated token).

Streaming sends the same reply as chunks: the content a few tokens at a time (split where the ids decode to whole
characters), each chunk with the log-probs of its tokens, then the tool calls, then the finish reason with the
remaining log-probs; joined, the chunks give the non-streaming response.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

from chatenv.serve.engine import Generated
from chatenv.serve.messages import api_message
from chatenv.serve.params import ChatRequest
from chatenv.serve.sessions import Choice
from chatenv.tokenization import ChatTokenizer

__all__ = ["completion_body", "make_choice", "stream_chunks", "token_logprobs"]


def make_choice(ct: ChatTokenizer, gen: Generated, request: ChatRequest, call_prefix: str) -> Choice:
    """The reply that generated ids spell, with how it finished (``stop``, ``length`` or ``tool_calls``)."""
    ids = gen.ids
    end, complete = ct.reply_end(ids)
    reply_ids = ids if end is None else ids[:end]
    text = ct.decode(reply_ids)
    cut = min((p for p in (text.find(s) for s in request.stop) if p >= 0), default=None)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = "stop" if end is not None else "length"
    if cut is not None and end is None:
        message["content"], finish = text[:cut], "stop"
    elif complete and request.parse_tools:
        parsed = ct.parse_tool_calls(reply_ids, id_prefix=call_prefix)
        if parsed.items and parsed.canonical:
            message = {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": [c.to_message() for c in parsed.calls],
            }
            finish = "tool_calls"
    return Choice(list(ids), list(gen.log_probs), message, complete, finish, gen.version)


def token_logprobs(ct: ChatTokenizer, ids: Sequence[int], log_probs: Sequence[float]) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` entries: one per generated token, the end-of-turn token included."""
    return [
        {
            "token": ct.decode([i]),
            "logprob": -9999.0 if math.isnan(lp) else float(lp),
            "bytes": None,
            "top_logprobs": [],
        }
        for i, lp in zip(ids, log_probs)
    ]


def _usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict[str, int]:
    completion = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def completion_body(
    meta: dict[str, Any], ct: ChatTokenizer, choices: Sequence[Choice], prompt_tokens: int, logprobs: bool
) -> dict[str, Any]:
    """The ``chat.completion`` object of a non-streaming response (``meta``: id, created, model)."""
    return {
        **meta,
        "object": "chat.completion",
        "system_fingerprint": None,
        "choices": [
            {
                "index": k,
                "message": api_message(c.message),
                "finish_reason": c.finish_reason,
                "logprobs": {"content": token_logprobs(ct, c.ids, c.log_probs), "refusal": None} if logprobs else None,
            }
            for k, c in enumerate(choices)
        ],
        "usage": _usage(prompt_tokens, choices),
    }


def _pieces(ct: ChatTokenizer, ids: Sequence[int]) -> list[tuple[str, int]]:
    """The ids' text in pieces that end on whole characters, with how many ids each piece took."""
    out: list[tuple[str, int]] = []
    start = 0
    for k in range(1, len(ids) + 1):
        text = ct.decode(ids[start:k])
        if text.endswith("\ufffd") and k < len(ids):
            continue  # a character split across tokens: wait for the rest of it
        out.append((text, k - start))
        start = k
    return out


def _content_pieces(ct: ChatTokenizer, c: Choice) -> list[tuple[str, int]]:
    """The returned content as pieces aligned with the ids where it is a prefix of their text, else one piece."""
    content = c.message.get("content") or ""
    if c.message.get("tool_calls"):
        return [(content, 0)] if content else []
    out, pos = [], 0
    for text, n in _pieces(ct, c.ids):
        if pos >= len(content):
            break
        take = text[: len(content) - pos]
        if content[pos : pos + len(take)] != take:
            return [(content, 0)]
        out.append((take, n))
        pos += len(take)
    return out if pos == len(content) else [(content, 0)]


def _chunk(meta: dict[str, Any], index: int, delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
    choice = {"index": index, "delta": delta, "finish_reason": extra.pop("finish_reason", None)}
    choice["logprobs"] = extra.pop("logprobs", None)
    return {**meta, "object": "chat.completion.chunk", "system_fingerprint": None, "choices": [choice], **extra}


def _choice_chunks(
    meta: dict[str, Any], ct: ChatTokenizer, k: int, c: Choice, logprobs: bool
) -> Iterator[dict[str, Any]]:
    entries = token_logprobs(ct, c.ids, c.log_probs) if logprobs else []
    used = 0
    yield _chunk(meta, k, {"role": "assistant", "content": ""})
    for text, n in _content_pieces(ct, c):
        lp = {"content": entries[used : used + n], "refusal": None} if logprobs else None
        used += n
        yield _chunk(meta, k, {"content": text}, logprobs=lp)
    calls = api_message(c.message).get("tool_calls")
    if calls:
        yield _chunk(meta, k, {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]})
    rest = {"content": entries[used:], "refusal": None} if logprobs else None
    yield _chunk(meta, k, {}, finish_reason=c.finish_reason, logprobs=rest)


def stream_chunks(
    meta: dict[str, Any],
    ct: ChatTokenizer,
    choices: Sequence[Choice],
    prompt_tokens: int,
    request: ChatRequest,
) -> Iterator[str]:
    """The server-sent events of a streaming response, ``data: [DONE]`` last."""
    for k, c in enumerate(choices):
        for chunk in _choice_chunks(meta, ct, k, c, request.logprobs):
            if request.include_usage:
                chunk["usage"] = None
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
    if request.include_usage:
        usage = {**meta, "object": "chat.completion.chunk", "choices": [], "usage": _usage(prompt_tokens, choices)}
        yield f"data: {json.dumps(usage, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
