"""The proof chats of :func:`~chatenv.templates.continuation.window_is_exact`: shapes a window could get wrong.

With and without a system message, several user or assistant turns in a row, tool calls and results (with tool
schemas), empty contents and a long chat.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PROOF_CASES"]


def _m(role: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **extra}


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _long_chat(turns: int) -> list[dict[str, Any]]:
    chat = [_m("system", "You are a patient tutor.")]
    for t in range(turns):
        chat.append(_m("user", f"Question {t}: what is {t} * 7?" + (" Explain.\n" if t % 3 == 0 else "")))
        chat.append(_m("assistant", f"{t * 7}." if t % 2 else f"  {t} * 7 = {t * 7}\nDone. "))
    return chat


_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"city": {"type": "string"}}}}]

#: (chat, tools): the shapes a window could get wrong
PROOF_CASES: tuple[tuple[tuple[dict[str, Any], ...], list[dict[str, Any]] | None], ...] = (
    # the shape ChatTokenizer.verify steps through
    (
        (
            _m("system", "You are terse."),
            _m("user", "What is 2 + 3?"),
            _m("assistant", "5"),
            _m("user", "And 10 * 4?\nExplain."),
            _m("assistant", "40, since 10 * 4 = 40."),
            _m("user", "Thanks!"),
            _m("assistant", "You're welcome."),
        ),
        None,
    ),
    # no system message (templates may insert a default one, or treat the first user message specially)
    (tuple(_m(r, f"{r} {i}") for i, r in enumerate(["user", "assistant"] * 5)), None),
    # several user turns in a row, a system message mid-chat, two assistant turns in a row
    (
        (
            _m("system", "S"),
            _m("user", "u1"),
            _m("user", "u2"),
            _m("assistant", "a1"),
            _m("user", "u3"),
            _m("user", "u4"),
            _m("user", "u5"),
            _m("assistant", "a2"),
            _m("assistant", "a3"),
            _m("system", "Be brief from now on."),
            _m("user", "u6"),
            _m("assistant", "a4"),
        ),
        None,
    ),
    # tool calls and tool results, with tool schemas
    (
        (
            _m("system", "Use tools."),
            _m("user", "Weather in Paris and Rome?"),
            _m("assistant", "", tool_calls=[_call("weather", city="Paris"), _call("weather", city="Rome")]),
            _m("tool", "sunny"),
            _m("tool", "rain"),
            _m("assistant", "Paris: sunny. Rome: rain."),
            _m("user", "And Oslo?"),
            _m("assistant", "Checking.", tool_calls=[_call("weather", city="Oslo")]),
            _m("tool", "snow"),
            _m("assistant", "Oslo: snow."),
            _m("user", "Thanks"),
            _m("assistant", "Welcome."),
        ),
        _TOOLS,
    ),
    # empty contents everywhere
    (tuple(_m(r, "") for r in ["system", "user", "assistant", "user", "assistant", "user", "assistant"]), None),
    # a long chat (some templates change once a chat is long)
    (tuple(_long_chat(12)), None),
)
