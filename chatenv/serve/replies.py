"""Generated ids into a reply: the assistant message every API dialect returns (tool calls read from the ids).

The message of a reply comes from its ids (:meth:`~chatenv.tokenization.ChatTokenizer.parse_tool_calls`): a
complete reply whose calls are exactly as the template writes them becomes ``content`` + ``tool_calls``; anything
else keeps its text. A stop string cuts the returned content (the recorded ids keep every generated token).
"""

from __future__ import annotations

from typing import Any

from chatenv.serve.engine import Generated
from chatenv.serve.params import ChatRequest
from chatenv.serve.sessions import Choice
from chatenv.tokenization import ChatTokenizer

__all__ = ["make_choice"]


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
