"""Probe chats and what they show of a template's reasoning format (used by :mod:`chatenv.templates.derive`).

The probe words and messages, a prober that renders them, and :func:`derive_reasoning`: where a reply's reasoning
is written (a message key the template renders, only in replies with calls (Gemma 4), prompt-opened, or a tagged
reasoning the template strips from past replies).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chatenv.errors import TemplateError
from chatenv.templates.dialect import render_text
from chatenv.templates.profile import ReasoningFormat
from chatenv.templates.renderer import common_prefix, text_blocks

__all__ = [
    "PROBE_CALL",
    "PROBE_TOOL",
    "Prober",
    "derive_reasoning",
    "lcp",
    "message",
    "opening_tag",
    "probe_call",
    "prompt_state",
    "special_at",
    "word",
]


# Probe words: unlikely to occur in any template's own text, and tokenized and trimmed as plain words.
def word(n: int) -> str:
    """Probe word ``n``."""
    return f"Zq{n}x"


def message(role: str, content: str, **extra: Any) -> dict[str, Any]:
    """A probe message."""
    return {"role": role, "content": content, **extra}


PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
PROBE_CALL: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}


@dataclass
class Prober:
    """Renders probe chats with a template (None where the template refuses one)."""

    source: str
    context: dict[str, Any]
    blocks: bool = False

    def render(  # noqa: D102
        self, messages: Sequence[Mapping[str, Any]], gp: bool = False, tools: Sequence[Mapping[str, Any]] | None = None
    ) -> str | None:
        msgs: list[Mapping[str, Any]] = [dict(m) for m in messages]
        if self.blocks:
            msgs = [text_blocks(m) for m in msgs]
        try:
            return render_text(self.source, msgs, gp, {**self.context, "tools": tools})[0]
        except TemplateError:
            return None


def special_at(text: str, pos: int, specials: Sequence[str]) -> tuple[int, str] | None:
    """The earliest special-token string in ``text`` at or after ``pos`` (the longest one at that offset)."""
    best: tuple[int, str] | None = None
    for s in specials:
        k = text.find(s, pos)
        if k >= 0 and (best is None or k < best[0] or (k == best[0] and len(s) > len(best[1]))):
            best = (k, s)
    return best


def lcp(a: str, b: str) -> int:
    """Length of the common prefix of two renders (never inside a marker)."""
    return common_prefix(a, b)


def probe_call(json_arguments: bool) -> dict[str, Any]:
    """The probe call (its arguments as a JSON string where the template wants them so)."""
    fn = dict(PROBE_CALL["function"])
    if json_arguments:
        fn["arguments"] = json.dumps(fn["arguments"])
    return {"id": "call_0", "type": "function", "function": fn}


def derive_reasoning(p: Prober, u1: list[dict[str, Any]], generation_prompt: str) -> ReasoningFormat | None:
    """Where a reply's reasoning is written: markup before and after it, read off a render."""
    head = p.render(u1, gp=True) or ""
    for key in ("reasoning_content", "thinking", "reasoning"):
        text = p.render([*u1, message("assistant", word(2), **{key: word(9)})])
        if text is None or word(9) not in text or word(2) not in text:
            continue
        r, c = text.index(word(9)), text.index(word(2))
        if r > c:
            continue
        close = text[r + len(word(9)) : c]
        start = lcp(head, text)
        if prompt_state(generation_prompt, close) == "closed":
            tag = opening_tag(close)
            k = text.rfind(tag, 0, r) if tag else -1
            return ReasoningFormat(key, text[k:r] if k >= 0 else text[start:r], close, "closed")
        if start < r:  # the reply writes its own opening
            return ReasoningFormat(key, text[start:r], close, prompt_state(generation_prompt, close))
        tag = opening_tag(close)
        k = text.rfind(tag, 0, r) if tag else -1
        opening = text[k:r] if k >= 0 else ""
        return ReasoningFormat(key, opening, close, "open")
    found = _reasoning_with_calls(p, u1)
    if found is not None:
        return found
    # no message key is rendered: a template that prompts with an opening tag and drops what precedes the closing
    # one from past replies (DeepSeek-R1 distills) still has a reasoning format, read off the prompt
    opened = re.search(r"<([A-Za-z_]+)>\s*$", generation_prompt)
    if opened is None:
        return _stripped_reasoning(p, u1)
    close = f"</{opened.group(1)}>"
    text = p.render([*u1, message("assistant", f"{word(9)}{close}{word(2)}"), message("user", word(3))])
    if text is None or word(9) in text or word(2) not in text:
        return None
    return ReasoningFormat(None, generation_prompt[opened.start() :], close, "open")


def _reasoning_with_calls(p: Prober, u1: list[dict[str, Any]]) -> ReasoningFormat | None:
    """The reasoning format of a template that writes reasoning only in replies with calls (Gemma 4).

    The markup around the reasoning is read off the difference it makes to a reply with a call.
    """
    for key in ("reasoning_content", "thinking", "reasoning"):
        chat = [*u1, message("assistant", "", tool_calls=[probe_call(False)])]
        without = p.render(chat, tools=[PROBE_TOOL])
        text = p.render([*u1, {**chat[1], key: word(9)}], tools=[PROBE_TOOL])
        if without is None or text is None or word(9) not in text:
            continue
        start = lcp(without, text)
        tail = 0
        while tail < len(without) - start and without[-1 - tail] == text[-1 - tail]:
            tail += 1
        block = text[start : len(text) - tail]
        r = block.find(word(9))
        if r > 0 and block[r + len(word(9)) :]:
            return ReasoningFormat(key, block[:r], block[r + len(word(9)) :], "none")
    return None


def _stripped_reasoning(p: Prober, u1: list[dict[str, Any]]) -> ReasoningFormat | None:
    """The reasoning format of a template that strips a tagged reasoning from past replies' content.

    Such a template renders no message key (Nemotron-Super v1.5 drops what precedes ``</think>``): the format is the
    tag pair (from the template's source) whose reasoning it drops.
    """
    for tag in sorted(t for t in set(re.findall(r"</([A-Za-z_]+)>", p.source))):
        text = p.render([*u1, message("assistant", f"<{tag}>{word(9)}</{tag}>{word(2)}"), message("user", word(3))])
        if text is not None and word(9) not in text and word(2) in text:
            return ReasoningFormat(None, f"<{tag}>", f"</{tag}>", "none")
    return None


def opening_tag(close: str) -> str | None:
    """``<think>`` for a closing ``</think>`` (surrounded by whitespace or not)."""
    m = re.fullmatch(r"\s*</([A-Za-z_]+)>\s*", close)
    return f"<{m.group(1)}>" if m else None


def prompt_state(generation_prompt: str, close: str) -> str:
    """``closed`` when the generation prompt ends with an empty, closed reasoning block, else ``none``."""
    core = close.strip()
    return "closed" if core and generation_prompt.rstrip().endswith(core) else "none"
