"""Chat templates: rendering with exact assistant spans, parsing back, and a registry.

A :class:`ChatTemplate` is a Jinja source (the same dialect as Hugging Face tokenizers' ``chat_template``,
including ``{% generation %}`` markers around what the assistant produces) plus a parser that turns rendered
text back into messages. Rendering returns the text together with *segments*: which characters are template
markup and which are message content, and which belong to an assistant generation. Tokenization
(:mod:`chatenv.tokenization`) uses the segments so that content is always encoded as plain text (it can
never forge a special token) and so that the assistant mask is exact.

Modules: :mod:`~chatenv.templates.renderer` (rendering and segments), :mod:`~chatenv.templates.dialect`
(compiling and rendering a Jinja source in the Hugging Face dialect), :mod:`~chatenv.templates.parsers` (text back
to messages), :mod:`~chatenv.templates.registry` (the built-in ``.jinja`` templates, registering and choosing one),
:mod:`~chatenv.templates.derive` (what a template without markers does, read off probe renders;
:mod:`~chatenv.templates.probes` holds the probes and the reasoning formats they show),
:mod:`~chatenv.templates.markers` (special-token strings of tokenizers and templates) and
:mod:`~chatenv.templates.continuation` (what rendering adds after a chat, and when a window of the chat is enough to
render it, proven on :mod:`~chatenv.templates.proof_chats`).
"""

from __future__ import annotations

from chatenv.templates.registry import get_template, list_templates, register_template, resolve_template
from chatenv.templates.renderer import ChatTemplate, Rendered, Segment

__all__ = [
    "ChatTemplate",
    "Rendered",
    "Segment",
    "get_template",
    "list_templates",
    "register_template",
    "resolve_template",
]
