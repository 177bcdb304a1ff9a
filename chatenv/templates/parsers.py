"""Parsers from rendered chat text back to messages, one per template family.

A parser takes the text a template rendered (possibly cut inside the last message, as when a model is still
generating) and returns the message dicts. A message the text stops inside carries ``"is_complete": False``.
Parsers raise :class:`~chatenv.errors.TemplateParseError` on text their template could not have written.
"""

from __future__ import annotations

import re
from typing import Any

from chatenv.errors import TemplateParseError
from chatenv.templates.tool_calls import get_tool_format

__all__ = ["parse_chatml", "parse_llama3", "parse_llama3_tools", "parse_qwen25", "parse_smollm2_tools"]


def _chatml_blocks(text: str, start: str, end: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    pos = 0
    while pos < len(text):
        if not text.startswith(start, pos):
            raise TemplateParseError(
                f"expected {start!r} at offset {pos}, found {text[pos : pos + 30]!r}; is this text rendered with "
                "the same template?"
            )
        head_end = text.find("\n", pos + len(start))
        if head_end < 0:
            role = text[pos + len(start) :]
            if not role or end in role:
                raise TemplateParseError(f"unterminated message header at offset {pos}: {text[pos:]!r}")
            # a header cut mid-way cannot be told apart from a complete role name: mark it incomplete
            messages.append({"role": role, "content": "", "is_complete": False})
            break
        role = text[pos + len(start) : head_end]
        if not role or end in role or start in role:
            raise TemplateParseError(f"missing role in the message header at offset {pos}: {text[pos:head_end]!r}")
        body_start = head_end + 1
        body_end = text.find(end, body_start)
        if body_end < 0:
            messages.append({"role": role, "content": text[body_start:], "is_complete": False})
            break
        messages.append({"role": role, "content": text[body_start:body_end]})
        pos = body_end + len(end)
        if text.startswith("\n", pos):
            pos += 1
    return messages


def parse_chatml(text: str) -> list[dict[str, Any]]:
    r"""Parse ChatML text (``<|im_start|>role\\ncontent<|im_end|>\\n`` blocks).

    Example:
        >>> parse_chatml("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHel")
        [{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hel', 'is_complete': False}]
    """
    return _chatml_blocks(text, "<|im_start|>", "<|im_end|>")


_LLAMA3_HEAD = re.compile(r"<\|start_header_id\|>(.*?)<\|end_header_id\|>\n\n", re.S)


def parse_llama3(text: str) -> list[dict[str, Any]]:
    r"""Parse Llama-3 text (``<|start_header_id|>role<|end_header_id|>\\n\\ncontent<|eot_id|>`` blocks)."""
    pos = len("<|begin_of_text|>") if text.startswith("<|begin_of_text|>") else 0
    messages: list[dict[str, Any]] = []
    while pos < len(text):
        head = _LLAMA3_HEAD.match(text, pos)
        if head is None or not head.group(1) or "<|" in head.group(1):
            raise TemplateParseError(
                f"expected a Llama-3 message header at offset {pos}, found {text[pos : pos + 40]!r}"
            )
        body_end = text.find("<|eot_id|>", head.end())
        if body_end < 0:
            messages.append({"role": head.group(1), "content": text[head.end() :], "is_complete": False})
            break
        messages.append({"role": head.group(1), "content": text[head.end() : body_end]})
        pos = body_end + len("<|eot_id|>")
    return messages


_RESPONSE_OPEN, _RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"


def _with_calls(m: dict[str, Any], fmt: str) -> dict[str, Any]:
    """An assistant message whose content holds tool calls in ``fmt``: content and ``tool_calls`` split apart.

    A cut message, or one whose calls are not exactly as the template writes them, keeps its text as content.
    """
    if m["role"] != "assistant" or m.get("is_complete") is False:
        return m
    parsed = get_tool_format(fmt).parse_text(m["content"])
    if not parsed.items or not parsed.canonical:
        return m  # text that merely looks like calls ("[{", a half-written call) is what the assistant wrote
    return {"role": "assistant", "content": parsed.content, "tool_calls": [c.to_message() for c in parsed.calls]}


def parse_qwen25(text: str) -> list[dict[str, Any]]:
    """Parse Qwen2.5 text: ChatML plus ``<tool_call>`` blocks and grouped ``<tool_response>`` turns."""
    out: list[dict[str, Any]] = []
    for m in parse_chatml(text):
        body = m["content"]
        if m["role"] == "user" and body.startswith(_RESPONSE_OPEN) and body.endswith(_RESPONSE_CLOSE):
            inner = body[len(_RESPONSE_OPEN) : -len(_RESPONSE_CLOSE)]
            sep = _RESPONSE_CLOSE + "\n" + _RESPONSE_OPEN
            out.extend({"role": "tool", "content": c} for c in inner.split(sep))
        else:
            out.append(_with_calls(m, "hermes"))
    return out


def parse_smollm2_tools(text: str) -> list[dict[str, Any]]:
    """Parse text of the ``smollm2-tools`` template: ChatML with ``<tool_call>`` blocks and ``tool`` messages."""
    return [_with_calls(m, "hermes") for m in parse_chatml(text)]


def parse_llama3_tools(text: str) -> list[dict[str, Any]]:
    """Parse Llama-3 text with JSON tool calls and ``ipython`` (tool result) messages."""
    out = []
    for m in parse_llama3(text):
        if m["role"] == "ipython":
            m = {**m, "role": "tool"}
        out.append(_with_calls(m, "llama3_json"))
    return out
