"""OpenAI chat messages and tools, to and from chatenv's messages.

Requests carry messages in OpenAI's form: ``content`` may be None or a list of text parts, an assistant message's
``tool_calls`` hold their arguments as a JSON *string*, ``developer`` is the newer name of ``system``. chatenv's
messages (:mod:`chatenv.messages`) hold content as a str and tool-call arguments as a dict, which is what the
templates render; an assistant message may carry the ``reasoning_content`` its reply was returned with (as vLLM
accepts it). :func:`chat_message` converts one request message (refusing what cannot be rendered),
:func:`api_message` converts a reply back, and :func:`message_key` compares messages semantically: the same role,
content, tool calls (name and arguments, whatever the JSON spelling) and tool-call id.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from chatenv.messages import check_message
from chatenv.serve.errors import APIError
from chatenv.templates.tool_calls import ToolCall, normalize_call

__all__ = ["api_message", "chat_message", "chat_messages", "check_tools", "message_key", "tools_key"]

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
#: keys a client may send that carry nothing to render when empty (refused when set)
_EMPTY_OK = ("refusal", "audio", "function_call", "annotations")


def _content(value: Any, where: str) -> str:
    """Message content as text: a str, None (no content) or a list of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        parts = []
        for k, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise APIError(
                    f"{where}.content[{k}]: only text parts are supported, got {kind!r}",
                    param=f"{where}.content",
                    code="unsupported_content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(f"{where}.content must be a string, null or a list of text parts", param=f"{where}.content")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool calls with their arguments as dicts (what templates render)."""
    if calls is None:
        return []
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise APIError(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for k, call in enumerate(calls):
        parsed = normalize_call(call, f"call_{k}")
        if not isinstance(parsed, ToolCall):
            raise APIError(f"{where}.tool_calls[{k}]: {parsed.reason}", param=f"{where}.tool_calls")
        if isinstance(call, Mapping) and call.get("type", "function") != "function":
            raise APIError(f"{where}.tool_calls[{k}]: only 'function' calls are supported", param=f"{where}.tool_calls")
        message = parsed.to_message()
        if not (isinstance(call, Mapping) and call.get("id")):
            message.pop("id")
        out.append(message)
    return out


def chat_message(message: Any, where: str = "messages[0]") -> dict[str, Any]:
    """One request message as a chatenv message.

    Raises:
        APIError: For a message that is not an object, an unknown role, non-text content, unreadable tool calls or
            keys this endpoint cannot render.
    """
    if not isinstance(message, Mapping):
        raise APIError(f"{where} must be an object with 'role' and 'content'", param=where)
    given_role = message.get("role")
    role = _ROLES.get(given_role) if isinstance(given_role, str) else None
    if role is None:
        raise APIError(
            f"{where}.role {message.get('role')!r} is not supported (system, developer, user, assistant, tool)",
            param=f"{where}.role",
        )
    known = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", *_EMPTY_OK}
    unknown = sorted(str(k) for k in message if k not in known)
    set_but_empty_ok = sorted(k for k in _EMPTY_OK if message.get(k) not in (None, [], ""))
    if unknown or set_but_empty_ok:
        bad = unknown + set_but_empty_ok
        raise APIError(f"{where}: unsupported message fields {bad}", param=where, code="unsupported_parameter")
    out: dict[str, Any] = {"role": role, "content": _content(message.get("content"), where)}
    reasoning = message.get("reasoning_content")
    if reasoning not in (None, "") and (role != "assistant" or not isinstance(reasoning, str)):
        raise APIError(f"{where}.reasoning_content: only an assistant message's, a string", param=where)
    if reasoning:  # the reasoning a reply was returned with (the template renders it where it writes reasoning)
        out["reasoning_content"] = reasoning
    if role == "assistant":
        calls = _tool_calls(message.get("tool_calls"), where)
        if calls:
            out["tool_calls"] = calls
    elif message.get("tool_calls"):
        raise APIError(f"{where}: only assistant messages carry tool_calls", param=f"{where}.tool_calls")
    if role == "tool" and message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("name") is not None:
        out["name"] = message["name"]
    try:
        return check_message(out, where)
    except (TypeError, ValueError) as e:
        raise APIError(str(e), param=where) from None


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """A request's ``messages`` as chatenv messages (a non-empty list).

    Raises:
        APIError: For anything but a non-empty list of convertible messages.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise APIError("'messages' must be a non-empty list of message objects", param="messages")
    return [chat_message(m, f"messages[{k}]") for k, m in enumerate(messages)]


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A request's ``tools`` as the function schemas templates render (None for no tools).

    Raises:
        APIError: For tools that are not ``{"type": "function", "function": {"name": ..., ...}}`` objects.
    """
    if tools is None or tools == []:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)):
        raise APIError("'tools' must be a list of function tools", param="tools")
    out = []
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise APIError(f"tools[{k}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"tools[{k}].function.name must be a non-empty string", param="tools")
        out.append({"type": "function", "function": dict(fn)})
    return out


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """A canonical text of a tool list (two requests render the same tools exactly when their keys are equal)."""
    return json.dumps(tools or [], sort_keys=True, ensure_ascii=False)


def message_key(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What makes two messages the same: role, content, tool calls (name, arguments as data), tool-call id."""
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True, ensure_ascii=False))
        for c in message.get("tool_calls") or []
    )
    return (message["role"], message.get("content") or "", calls, message.get("tool_call_id"))


#: a reasoning block at the start of a reply's text, as models write it when the template has no reasoning field
_LEADING_REASONING = re.compile(r"^\s*<(think|thinking|reasoning)>.*?</\1>", re.S)


def _call_ids(message: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(c.get("id") for c in message.get("tool_calls") or [])


def sent_back(given: Mapping[str, Any], recorded: Mapping[str, Any]) -> str | None:
    """How a message a client sends relates to the one recorded: ``"same"``, ``"restored"`` or None (different).

    Messages other than the assistant's must be the same (:func:`message_key`). An assistant message must have the
    same tool calls (names, arguments as data, call ids) and, when both carry reasoning, the same reasoning;
    ``"restored"``: it is the recorded reply as agents often send it back, without its reasoning (the field, or a
    leading ``<think>...</think>`` block in the text) or with its text re-spaced. The model's own words must be the
    same: any other change is a different message.
    """
    key, rec = message_key(given), message_key(recorded)
    if key[0] != "assistant" or rec[0] != "assistant":
        return "same" if key == rec else None
    ids, kept_ids = _call_ids(given), _call_ids(recorded)
    if key[2:] != rec[2:] or any(a is not None and b is not None and a != b for a, b in zip(ids, kept_ids)):
        return None
    reasoning, kept_reasoning = given.get("reasoning_content") or "", recorded.get("reasoning_content") or ""
    if reasoning and kept_reasoning and reasoning.strip() != kept_reasoning.strip():
        return None
    if key[1] == rec[1]:
        return "restored" if kept_reasoning and not reasoning else "same"
    text, kept = key[1].strip(), rec[1].strip()
    return "restored" if text in (kept, _LEADING_REASONING.sub("", kept, count=1).strip()) else None


def api_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A chatenv assistant message as OpenAI returns it (content None when it only calls tools; arguments as JSON).

    The reply's reasoning, where the template writes one, is ``reasoning_content`` (as vLLM's server returns it).
    """
    calls = message.get("tool_calls") or []
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or (None if calls else "")}
    if message.get("reasoning_content"):
        out["reasoning_content"] = message["reasoning_content"]
    if calls:
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
            }
            for c in calls
        ]
    return out
