r"""Forced tool calls: the grammar a reply must match to be a call of an offered function, in the template's format.

``tool_choice: "required"`` (or a named function) is served by constrained decoding: the policy samples only tokens
that keep the reply a prefix of a valid call written the way the model's own template writes calls, then ends it
(see ``grammar`` in :class:`~chatenv.sampling.GenerationSettings`; the policy wrappers apply it). The call's frame
is not hand-written per format: it is read from the template by rendering a probe call (:func:`call_frame`), then
checked by reading a call written in that frame back as the endpoint reads replies (the template's
:class:`~chatenv.templates.tool_calls.ToolCallFormat`). Templates that write a call as the function's name then its
arguments as one JSON object can be forced (in TRL's template corpus: the ``hermes`` templates of Qwen 2.5 / Qwen 3
and the ``llama3_json`` ones of Llama 3.1 / 3.2); the others (arguments written as XML-like text or Python, or a
frame that does not read back) are refused, naming the format.

The arguments are constrained to JSON matching the function's ``parameters`` schema (its required keys, types,
enums) where the grammar compiler supports the schema; a schema it cannot compile falls back to any JSON object.
With ``parallel`` the reply may hold several calls (as the template joins them); without it, it ends after the first.

Grammars are written in xgrammar's EBNF dialect (``xgrammar``: in the ``serve`` extra, and ``vllm`` ships it),
built lazily and cached per template, tools and choice.

Example:
    >>> from chatenv import chat_tokenizer
    >>> from chatenv.models import load_default_tokenizer
    >>> from chatenv.templates import get_template
    >>> ct = chat_tokenizer(load_default_tokenizer(), get_template("smollm2-tools"))
    >>> frame = call_frame(ct)
    >>> frame.before, frame.between, frame.after
    ('<tool_call>\n{"name": "', '", "arguments": ', '}\n</tool_call>')
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chatenv.errors import ChatEnvError, MissingDependencyError, TemplateError

__all__ = ["CallFrame", "call_frame", "first_call_grammar", "forced_call_grammar"]

# probe words, tokenized and trimmed as plain words (as the template derivation's)
_NAMES = ("Zqfx", "Zqgx")
_ARGS = ({"Zqkx": "Zqvx"}, {"Zqlx": "Zqwx"})


@dataclass(frozen=True)
class CallFrame:
    """How a template writes calls, around the function's name and its JSON arguments.

    One call is ``before + NAME + between + ARGUMENTS + after``; several (when the template writes them, else
    ``many_before`` is None) are ``many_before + NAME + between + ARGUMENTS`` then ``(separator + NAME + between +
    ARGUMENTS)`` per further call, then ``many_after``. NAME is written as in a JSON string (the frames quote it).

    Attributes:
        format: The template's tool-call format name.
        before: Text from the start of the reply to the first name (the template's reply prefix included).
        between: Text between a name and its arguments.
        after: Text after the last arguments, up to the end-of-turn token (which the policy's stop ids end).
        many_before: ``before`` of a reply with several calls.
        separator: Text between one call's arguments and the next name.
        many_after: ``after`` of a reply with several calls.
    """

    format: str
    before: str
    between: str
    after: str
    many_before: str | None = None
    separator: str | None = None
    many_after: str | None = None


def _probe_tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": _NAMES[k], "parameters": {"type": "object"}}} for k in range(n)]


def _reply_text(ct: Any, n: int) -> str | None:
    """The text of a reply making ``n`` probe calls, without its end-of-turn token (None: the template fails).

    Arguments go as objects, else as JSON strings (OpenAI's wire form, which some templates want).
    """
    for as_text in (False, True):
        calls = [
            {"type": "function", "function": {"name": _NAMES[k], "arguments": json.dumps(a) if as_text else a}}
            for k, a in enumerate(_ARGS[:n])
        ]
        reply = {"role": "assistant", "content": "", "tool_calls": calls}
        try:
            ids = ct.reply([{"role": "user", "content": "Zq1x"}], reply, tools=_probe_tools(n)).ids.tolist()
        except (ChatEnvError, ValueError, TypeError):
            continue
        if ids and ids[-1] in ct.stop_ids:
            ids = ids[:-1]
        return str(ct.decode(ids))
    return None


def _arguments_span(text: str, start: int, key: str) -> tuple[int, int] | None:
    """Where the probe's arguments object is written in ``text`` (after ``start``), if it is JSON."""
    at = text.find(json.dumps(key), start)
    if at < 0:
        return None
    open_at = text.rfind("{", start, at)
    close_at = text.find("}", at)
    if open_at < 0 or close_at < 0:
        return None
    try:
        ok = json.loads(text[open_at : close_at + 1]) == {key: _ARGS[_key_index(key)][key]}
    except json.JSONDecodeError:
        ok = False
    return (open_at, close_at + 1) if ok else None


def _key_index(key: str) -> int:
    return next(k for k, a in enumerate(_ARGS) if key in a)


def _split(text: str | None, n: int) -> list[str] | None:
    """``text`` cut around each probe call's name and arguments: [before, between, sep, between, ..., after]."""
    if text is None:
        return None
    pieces, pos = [], 0
    for k in range(n):
        name = text.find(_NAMES[k], pos)
        if name < 0 or text.count(_NAMES[k]) != 1:
            return None
        span = _arguments_span(text, name + len(_NAMES[k]), next(iter(_ARGS[k])))
        if span is None:
            return None
        pieces += [text[pos:name], text[name + len(_NAMES[k]) : span[0]]]
        pos = span[1]
    return [*pieces, text[pos:]]


def _reads_back(ct: Any, text: str, names: Sequence[str]) -> bool:
    """Whether the endpoint reads ``text``, as the model would write it, as exactly these calls (arguments {a: 1})."""
    ids = ct.tokenizer.encode(text, add_special_tokens=False)  # markup spelled in the text is markup, as generated
    parsed = ct.parse_tool_calls(ids)
    calls = parsed.calls
    return (
        parsed.canonical
        and not parsed.content.strip()
        and [c.name for c in calls] == list(names)
        and all(c.arguments == {"a": 1} for c in calls)
    )


def call_frame(ct: Any) -> CallFrame:
    """The frame of the calls ``ct``'s template writes (rendered, then read back with its format).

    Raises:
        TemplateError: For a template without a tool-call format, one whose calls are not a name and a JSON object
            of arguments, or a frame its own format does not read back.
    """
    fmt = ct.tool_format
    name = ct.template.name or "<tokenizer template>"
    if fmt is None:
        raise TemplateError(f"the template {name!r} has no tool-call format: no call can be forced")
    one = _split(_reply_text(ct, 1), 1)
    if one is None:
        raise TemplateError(
            f"the template {name!r} writes calls in the {fmt.name!r} format, whose arguments are not a JSON object "
            "after the function's name: forced calls (tool_choice 'required' or a named function) are built for "
            "templates that write a name then a JSON object of arguments (hermes, llama3_json)"
        )
    before, between, after = one
    if not _reads_back(ct, before + "f" + between + '{"a": 1}' + after, ["f"]):
        raise TemplateError(f"the {fmt.name!r} format does not read back a call written as the template {name!r} does")
    frame = CallFrame(fmt.name, before, between, after)
    many = _split(_reply_text(ct, 2), 2)
    if many is not None and many[1] == between == many[3]:
        two = many[0] + "f" + between + '{"a": 1}' + many[2] + "g" + between + '{"a": 1}' + many[4]
        if _reads_back(ct, two, ["f", "g"]):
            frame = CallFrame(fmt.name, before, between, after, many[0], many[2], many[4])
    return frame


def _literal(text: str) -> str:
    """An EBNF string literal of ``text``."""
    return json.dumps(text, ensure_ascii=False)


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise MissingDependencyError(
            "forced tool calls (constrained decoding) need xgrammar; install the 'serve' extra: "
            "pip install 'chatenv-gym[serve]' (vllm installs it too)"
        ) from e
    return xgrammar


def _arguments_grammar(xg: Any, schema: Any) -> Any:
    """The grammar of one function's arguments: JSON matching its schema, else any JSON object."""
    if isinstance(schema, Mapping) and schema:
        try:
            return xg.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        except Exception:  # noqa: BLE001 - a schema the compiler cannot take: any JSON object still parses
            pass
    return xg.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False)


def _call_rule(xg: Any, frame: CallFrame, tools: Sequence[Mapping[str, Any]]) -> str:
    """EBNF of ``call``: one offered function's quoted name, the frame's middle and its arguments."""
    grammars = []
    for tool in tools:
        fn = tool.get("function", tool)
        head = xg.Grammar.from_ebnf(
            "root ::= " + _literal(json.dumps(fn["name"], ensure_ascii=False)[1:-1] + frame.between)
        )
        grammars.append(xg.Grammar.concat(head, _arguments_grammar(xg, fn.get("parameters"))))
    union = grammars[0] if len(grammars) == 1 else xg.Grammar.union(*grammars)
    # the union's root is this grammar's ``call`` (no rule refers to root: its rules are the schemas' and literals')
    return re.sub(r"^root ::=", "call ::=", str(union), count=1, flags=re.M)


@functools.lru_cache(maxsize=64)
def _grammar(frame: CallFrame, tools_json: str, parallel: bool) -> str:
    xg = _xgrammar()
    call = _call_rule(xg, frame, json.loads(tools_json))
    root = f"root ::= {_literal(frame.before)} call {_literal(frame.after)}"
    if parallel and frame.many_before is not None:
        first, separator, last = (_literal(x or "") for x in (frame.many_before, frame.separator, frame.many_after))
        many = f"{first} call ({separator} call)+ {last}"
        root = f"root ::= ({_literal(frame.before)} call {_literal(frame.after)}) | ({many})"
    grammar = f"{root}\n{call}"
    xg.Grammar.from_ebnf(grammar)  # checked here: a bad grammar fails the request, not the policy's worker
    return grammar


def forced_call_grammar(
    ct: Any, tools: Sequence[Mapping[str, Any]], names: Sequence[str] | None = None, *, parallel: bool = True
) -> str:
    """The EBNF grammar of a reply that calls one of ``tools`` (those named by ``names``) in ``ct``'s format.

    Args:
        ct: The chat tokenizer the reply is generated with (its template writes the calls).
        tools: The request's tools (OpenAI's function schemas).
        names: The functions that may be called (None: any of ``tools``).
        parallel: Whether the reply may make several calls (where the template writes several); else it ends after
            the first.

    Raises:
        TemplateError: For a template whose calls cannot be forced (see :func:`call_frame`), or a name that is not
            among the tools.
    """
    offered = {t.get("function", t).get("name"): t for t in tools}
    wanted = list(offered) if names is None else list(names)
    missing = [n for n in wanted if n not in offered]
    if missing or not wanted:
        raise TemplateError(f"no tool named {missing or wanted} is offered (tools: {sorted(offered)})")
    chosen = [offered[n] for n in wanted]
    return _grammar(_cached_frame(ct), json.dumps(chosen, sort_keys=True), parallel)


def first_call_grammar(ct: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """The EBNF grammar of a free reply that makes at most one call (``parallel_tool_calls: false`` without forcing).

    The reply is free text until it opens a call (the template's call marker, or the frame's whole opening for a
    format without markers); the call is then one of ``tools`` with JSON arguments, and the reply ends after it.

    Raises:
        TemplateError: For a template whose calls cannot be forced (see :func:`call_frame`).
    """
    frame = _cached_frame(ct)
    markers = [m for m in ct.tool_format.markers if m in frame.before]
    trigger = frame.before[frame.before.rfind(markers[0]) :] if markers else frame.before
    return _first_call(trigger, frame, json.dumps(list(tools), sort_keys=True))


@functools.lru_cache(maxsize=64)
def _first_call(trigger: str, frame: CallFrame, tools_json: str) -> str:
    xg = _xgrammar()
    tags = []
    for tool in json.loads(tools_json):
        fn = tool.get("function", tool)
        schema = dict(fn.get("parameters") or {"type": "object"})
        schema.setdefault("additionalProperties", False)  # as the forced calls' (strict) schemas
        name = json.dumps(fn["name"], ensure_ascii=False)[1:-1]
        begin = trigger + name + frame.between  # the trigger ends the frame's opening: the text before it is free
        content = {"type": "json_schema", "json_schema": schema}
        tags.append({"type": "tag", "begin": begin, "content": content, "end": frame.after})
    spec = {"triggers": [trigger], "tags": tags, "stop_after_first": True}
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", **spec}}
    grammar = str(xg.Grammar.from_structural_tag(json.dumps(tag)))
    xg.Grammar.from_ebnf(grammar)
    return grammar


_FRAMES: dict[int, tuple[Any, CallFrame]] = {}


def _cached_frame(ct: Any) -> CallFrame:
    """:func:`call_frame`, once per chat tokenizer."""
    held = _FRAMES.get(id(ct))
    if held is None or held[0] is not ct:
        held = _FRAMES[id(ct)] = (ct, call_frame(ct))
    return held[1]
