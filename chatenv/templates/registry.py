"""The registry of chat templates, and choosing one for a tokenizer.

The built-in templates are Jinja files shipped inside this package (``<name>.jinja``):

- ``smollm2``: SmolLM2-Instruct's template, rendering exactly like its tokenizer's (it inserts SmolLM's
  system prompt into chats that have none);
- ``chatml``: plain ChatML, no default system prompt (for any other ChatML model);
- ``llama3``: Llama 3 Instruct (trims whitespace around content);
- ``qwen2.5``: Qwen2.5 Instruct with tool calls and tool responses;
- ``smollm2-tools``: ``smollm2`` plus tools (schemas in the system message, ``<tool_call>`` blocks, ``tool``
  messages); renders exactly like ``smollm2`` when there are no tools. Envs with tools switch ``smollm2`` to it.

A template is chosen by name, or from the tokenizer's own ``chat_template``: used directly when it has
``{% generation %}`` markers, replaced by the registered template that renders exactly like it on probe chats
(registered templates are overrides), and otherwise used with a profile derived from probe renders (see
:mod:`chatenv.templates.derive`). The model's name is never used to guess.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from importlib import resources
from typing import Any

from chatenv.errors import TemplateError, TemplateParseError
from chatenv.templates import tool_formats  # noqa: F401  (registers the built-in tool-call formats)
from chatenv.templates.derive import derive_template
from chatenv.templates.dialect import compile_source, render_text
from chatenv.templates.markers import special_strings
from chatenv.templates.parsers import parse_chatml, parse_llama3_tools, parse_qwen25, parse_smollm2_tools
from chatenv.templates.renderer import ChatTemplate, Parser
from chatenv.templates.tool_calls import get_tool_format

__all__ = ["builtin_source", "get_template", "list_templates", "register_template", "resolve_template"]

_REGISTRY: dict[str, ChatTemplate] = {}
# bumped on every registration, so cached tokenizer-template matches are never stale
_VERSION = [0]
_MATCHES: dict[tuple[str, tuple[tuple[str, str], ...], int], str | None] = {}


def builtin_source(name: str) -> str:
    """The Jinja source of a built-in template, read from the package's ``<name>.jinja`` file.

    Raises:
        FileNotFoundError: If there is no such file.
    """
    return resources.files(__package__).joinpath(f"{name}.jinja").read_text(encoding="utf-8")


def register_template(
    name: str,
    source: str,
    parser: Parser | None = None,
    *,
    description: str = "",
    strips_content: bool = False,
    default_system: str | None = None,
    context: Mapping[str, Any] | None = None,
    tool_format: str | None = None,
    tool_variant: str | None = None,
    overwrite: bool = False,
) -> ChatTemplate:
    """Register a chat template (Jinja source with ``{% generation %}`` markers) and its parser.

    Args:
        name: The name to select it with.
        source: Jinja source in the Hugging Face ``chat_template`` dialect. Assistant output must be wrapped
            in ``{% generation %}...{% endgeneration %}`` (including the end-of-turn token), or assistant masks
            would be empty.
        parser: Function from rendered text to message dicts; needed for :meth:`History.from_text`.
        description: One line shown by listings.
        strips_content: Set when the template trims whitespace around content.
        default_system: System message the template inserts when a chat has none.
        context: Extra variables the source refers to.
        tool_format: How the template writes tool calls (``"hermes"`` or ``"llama3_json"``), if it can.
        tool_variant: A registered template to use instead when an env has tools (for templates without tools).
        overwrite: Replace an existing registration of the same name.

    Returns:
        The registered template.

    Raises:
        ValueError: If the name is taken (and ``overwrite`` is False) or the source has no generation markers.
        TemplateError: If the source does not compile.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"template name must be a non-empty str, got {name!r}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"a template named {name!r} is already registered; pass overwrite=True to replace it")
    if tool_format is not None:
        get_tool_format(tool_format)  # raises for an unknown format
    template = ChatTemplate(
        name,
        source,
        parser,
        description,
        strips_content,
        default_system,
        dict(context or {}),
        tool_format,
        tool_variant,
    )
    if not template.has_generation_markers:
        raise ValueError(
            f"template {name!r} has no {{% generation %}} markers: wrap what the assistant produces (content "
            "and end-of-turn token) in {% generation %}...{% endgeneration %} so assistant masks can be computed"
        )
    compile_source(source)
    _REGISTRY[name] = template
    _VERSION[0] += 1
    return template


def list_templates() -> list[str]:
    """Names of the registered templates."""
    return sorted(_REGISTRY)


def get_template(name: str | ChatTemplate) -> ChatTemplate:
    """Look a template up by name (a :class:`ChatTemplate` is returned as is).

    Raises:
        TypeError: If ``name`` is neither a str nor a template.
        KeyError: For an unknown name, with the closest registered names.
    """
    if isinstance(name, ChatTemplate):
        return name
    if not isinstance(name, str):
        raise TypeError(f"template must be a name (str) or a ChatTemplate, got {type(name).__name__}")
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(_REGISTRY), n=3, cutoff=0.4)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise KeyError(f"unknown chat template {name!r}{hint} (registered: {', '.join(list_templates())})") from None


# Chats on which a tokenizer's template must render exactly like a registered one to be replaced by it: with
# and without a system message (templates differ in the default system prompt they insert), several turns,
# whitespace around content (some templates trim it), an empty reply.
_PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    (
        {"role": "system", "content": "S1"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ),
    ({"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"}),
    (
        {"role": "user", "content": " U1\n"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "U2"},
        {"role": "assistant", "content": "\nA2 "},
    ),
)


def _renders_like(source: str, context: Mapping[str, Any], template: ChatTemplate) -> bool:
    for probe in _PROBES:
        for gp in (False, True):
            try:
                mine, _ = render_text(source, [dict(m) for m in probe], gp, context)
                theirs, _ = render_text(template.source, [dict(m) for m in probe], gp, template.context)
            except TemplateError:
                return False
            if mine != theirs:
                return False
    # tools too: a registered template without tool calls must not stand in for a template that renders them
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    chat = [{"role": "user", "content": "U1"}]
    mine_with_tools = _prompted_or_none(source, chat, {**context, "tools": tools})
    return mine_with_tools == _prompted_or_none(template.source, chat, {**template.context, "tools": tools})


def _prompted_or_none(source: str, messages: list[dict[str, str]], context: Mapping[str, Any]) -> str | None:
    """The render of ``messages`` with a generation prompt, or None when the template refuses them."""
    try:
        return render_text(source, messages, True, context)[0]
    except TemplateError:
        return None


def _matching(source: str, context: dict[str, str]) -> ChatTemplate | None:
    """The first registered template that renders like ``source`` on the probes (cached per registry state)."""
    key = (source, tuple(sorted(context.items())), _VERSION[0])
    if key not in _MATCHES:
        found = [t.name for t in _REGISTRY.values() if _renders_like(source, context, t)]
        _MATCHES[key] = found[0] if found else None
    name = _MATCHES[key]
    return None if name is None else _REGISTRY[name]


def resolve_template(template: str | ChatTemplate | None = None, tokenizer: Any = None) -> ChatTemplate:
    """Pick the template to use: explicit, or the tokenizer's own.

    With ``template`` given (a name or a :class:`ChatTemplate`), that one is used. Otherwise the tokenizer's
    ``chat_template`` is used directly when it has ``{% generation %}`` markers, or else replaced by the
    registered template that renders exactly like it on probe chats, or else used with a profile derived by
    rendering probe chats (:func:`~chatenv.templates.derive.derive_profile`). There is no guessing from names.

    Raises:
        TemplateError: When the tokenizer has no template.
        TemplateDerivationError: When the tokenizer's template lacks something the envs need (with a
            counterexample chat).

    Example:
        >>> from chatenv.models import load_default_tokenizer
        >>> resolve_template(None, load_default_tokenizer()).name
        'smollm2'
    """
    if template is not None:
        return get_template(template)
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):
        source = source.get("default")
    if not source:
        raise TemplateError(
            "no chat template given and the tokenizer has none; pass template=<name> "
            f"(registered: {', '.join(list_templates())})"
        )
    context = {
        "bos_token": getattr(tokenizer, "bos_token", None) or "",
        "eos_token": getattr(tokenizer, "eos_token", None) or "",
    }
    match = _matching(source, context)
    own = ChatTemplate("", source, None, "the tokenizer's own template", context=context)
    if own.has_generation_markers:
        if match is None:
            # its markers give the assistant spans; reasoning and tool formats are still derived
            try:
                derived = _derived(source, context, tokenizer)
            except TemplateError:
                return own
            return dataclasses.replace(own, tool_format=derived.tool_format, profile=derived.profile)
        return dataclasses.replace(
            own,
            parser=match.parser,
            strips_content=match.strips_content,
            default_system=match.default_system,
            tool_format=match.tool_format,
        )
    if match is not None:
        return match
    return _derived(source, context, tokenizer)


_DERIVED: dict[tuple[str, tuple[tuple[str, str], ...], tuple[str, ...]], ChatTemplate] = {}


def _derived(source: str, context: dict[str, str], tokenizer: Any) -> ChatTemplate:
    """The tokenizer's template with a derived profile (cached per source, context and special tokens)."""
    key = (source, tuple(sorted(context.items())), tuple(special_strings(tokenizer)))
    if key not in _DERIVED:
        _DERIVED[key] = derive_template(tokenizer, source)
    return _DERIVED[key]


def _default_system(template: ChatTemplate) -> str | None:
    """The system message a template inserts into a chat without one, read off a render of such a chat."""
    text = template.render([{"role": "user", "content": "U"}]).text
    try:
        first = template.parse(text)[0]
    except (TemplateParseError, IndexError):
        return None
    return first["content"] if first["role"] == "system" else None


# name, parser, description, strips content, tool format, tool variant
_BUILTINS: tuple[tuple[str, Parser, str, bool, str | None, str | None], ...] = (
    (
        "smollm2",
        parse_chatml,
        "SmolLM2-Instruct's ChatML, exactly as its tokenizer renders it (adds SmolLM's system prompt if none)",
        False,
        None,
        "smollm2-tools",
    ),
    (
        "chatml",
        parse_chatml,
        "Plain ChatML (<|im_start|>role ... <|im_end|>); adds no system prompt",
        False,
        None,
        None,
    ),
    (
        "llama3",
        parse_llama3_tools,
        "Llama-3 Instruct (<|start_header_id|>, <|eot_id|>); trims content; JSON tool calls, ipython results",
        True,
        "llama3_json",
        None,
    ),
    (
        "qwen2.5",
        parse_qwen25,
        "Qwen2.5 Instruct with tool calls (<tool_call>) and tool responses (<tool_response>)",
        False,
        "hermes",
        None,
    ),
    (
        "smollm2-tools",
        parse_smollm2_tools,
        "smollm2 plus tools: schemas in the system message, <tool_call> blocks, `tool` messages",
        False,
        "hermes",
        None,
    ),
)


def _register_builtins() -> None:
    for name, parser, description, strips, tool_format, tool_variant in _BUILTINS:
        template = register_template(
            name,
            builtin_source(name),
            parser,
            description=description,
            strips_content=strips,
            tool_format=tool_format,
            tool_variant=tool_variant,
        )
        _REGISTRY[name] = dataclasses.replace(template, default_system=_default_system(template))


_register_builtins()
