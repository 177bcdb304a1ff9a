"""The Chat Completions dialect's request: a chat-completions body, checked: what is supported, what is refused.

Supported: ``model``, ``messages``, ``tools``, ``tool_choice`` (``auto``, ``none``, and by constrained decoding
``required`` or a named function), ``parallel_tool_calls`` (false: a reply ends after its first call),
``n``, ``temperature``, ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs``
(with ``top_logprobs``: the policy's top-k), ``reasoning_effort`` and vLLM's ``chat_template_kwargs`` (the
template's switches, :mod:`chatenv.serve.switches`), ``store`` (nothing is stored), ``stream`` (with
``stream_options.include_usage``), ``user`` (the session id when no header names one), ``presence_penalty`` and
``frequency_penalty`` (where the policy's backend has them), and the extras vLLM's server takes: ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, and its token extras ``return_token_ids``,
``return_tokens_as_token_ids``, ``skip_special_tokens`` (:mod:`chatenv.serve.tokens.extras`). Fields that only
restate a default (``logit_bias: {}``,
``response_format: {"type": "text"}``, ``metadata: null``, ...) are accepted; any other
value of them, and any unknown field, is refused with ``unsupported_parameter``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.messages import chat_messages, check_tools
from chatenv.serve.request import (
    SAMPLING_FIELDS,
    ChatRequest,
    flag,
    forced_tools,
    reasoning_effort,
    request_model,
    sampling_settings,
    switches,
    tool_choice,
)
from chatenv.serve.tokens.extras import TOKEN_FIELDS, token_extras

__all__ = ["parse_request"]

#: fields accepted when they hold one of these values (they then change nothing)
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "store": (None, False, True),  # nothing is stored either way; the reply is the same
    "metadata": (None,),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "audio": (None,),
    "functions": (None, []),
    "function_call": (None,),
}
_HANDLED = (
    {"model", "messages", "tools", "tool_choice", "logprobs", "stream", "stream_options", "user"}
    | {"parallel_tool_calls", "reasoning_effort", "chat_template_kwargs"}
    | set(SAMPLING_FIELDS)
    | TOKEN_FIELDS
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
    if body.get("top_logprobs") and not flag(body, "logprobs"):
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    request = ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        parse_tools=tool_choice(body, tools),
        settings=sampling_settings(body),
        stream=flag(body, "stream"),
        include_usage=bool(options.get("include_usage")),
        logprobs=flag(body, "logprobs"),
        user=user or None,
        forced_tools=forced_tools(body.get("tool_choice"), tools),
        reasoning_effort=reasoning_effort(body.get("reasoning_effort")),
        **switches(body),
    )
    return token_extras(body, request)
