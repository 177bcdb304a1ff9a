"""A chat-completions request body, checked: what is supported, what is refused, nothing silently dropped.

Supported: ``model``, ``messages``, ``tools``, ``tool_choice`` (``auto`` / ``none``), ``n``, ``temperature``,
``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs``, ``stream`` (with
``stream_options.include_usage``), ``user`` (the session id when no header names one), ``presence_penalty`` and
``frequency_penalty`` (where the policy's backend has them), and the extras vLLM's server takes: ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``. Fields that only restate a default (``logit_bias: {}``,
``response_format: {"type": "text"}``, ``parallel_tool_calls: true``, ``store: false``, ...) are accepted; any
other value of them, and any unknown field, is refused with ``unsupported_parameter``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.messages import chat_messages, check_tools

__all__ = ["ChatRequest", "parse_request"]

#: fields accepted when they hold one of these values (they then change nothing)
_DEFAULT_ONLY: dict[str, tuple] = {
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None, True),
    "store": (None, False),
    "metadata": (None,),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "top_logprobs": (None, 0),
    "reasoning_effort": (None,),
    "prediction": (None,),
    "audio": (None,),
    "functions": (None, []),
    "function_call": (None,),
}
_HANDLED = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "n",
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "logprobs",
    "stream",
    "stream_options",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
}


@dataclass
class ChatRequest:
    """A checked chat-completions request.

    Attributes:
        model: The model asked for.
        messages: The messages, as chatenv messages.
        tools: Tool schemas (None: no tools).
        parse_tools: Whether replies are read for tool calls (tools given and ``tool_choice`` is not ``none``).
        n: Replies to generate.
        stream: Answer as server-sent events.
        include_usage: Send a last chunk with the token counts (streaming).
        logprobs: Return each generated token's log-prob.
        max_tokens: The most tokens per reply, if given.
        stop: Strings that end a reply (cut from the returned content, kept in the recorded ids).
        seed: Sampling seed (the same seed and prompt give the same replies).
        user: The ``user`` field (a session id when no header names one).
        generate_kwargs: The policy's generation settings this request sets (max tokens are added later).
    """

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    user: str | None = None
    generate_kwargs: dict[str, Any] = field(default_factory=dict)


def _number(body: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(f"'{name}' must be a number, got {value!r}", param=name)
    if value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise APIError(f"'{name}' must be in {bound}, got {value}", param=name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise APIError(f"'{name}' must be an integer, got {value!r}", param=name)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise APIError(f"'{name}' must be {bound}, got {value}", param=name)
    return value


def _flag(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(f"'{name}' must be true or false, got {value!r}", param=name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else ([] if value is None else value)
    if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise APIError("'stop' must be a non-empty string or a list of at most 4 of them", param="stop")
    return tuple(stops)


def _check_fields(body: Mapping[str, Any]) -> None:
    unknown = sorted(k for k in body if k not in _HANDLED and k not in _DEFAULT_ONLY)
    if unknown:
        raise APIError(f"unsupported parameters: {unknown}", param=unknown[0], code="unsupported_parameter")
    for name, allowed in _DEFAULT_ONLY.items():
        if name in body and body[name] not in allowed:
            raise APIError(
                f"'{name}'={body[name]!r} is not supported by this endpoint (it samples the policy as is)",
                param=name,
                code="unsupported_parameter",
            )


def _tool_choice(body: Mapping[str, Any], tools: list | None) -> bool:
    """Whether replies are read for tool calls."""
    choice = body.get("tool_choice")
    if choice in (None, "auto"):
        return tools is not None
    if choice == "none":
        return False
    raise APIError(
        f"tool_choice={choice!r} is not supported: the endpoint samples the model without constrained decoding, so "
        "it cannot force a call; use 'auto' or 'none'",
        param="tool_choice",
        code="unsupported_parameter",
    )


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request's generation settings under the policy's names (only those the request sets)."""
    checks = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, low_open=True),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
        "top_k": _integer(body, "top_k", -1),
        "min_p": _number(body, "min_p", 0.0, 1.0),
        "repetition_penalty": _number(body, "repetition_penalty", 0.0, 10.0, low_open=True),
        "min_new_tokens": _integer(body, "min_tokens", 0),
    }
    out = {k: v for k, v in checks.items() if v is not None}
    for name in ("presence_penalty", "frequency_penalty"):
        if out.get(name) == 0.0:
            del out[name]  # the default: a backend without the setting is not asked for it
    return out


def parse_request(body: Any) -> ChatRequest:
    """Check a chat-completions body.

    Raises:
        APIError: For a body that is not an object, a missing or bad field, or an unsupported one.
    """
    if not isinstance(body, Mapping):
        raise APIError("the request body must be a JSON object")
    _check_fields(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError("'model' is required (a string; GET /v1/models lists them)", param="model")
    messages = chat_messages(body.get("messages"))
    tools = check_tools(body.get("tools"))
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
        raise APIError("'stream_options' may only hold 'include_usage'", param="stream_options")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError("'user' must be a string", param="user")
    return ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        parse_tools=_tool_choice(body, tools),
        n=_integer(body, "n", 1, 16) or 1,
        stream=_flag(body, "stream"),
        include_usage=bool(options.get("include_usage")),
        logprobs=_flag(body, "logprobs"),
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        seed=_integer(body, "seed", 0),
        user=user or None,
        generate_kwargs=_sampling(body),
    )
