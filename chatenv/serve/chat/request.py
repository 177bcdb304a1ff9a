"""The Chat Completions dialect's request: a chat-completions body, checked: what is supported, what is refused.

Supported: ``model``, ``messages``, ``tools``, ``tool_choice`` (``auto`` / ``none``), ``n``, ``temperature``,
``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs``, ``stream`` (with
``stream_options.include_usage``), ``user`` (the session id when no header names one), ``presence_penalty`` and
``frequency_penalty`` (where the policy's backend has them), and the extras vLLM's server takes: ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``. Fields that only restate a default (``logit_bias: {}``,
``response_format: {"type": "text"}``, ``parallel_tool_calls: true``, ``store: false``, ...) are accepted; any other
value of them, and any unknown field, is refused with ``unsupported_parameter``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.messages import chat_messages, check_tools
from chatenv.serve.request import SAMPLING_FIELDS, ChatRequest, flag, request_model, sampling_settings, tool_choice

__all__ = ["parse_request"]

#: fields accepted when they hold one of these values (they then change nothing)
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
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
_HANDLED = {"model", "messages", "tools", "tool_choice", "logprobs", "stream", "stream_options", "user"} | set(
    SAMPLING_FIELDS
)


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


def parse_request(body: Any) -> ChatRequest:
    """Check a chat-completions body.

    Raises:
        APIError: For a body that is not an object, a missing or bad field, or an unsupported one.
    """
    model = request_model(body, _check_fields)
    messages = chat_messages(body.get("messages"))
    tools = check_tools(body.get("tools"))
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
        parse_tools=tool_choice(body, tools),
        settings=sampling_settings(body),
        stream=flag(body, "stream"),
        include_usage=bool(options.get("include_usage")),
        logprobs=flag(body, "logprobs"),
        user=user or None,
    )
