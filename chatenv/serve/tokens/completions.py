"""``POST /v1/completions`` on prompt ids (or prompt text): vLLM's completions route, read as chats.

RL stacks that sample with token ids post them as the ``prompt`` of a completions request (one list of ids, or a
batch of them, as SkyRL's remote vLLM engine does), the sampling settings at the top level with vLLM's extras. Each
prompt is a chat the policy's template wrote, up to its generation prompt (read from the ids as on
``/inference/v1/generate``, :func:`~chatenv.serve.tokens.prompt.chat_of_ids`, and then required to equal the ids the
session plans), served as its own request in the request's session, concurrently. A refused prompt makes the
response the refusal; prompts of the batch already served stay recorded.

Supported: ``model``, ``prompt`` (ids, a batch of ids, a string or a list of strings: text is tokenized as vLLM does,
special tokens included), ``max_tokens``, ``n``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``user``,
``presence_penalty``, ``frequency_penalty``, ``logprobs`` (0: the sampled token's log-prob), vLLM's ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids`` (the template's end-of-reply ids only) and the
token extras (:mod:`chatenv.serve.tokens.extras`). Any other field, or another value of ``echo``, ``best_of``,
``suffix``, ``stream``, is refused naming it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.request import SAMPLING_FIELDS, ChatRequest, flag, request_model, sampling_settings
from chatenv.serve.sessions import Choice
from chatenv.serve.tokens.extras import TOKEN_FIELDS, token_label
from chatenv.serve.tokens.request import ids_field
from chatenv.tokenization import ChatTokenizer

__all__ = ["CompletionsRequest", "completions_body", "parse_completions"]

_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None,),
    "logit_bias": (None, {}),
    "stream_options": (None,),
    "include_stop_str_in_output": (None, False),
    "ignore_eos": (None, False),
    "prompt_logprobs": (None,),
    "add_special_tokens": (None, True),
}
_HANDLED = {"model", "prompt", "logprobs", "user", "stop_token_ids", *SAMPLING_FIELDS, *TOKEN_FIELDS} - {
    "max_completion_tokens",
    "top_logprobs",
}


@dataclass
class CompletionsRequest:
    """A checked completions request: its prompts (ids, or text to tokenize) and the chat request they share."""

    prompts: list[list[int] | str]
    request: ChatRequest
    stop_token_ids: list[int] = field(default_factory=list)

    def for_prompt(self, messages: list[dict[str, Any]], ids: list[int]) -> ChatRequest:
        """The chat request of one prompt (its chat read from its ids)."""
        r = self.request
        return ChatRequest(
            model=r.model,
            messages=messages,
            settings=r.settings,
            logprobs=r.logprobs,
            user=r.user,
            return_token_ids=True,
            tokens_as_ids=r.tokens_as_ids,
            prompt_ids=list(ids),
        )


def _check_fields(body: Mapping[str, Any]) -> None:
    unknown = sorted(k for k in body if k not in _HANDLED and k not in _DEFAULT_ONLY)
    if unknown:
        raise APIError(f"unsupported parameters: {unknown}", param=unknown[0], code="unsupported_parameter")
    for name, allowed in _DEFAULT_ONLY.items():
        if body.get(name) not in allowed:
            raise APIError(
                f"'{name}'={body[name]!r} is not supported by this endpoint (accepted: {list(allowed)})",
                param=name,
                code="unsupported_parameter",
            )
    if body.get("logprobs") not in (None, 0) or isinstance(body.get("logprobs"), bool):
        raise APIError(
            "'logprobs' may be 0 (each sampled token's log-prob) or left out: the endpoint writes no alternatives "
            "on this route",
            param="logprobs",
            code="unsupported_parameter",
        )


def _prompts(value: Any) -> list[list[int] | str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(p, list) for p in value):
        return [ids_field(p, f"prompt[{k}]") for k, p in enumerate(value)]
    return [ids_field(value, "prompt")]


def parse_completions(body: Any) -> CompletionsRequest:
    """Check a completions body.

    Raises:
        APIError: For a bad, missing or unsupported field (named).
    """
    model = request_model(body, _check_fields)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError("'user' must be a string", param="user")
    request = ChatRequest(
        model=model,
        messages=[],
        settings=sampling_settings(body),
        logprobs=body.get("logprobs") is not None,
        user=user or None,
        return_token_ids=flag(body, "return_token_ids"),
        tokens_as_ids=flag(body, "return_tokens_as_token_ids"),
    )
    flag(body, "skip_special_tokens")  # either value: see chatenv.serve.tokens.extras
    stops = ids_field(body.get("stop_token_ids"), "stop_token_ids", empty=True)
    return CompletionsRequest(_prompts(body.get("prompt")), request, stops)


def _text(ct: ChatTokenizer, choice: Choice) -> str:
    """A reply's text: its ids up to the end of the reply, cut at the stop string that ended it."""
    end, _ = ct.reply_end(choice.ids)
    text = ct.decode(choice.ids if end is None else choice.ids[:end])
    if choice.stop_string is not None and choice.stop_string in text:
        text = text[: text.find(choice.stop_string)]
    return text


def _logprobs(ct: ChatTokenizer, choice: Choice, as_ids: bool) -> dict[str, Any]:
    tokens = [token_label(i) if as_ids else ct.decode([i]) for i in choice.ids]
    lps = [-9999.0 if lp != lp else float(lp) for lp in choice.log_probs]  # NaN: none reported
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": [{t: lp} for t, lp in zip(tokens, lps)],
        "text_offset": offsets,
    }


def completions_body(parsed: CompletionsRequest, done: list[tuple[ChatRequest, Any]]) -> dict[str, Any]:
    """The ``text_completion`` reply of each prompt's served request and completion, in prompt order.

    Choice ``i * n + k`` is reply ``k`` of prompt ``i``.
    """
    req = parsed.request
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, (served, completion) in enumerate(done):
        ct = completion.chat_tokenizer
        prompt_tokens += completion.prompt_tokens
        for k, c in enumerate(completion.choices):
            completion_tokens += len(c.ids)
            entry: dict[str, Any] = {
                "index": i * req.n + k,
                "text": _text(ct, c),
                "logprobs": _logprobs(ct, c, req.tokens_as_ids) if req.logprobs else None,
                "finish_reason": "length" if c.finish_reason == "length" else "stop",
                "stop_reason": c.stop_string,
            }
            if req.return_token_ids:
                entry["prompt_token_ids"] = list(served.prompt_ids or [])
                entry["token_ids"] = list(c.ids)
            choices.append(entry)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
