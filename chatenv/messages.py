"""The one definition of a chat message, checked the same way by envs, :class:`~chatenv.history.History` and spaces.

A message is a dict with a ``role`` and a ``content`` string, and optionally ``tool_calls`` (a list of dicts;
:class:`~chatenv.history.History` stores it as a JSON string), ``tool_call_id`` and ``name`` (a tool result's
call id and tool name) and ``is_complete`` (False for a message that was cut off). Nothing else is kept, and
nothing is dropped silently: unknown keys are an error.

Roles are identifiers (letters, digits, ``_`` and ``-``, starting with a letter, at most 64 characters): a role
is rendered as template markup, so a role carrying ``<|im_end|>`` or a newline could forge a turn.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MESSAGE_KEYS", "ROLE_PATTERN", "Message", "check_message", "check_messages", "is_valid_message"]

Message = dict[str, Any]
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning_content", "is_complete")
ROLE_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_\-]{0,63}")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(calls, str):
        try:
            calls = json.loads(calls) if calls else []
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: 'tool_calls' given as a str must be a JSON list: {e}") from e
    if calls is None:
        return []
    if not isinstance(calls, Sequence) or isinstance(calls, str) or not all(isinstance(c, Mapping) for c in calls):
        raise TypeError(f"{where}: 'tool_calls' must be a list of dicts, got {calls!r:.80}")
    return [dict(c) for c in calls]


def check_message(message: Any, where: str = "message") -> Message:
    """Check one message and return it as a new, normalised dict.

    The result has ``role`` and ``content``, plus ``tool_calls`` (a list of dicts) only when there are calls,
    ``tool_call_id``, ``name`` and ``reasoning_content`` only when non-empty, and ``is_complete`` only when it is
    False.

    Args:
        message: The message to check.
        where: Where it came from, for error messages (e.g. ``"options['messages'][2]"``).

    Raises:
        TypeError: For a message that is not a dict, or a value of the wrong type.
        ValueError: For a missing or malformed role, missing content, or unknown keys.

    Example:
        >>> check_message({"role": "user", "content": "Hi", "is_complete": True})
        {'role': 'user', 'content': 'Hi'}
    """
    if not isinstance(message, Mapping):
        raise TypeError(f"{where}: expected a message dict with 'role' and 'content', got {type(message).__name__}")
    unknown = set(message) - set(MESSAGE_KEYS)
    if unknown:
        raise ValueError(
            f"{where}: unsupported message keys {sorted(map(str, unknown))}; messages keep {list(MESSAGE_KEYS)} "
            "(tool results are messages with role 'tool')"
        )
    if "role" not in message:
        raise ValueError(f"{where}: message has no 'role' (got keys {sorted(message)})")
    role = message["role"]
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where}: 'role' must be a non-empty str, got {role!r:.80}")
    if not ROLE_PATTERN.fullmatch(role):
        raise ValueError(
            f"{where}: role {role!r:.80} is not an identifier (letters, digits, '_' or '-', starting with a letter, "
            "at most 64 characters); roles are template markup, so text belongs in 'content'"
        )
    if "content" not in message:
        raise ValueError(f"{where}: message has no 'content'; use '' for an empty message")
    content = message["content"]
    if not isinstance(content, str):
        raise TypeError(f"{where}: 'content' must be a str, got {type(content).__name__} ({content!r:.60})")
    _check_unicode(content, f"{where}: 'content'")
    out: Message = {"role": role, "content": content}
    calls = _tool_calls(message.get("tool_calls"), where)
    if calls:
        out["tool_calls"] = calls
    out.update(_tool_result_keys(message, where))
    complete = message.get("is_complete", True)
    if not isinstance(complete, bool):
        raise TypeError(f"{where}: 'is_complete' must be a bool, got {complete!r}")
    if not complete:
        out["is_complete"] = False
    return out


def _tool_result_keys(message: Mapping[str, Any], where: str) -> dict[str, str]:
    """A tool result's ``tool_call_id`` and ``name``, where given and non-empty."""
    out = {}
    for key in ("tool_call_id", "name", "reasoning_content"):
        value = message.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise TypeError(f"{where}: {key!r} must be a str, got {type(value).__name__} ({value!r:.60})")
        _check_unicode(value, f"{where}: {key!r}")
        out[key] = value
    return out


def _check_unicode(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{what} holds a lone surrogate {text[e.start]!r} at position {e.start}: not valid Unicode text (decode "
            "bytes with errors='replace', or drop the character)"
        ) from None


def check_messages(messages: Any, where: str = "messages", *, allow_empty: bool = False) -> list[Message]:
    """Check a chat (a list of messages) and return normalised copies.

    Raises:
        TypeError: If ``messages`` is not a list of message dicts.
        ValueError: For an empty chat (unless ``allow_empty``) or a bad message.
    """
    if isinstance(messages, Mapping) or isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"{where}: expected a list of message dicts, got {type(messages).__name__}")
    if not messages and not allow_empty:
        raise ValueError(f"{where}: expected a non-empty list of message dicts")
    return [check_message(m, f"{where}[{i}]") for i, m in enumerate(messages)]


def is_valid_message(message: Any) -> bool:
    """Whether :func:`check_message` accepts ``message`` (for space membership tests)."""
    try:
        check_message(message)
    except (TypeError, ValueError):
        return False
    return True
