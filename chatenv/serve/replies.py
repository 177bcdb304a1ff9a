"""Generated ids into a reply: the assistant message every API dialect returns (tool calls read from the ids).

The message of a reply comes from its ids (:meth:`~chatenv.tokenization.ChatTokenizer.parse_tool_calls`): a
complete reply whose calls are exactly as the template writes them becomes ``content`` + ``tool_calls``; anything
else keeps its text. Where the template has a reasoning format, the reply's reasoning is its ``reasoning_content``
(a reply cut inside its reasoning is all reasoning), and the template's own start of a reply (its reply prefix) is
not content. A stop string cuts the returned text (the recorded ids keep every generated token).
"""

from __future__ import annotations

from typing import Any

from chatenv.serve.engine import Generated
from chatenv.serve.request import ChatRequest
from chatenv.serve.sessions import Choice
from chatenv.tokenization import ChatTokenizer

__all__ = ["make_choice"]


def make_choice(ct: ChatTokenizer, gen: Generated, request: ChatRequest, call_prefix: str) -> Choice:
    """The reply that generated ids spell, with how it finished (``stop``, ``length`` or ``tool_calls``)."""
    ids = gen.ids
    end, complete = ct.reply_end(ids)
    reply_ids = ids if end is None else ids[:end]
    text = ct.decode(reply_ids)
    found = [(p, s) for s in request.stop if (p := text.find(s)) >= 0]
    stop_string = min(found)[1] if found and end is None else None
    message: dict[str, Any] = {"role": "assistant", "content": text}
    finish = "stop" if end is not None else "length"
    parsed = ct.parse_tool_calls(reply_ids, id_prefix=call_prefix)
    reasoning, message["content"] = parsed.reasoning, parsed.text
    if stop_string is not None:  # the stop string ends the reply where it is: in the reasoning or in the content
        finish = "stop"
        if reasoning is not None and stop_string in reasoning:
            reasoning, message["content"] = reasoning[: reasoning.find(stop_string)], ""
        else:
            cut = message["content"].find(stop_string)
            message["content"] = message["content"][:cut] if cut >= 0 else message["content"]
    elif complete and request.parse_tools and parsed.items and parsed.canonical:
        message["content"] = parsed.content
        message["tool_calls"] = [c.to_message() for c in parsed.calls]
        finish = "tool_calls"
    if reasoning:
        message["reasoning_content"] = reasoning
    return Choice(list(ids), list(gen.log_probs), message, complete, finish, gen.version, stop_string)
