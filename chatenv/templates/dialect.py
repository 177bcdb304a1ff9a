"""The Hugging Face ``chat_template`` dialect: compiling a template source and rendering it with generation fences.

A source is compiled in a sandboxed Jinja environment with what Hugging Face tokenizers offer templates
(``tojson`` without HTML escaping, ``raise_exception``, ``strftime_now``, loop controls) plus the
``{% generation %} ... {% endgeneration %}`` block. :func:`render_text` renders a source and returns the text with
the character spans of its generation blocks; :class:`~chatenv.templates.renderer.ChatTemplate` builds on it.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from jinja2 import Template, nodes
from jinja2.exceptions import TemplateError as JinjaTemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser as JinjaParser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chatenv.errors import TemplateError

__all__ = ["compile_source", "render_text"]

# Unicode noncharacters (reserved by the standard for a program's internal use, see renderer.py) that fence
# generation blocks while rendering.
_GEN_OPEN, _GEN_CLOSE = "\ufdd0", "\ufdd1"


class _GenerationExtension(Extension):
    """Supports ``{% generation %} ... {% endgeneration %}`` by fencing the block's output."""

    tags = {"generation"}

    def parse(self, parser: JinjaParser) -> nodes.Node:  # noqa: D102
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_fence", []), [], [], body).set_lineno(lineno)

    def _fence(self, caller: Callable[[], str]) -> str:
        return _GEN_OPEN + caller() + _GEN_CLOSE


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(f"the chat template refused the chat: {message}")


def _tojson(
    value: Any,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    # Hugging Face's dialect: plain JSON, no HTML escaping. JSON a template renders (tool calls, tool schemas) is
    # markup, encoded with special tokens recognised, so a string in it that spells a control token ("<|im_end|>"
    # in a tool argument) would become that token: "<|" is written as the equivalent JSON escape "<\u007c" (it
    # can only occur inside a JSON string, and decodes to the same value).
    text = json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    return text.replace("<|", "<\\u007c")


def _strftime_now(fmt: str) -> str:
    # Hugging Face's dialect offers the current date to templates (Llama 3.2 prints it in its system message)
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=64)
def compile_source(source: str) -> Template:
    """Compile a chat template source (cached), in the Hugging Face dialect plus ``{% generation %}``.

    Raises:
        TemplateError: If the source does not compile.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationExtension, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except JinjaTemplateError as e:
        raise TemplateError(f"the chat template does not compile: {e}") from e


def _render_fenced(
    source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, context: Mapping[str, Any]
) -> str:
    try:
        return compile_source(source).render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except TemplateError:
        raise
    except (JinjaTemplateError, TypeError, ValueError, LookupError, ArithmeticError) as e:
        # a template's own bug (e.g. adding a str to None) is a template failure too, not a chatenv one
        raise TemplateError(f"rendering the chat template failed: {type(e).__name__}: {e}") from e


def render_text(
    source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, context: Mapping[str, Any]
) -> tuple[str, list[tuple[int, int]]]:
    """Render a source and strip the generation fences.

    Args:
        source: Jinja source.
        messages: Message dicts.
        add_generation_prompt: Passed to the template.
        context: Other variables the template reads (``tools``, ``bos_token``, ...).

    Returns:
        The text and the character spans of its generation blocks.

    Raises:
        TemplateError: If rendering fails.
    """
    raw = _render_fenced(source, messages, add_generation_prompt, context)
    pieces = re.split(f"([{_GEN_OPEN}{_GEN_CLOSE}])", raw)
    text_parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos, depth, opened = 0, 0, 0
    for piece in pieces:
        if piece == _GEN_OPEN:
            if depth == 0:
                opened = pos
            depth += 1
        elif piece == _GEN_CLOSE:
            depth -= 1
            if depth == 0 and pos > opened:
                spans.append((opened, pos))
        else:
            text_parts.append(piece)
            pos += len(piece)
    return "".join(text_parts), spans
