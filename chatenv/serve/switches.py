"""A request's template switches: ``chat_template_kwargs`` and ``reasoning_effort``, as the chat template's variables.

A chat template may read variables besides the chat (Qwen3's ``enable_thinking``, gpt-oss's ``reasoning_effort``).
A request sets them with ``chat_template_kwargs`` (vLLM's server extra: each key must be a variable the template
reads, else 400 naming it and the variables it has), or with ``reasoning_effort`` (Responses: ``reasoning.effort``):

- a template that reads ``reasoning_effort`` gets the value as is;
- one that reads ``enable_thinking`` gets ``enable_thinking = effort != "none"``;
- one that reads neither: ``"none"`` is accepted when the template writes no reasoning (nothing changes), any other
  value is refused with 400 naming the template (no switch to map it to).

The request is then rendered, generated and read with the template under those variables (its profile derived
again for them: a switch may change the generation prompt), in the same sessions.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re
from collections.abc import Mapping
from typing import Any

from chatenv.errors import ChatEnvError
from chatenv.serve.errors import APIError

__all__ = ["forced_call", "request_tokenizer", "switched", "template_kwargs", "template_variables"]

#: chat tokenizers under template variables, least recently used first (at most _MAX_SWITCHED: a client cannot grow
#: it without bound; an evicted variant is derived again, and requests with it then start new segments)
_SWITCHED: collections.OrderedDict[tuple[int, str], tuple[Any, Any]] = collections.OrderedDict()
_MAX_SWITCHED = 64
_VARIABLES: dict[str, frozenset[str]] = {}


def template_variables(source: str) -> frozenset[str]:
    """The variables a template's source reads besides the chat and the tokens every template gets."""
    if source not in _VARIABLES:
        from jinja2 import meta

        from chatenv.templates.dialect import compile_source

        env = compile_source(source).environment  # the dialect's own environment ({% generation %} included)
        names = meta.find_undeclared_variables(env.parse(source))
        common = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"} | set(env.globals)
        # a name the template sets itself somewhere (read before it is set in some branch) is no switch
        # (unless it tests whether the caller gave it: gpt-oss sets reasoning_effort when it is not defined)
        assigned = {n for group in re.findall(r"\bset\s+([\w\s,]+?)\s*=", source) for n in re.split(r"[\s,]+", group)}
        common |= assigned - set(re.findall(r"(?<![.\w])(\w+)\s+is\s+(?:not\s+)?defined", source))
        _VARIABLES[source] = frozenset(n for n in names if n not in common and not n.startswith("_"))
    return _VARIABLES[source]


def template_kwargs(ct: Any, kwargs: Mapping[str, Any] | None, effort: str | None) -> dict[str, Any]:
    """The template variables a request sets (its ``chat_template_kwargs``, then its reasoning effort mapped).

    Raises:
        APIError: For a variable the template does not read, or an effort it has no switch for.
    """
    template = ct.template
    name = template.name or "<tokenizer template>"
    known = template_variables(template.source)
    out = dict(kwargs or {})
    bad = sorted(k for k, v in out.items() if not isinstance(v, (str, int, float, bool, type(None))))
    if bad:
        raise APIError(
            f"chat_template_kwargs values must be strings, numbers, booleans or null; {bad} are not",
            param="chat_template_kwargs",
        )
    unknown = sorted(k for k in out if k not in known)
    if unknown:
        raise APIError(
            f"chat_template_kwargs sets {unknown}, which the template {name!r} does not read (it reads "
            f"{sorted(known) or 'no variables'})",
            param="chat_template_kwargs",
        )
    if effort is None:
        return out
    if "reasoning_effort" in known:
        out.setdefault("reasoning_effort", effort)
    elif "enable_thinking" in known:
        out.setdefault("enable_thinking", effort != "none")
    elif effort != "none" or getattr(template.profile, "reasoning", None) is not None:
        raise APIError(
            f"reasoning_effort={effort!r} is not supported: the template {name!r} has no reasoning switch "
            "(no 'reasoning_effort' or 'enable_thinking' variable)",
            param="reasoning_effort",
            code="unsupported_parameter",
        )
    return out


def switched(ct: Any, kwargs: Mapping[str, Any]) -> Any:
    """``ct`` with its template rendered under ``kwargs`` (cached; ``ct`` itself when there are none)."""
    if not kwargs:
        return ct
    key = (id(ct), json.dumps(dict(kwargs), sort_keys=True, default=str))
    held = _SWITCHED.get(key)
    if held is not None and held[0] is ct:
        _SWITCHED.move_to_end(key)
        return held[1]
    from chatenv.templates.derive import derive_profile, special_strings
    from chatenv.tokenization import ChatTokenizer

    template = ct.template
    context = {**template.context, **kwargs}
    changes: dict[str, Any] = {"context": context}
    if template.profile is not None:
        profile = derive_profile(template.source, context, special_strings(ct.tokenizer), template.name or "template")
        changes.update(profile=profile, tool_format=profile.tool_format or template.tool_format)
    variant = ChatTokenizer(ct.tokenizer, dataclasses.replace(template, **changes))
    _SWITCHED[key] = (ct, variant)
    while len(_SWITCHED) > _MAX_SWITCHED:
        _SWITCHED.popitem(last=False)
    return variant


def request_tokenizer(ct: Any, request: Any) -> Any:
    """The chat tokenizer a request is served with: ``ct`` under the template variables the request sets.

    Raises:
        APIError: As :func:`template_kwargs`, or when the template cannot be derived under those variables.
    """
    kwargs = template_kwargs(ct, request.template_kwargs, request.reasoning_effort)
    try:
        return switched(ct, kwargs)
    except ChatEnvError as e:
        raise APIError(f"the template cannot be used with {kwargs}: {e}", param="chat_template_kwargs") from None


def forced_call(ct: Any, request: Any) -> dict[str, Any]:
    """The generation settings of a request's forced call (``{"grammar": ...}``), or none.

    A forced call (``tool_choice`` ``required`` or a named function) is constrained from the first token; with
    ``parallel_tool_calls: false`` and ``tool_choice`` ``auto`` the reply is free until it opens a call, which is then
    constrained and ends the reply.

    Raises:
        APIError: When the template's calls cannot be forced (naming its format), or without xgrammar.
    """
    from chatenv.templates.forced_calls import first_call_grammar, forced_call_grammar

    free = request.forced_tools is None
    if free and (request.parallel_tool_calls or not request.tools or not request.parse_tools):
        return {}
    try:
        if free:  # parallel_tool_calls=false with tool_choice auto: free text, at most one call, then the end
            grammar = first_call_grammar(ct, request.tools)
        else:
            grammar = forced_call_grammar(ct, request.tools, request.forced_tools, parallel=request.parallel_tool_calls)
    except ChatEnvError as e:
        raise APIError(str(e), param="tool_choice", code="unsupported_parameter") from None
    return {"grammar": grammar}
