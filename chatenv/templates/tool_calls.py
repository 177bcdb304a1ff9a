r"""Tool-call formats: how a template writes the assistant's tool calls, and reading them back from a reply.

Two formats are built in:

- ``hermes`` (Qwen2.5, the ``smollm2-tools`` variant): each call is a JSON object
  ``{"name": ..., "arguments": {...}}`` inside ``<tool_call>`` ... ``</tool_call>``, after any text content.
- ``llama3_json`` (Llama 3): the whole reply is one JSON object ``{"name": ..., "parameters": {...}}``, or a JSON
  list of them for several calls (optionally after ``<|python_tag|>``).

A reply is read from its own token ids (the span up to the end-of-turn id). When the tokenizer has the format's
markers as single tokens (Qwen2.5's ``<tool_call>`` is one), the ids are split at those ids, so text that only
spells a marker is content, never a call; otherwise the reply's decoded text is split at the marker strings.
Every block that looks like a call but cannot be read (bad JSON, no name, no closing marker) becomes a
:class:`MalformedCall`, so the env can tell the model what was wrong instead of dropping it.

Example:
    >>> calls = get_tool_format("hermes").parse_text(
    ...     'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    ... )
    >>> calls.content, calls.calls[0].name, calls.calls[0].arguments, calls.canonical
    ('Let me add.', 'add', {'a': 1, 'b': 2}, True)
    >>> get_tool_format("hermes").parse_text("<tool_call>{oops}</tool_call>").malformed[0].reason.split(";")[0]
    'not valid JSON: Expecting property name enclosed in double quotes (at char 1)'
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MalformedCall",
    "ParsedCalls",
    "ToolCall",
    "ToolCallFormat",
    "block_body",
    "get_tool_format",
    "list_tool_formats",
    "normalize_call",
    "register_tool_format",
]


@dataclass(frozen=True)
class ToolCall:
    """One call the assistant made: an id (assigned by the env), the tool's name and its arguments."""

    id: str
    name: str
    arguments: dict[str, Any]

    def to_message(self) -> dict[str, Any]:
        """The call as it appears in an assistant message's ``tool_calls`` (OpenAI form, arguments as a dict)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class MalformedCall:
    """A block the assistant meant as a call that could not be read.

    Attributes:
        id: The id its error message answers to.
        text: The block as written.
        reason: What was wrong, in words the model can act on.
        name: The tool it names, when that much could be read (else None).
    """

    id: str
    text: str
    reason: str
    name: str | None = None


@dataclass(frozen=True)
class ParsedCalls:
    """The calls of one reply, in the order written.

    Attributes:
        content: The reply's text content (before the calls).
        items: Calls and malformed calls, in order.
        canonical: True when the reply is exactly content followed by well-formed calls (whitespace between
            them), so the message ``{"content", "tool_calls"}`` says everything the reply said. Otherwise the
            reply keeps its whole text as content and the readable calls still run.
        reasoning: The reply's reasoning, split off before the calls were read (templates with a reasoning
            format), or None.
        raw: The reply's text (without its reasoning) as the model wrote it.
    """

    content: str
    items: tuple[ToolCall | MalformedCall, ...] = ()
    canonical: bool = True
    reasoning: str | None = None
    raw: str | None = None

    @property
    def text(self) -> str:
        """The reply's text without its reasoning: what it keeps as content when its calls are not canonical."""
        return self.raw if self.raw is not None else self.content

    @property
    def calls(self) -> list[ToolCall]:
        """The well-formed calls."""
        return [c for c in self.items if isinstance(c, ToolCall)]

    @property
    def malformed(self) -> list[MalformedCall]:
        """The blocks that could not be read."""
        return [c for c in self.items if isinstance(c, MalformedCall)]


def normalize_call(call: Any, call_id: str) -> ToolCall | MalformedCall:
    """A call object (``{"name", "arguments"}``, ``{"name", "parameters"}`` or OpenAI's ``{"function": {...}}``)."""
    text = json.dumps(call, ensure_ascii=False, default=str)
    if not isinstance(call, dict):
        return MalformedCall(call_id, text, f"a call must be a JSON object, got {type(call).__name__}")
    function = call.get("function")
    fn: dict[Any, Any] = function if isinstance(function, dict) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        return MalformedCall(call_id, text, 'the call has no "name" (a non-empty string)')
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return MalformedCall(call_id, text, f"the arguments are not valid JSON: {e.msg} (at char {e.pos})")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return MalformedCall(call_id, text, f"the arguments must be a JSON object, got {type(args).__name__}")
    return ToolCall(str(call.get("id") or call_id), name, args)


def block_body(pieces: Sequence[str | int], k: int) -> str:
    """The text right after the marker at ``pieces[k]`` (``""`` when a marker or nothing follows it).

    For :meth:`ToolCallFormat.parse_pieces` implementations: the body of a block that ``pieces[k]`` opens.
    """
    following = pieces[k + 1] if k + 1 < len(pieces) else None
    return following if isinstance(following, str) else ""


def _load(text: str, call_id: str, hint: str) -> ToolCall | MalformedCall:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return MalformedCall(call_id, text, f"not valid JSON: {e.msg} (at char {e.pos}); write {hint}")
    return normalize_call(obj, call_id)


class ToolCallFormat(abc.ABC):
    """How a template writes tool calls.

    Attributes:
        name: Registry name.
        markers: The strings that open and close a call block, if the format has them.
    """

    name: str = ""
    markers: tuple[str, ...] = ()

    @abc.abstractmethod
    def parse_pieces(self, pieces: Sequence[str | int], id_prefix: str) -> ParsedCalls:
        """Read calls from a reply given as text pieces and marker indices (``int``: index into :attr:`markers`)."""

    def call_start(self, text: str) -> int | None:
        """Where a call could begin in ``text``, the start of a reply still being written (None: nowhere yet).

        The text before it is content whatever the model writes next (what a streaming response may send before
        the reply is read). Formats with markers: the first marker, or a marker's beginning at the end of the text;
        without markers: 0 (a call could be the whole reply) unless a subclass knows better.
        """
        if not self.markers:
            return 0
        found = [at for at in (text.find(m) for m in self.markers) if at >= 0]
        for m in self.markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    found.append(len(text) - k)
                    break
        return min(found, default=None)

    def parse_text(self, text: str, id_prefix: str = "call_") -> ParsedCalls:
        """Read calls from a reply's text (its markers matched as strings)."""
        return dataclasses.replace(self._parse_text(text, id_prefix), raw=text)

    def _parse_text(self, text: str, id_prefix: str) -> ParsedCalls:
        if not self.markers:
            return self.parse_pieces([text], id_prefix)
        pattern = "(" + "|".join(re.escape(m) for m in self.markers) + ")"
        pieces: list[str | int] = []
        for k, part in enumerate(re.split(pattern, text)):
            if k % 2:
                pieces.append(self.markers.index(part))
            elif part:
                pieces.append(part)
        return self.parse_pieces(pieces, id_prefix)

    def parse_ids(
        self, ids: Sequence[int], decode: Callable[[list[int]], str], marker_ids: Sequence[int | None], id_prefix: str
    ) -> ParsedCalls:
        """Read calls from a reply's ids: split at marker ids when every marker is one token, else by text.

        Args:
            ids: The reply's ids, without the end-of-turn id.
            decode: Ids to text.
            marker_ids: The single-token id of each marker, or None where a marker is not one token.
            id_prefix: Prefix of the call ids (``call_`` gives ``call_0``, ``call_1``, ...).
        """
        if not self.markers or any(m is None for m in marker_ids):
            return self.parse_text(decode(list(ids)), id_prefix)
        return dataclasses.replace(self._parse_ids(ids, decode, marker_ids, id_prefix), raw=decode(list(ids)))

    def _parse_ids(
        self, ids: Sequence[int], decode: Callable[[list[int]], str], marker_ids: Sequence[int | None], id_prefix: str
    ) -> ParsedCalls:
        index = {int(m): k for k, m in enumerate(marker_ids) if m is not None}  # parse_ids checked: none is None
        pieces: list[str | int] = []
        run: list[int] = []
        for i in ids:
            if int(i) in index:
                if run:
                    pieces.append(decode(run))
                    run = []
                pieces.append(index[int(i)])
            else:
                run.append(int(i))
        if run:
            pieces.append(decode(run))
        return self.parse_pieces(pieces, id_prefix)


class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after the content."""

    name = "hermes"
    markers = ("<tool_call>", "</tool_call>")
    _HINT = '{"name": ..., "arguments": {...}}'

    def parse_pieces(self, pieces: Sequence[str | int], id_prefix: str) -> ParsedCalls:  # noqa: D102
        if 0 not in pieces:
            return ParsedCalls("".join(p if isinstance(p, str) else self.markers[p] for p in pieces))
        first = pieces.index(0)
        content = "".join(p if isinstance(p, str) else self.markers[p] for p in pieces[:first])
        canonical = 1 not in pieces[:first] and (not content or content.endswith("\n"))
        items: list[ToolCall | MalformedCall] = []
        k = first
        while k < len(pieces):
            piece = pieces[k]
            if piece != 0:  # text between blocks, or a stray closing marker
                text = piece if isinstance(piece, str) else self.markers[piece]
                canonical = canonical and isinstance(piece, str) and not text.strip()
                k += 1
                continue
            call_id = f"{id_prefix}{len(items)}"
            body = block_body(pieces, k)
            closed = k + 1 + bool(body) < len(pieces) and pieces[k + 1 + bool(body)] == 1
            if not closed:
                items.append(MalformedCall(call_id, self.markers[0] + body, "the call has no closing </tool_call>"))
                canonical = False
                k += 1 + bool(body)
                continue
            items.append(_load(body.strip(), call_id, self._HINT))
            canonical = canonical and isinstance(items[-1], ToolCall) and body.startswith("\n") and body.endswith("\n")
            k += 2 + bool(body)
        return ParsedCalls(content[:-1] if content.endswith("\n") else content, tuple(items), canonical)


_LLAMA_CALL_START = re.compile(r'^\s*(?:<\|python_tag\|>)?\s*(?:\{\s*"name"|\[\s*\{)')


class Llama3JsonFormat(ToolCallFormat):
    """The whole reply is ``{"name": ..., "parameters": {...}}`` or a JSON list of such objects."""

    name = "llama3_json"
    _HINT = '{"name": ..., "parameters": {...}}'

    def call_start(self, text: str) -> int | None:  # noqa: D102
        # a call is the whole reply: 0 while the text can still become one, else None (it is all content)
        rest = text.lstrip()
        tag = "<|python_tag|>"
        if tag.startswith(rest):
            return 0
        rest = rest.removeprefix(tag).lstrip()
        if not rest:
            return 0
        inner = rest[1:].lstrip()
        if rest[0] == "{" and (inner.startswith('"name"') or '"name"'.startswith(inner)):
            return 0
        if rest[0] == "[" and (not inner or inner[0] == "{"):
            return 0
        return None

    def parse_pieces(self, pieces: Sequence[str | int], id_prefix: str) -> ParsedCalls:  # noqa: D102
        text = "".join(p for p in pieces if isinstance(p, str))
        if not _LLAMA_CALL_START.match(text):
            return ParsedCalls(text)
        body = text.strip().removeprefix("<|python_tag|>").strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            reason = f"not valid JSON: {e.msg} (at char {e.pos}); write {self._HINT}"
            return ParsedCalls("", (MalformedCall(f"{id_prefix}0", body, reason),), canonical=False)
        objs = obj if isinstance(obj, list) else [obj]
        items = tuple(normalize_call(o, f"{id_prefix}{k}") for k, o in enumerate(objs))
        if not items:
            return ParsedCalls(text)
        canonical = all(isinstance(c, ToolCall) for c in items) and not text.lstrip().startswith("<|python_tag|>")
        return ParsedCalls("", items, canonical)


_FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}


def register_tool_format(fmt: ToolCallFormat, *, overwrite: bool = False) -> ToolCallFormat:
    """Register a tool-call format (an instance of a :class:`ToolCallFormat` subclass) under ``fmt.name``.

    Templates without a registered format get one by derivation: the template renders a probe call and every
    registered format tries to read it back (see :mod:`chatenv.templates.derive`), so a new format is picked up
    by every template that writes calls its way.

    Raises:
        TypeError: If ``fmt`` is not a :class:`ToolCallFormat`.
        ValueError: If it has no name, or the name is taken and ``overwrite`` is False.
    """
    if not isinstance(fmt, ToolCallFormat):
        raise TypeError(f"expected a ToolCallFormat instance, got {type(fmt).__name__}")
    if not isinstance(fmt.name, str) or not fmt.name:
        raise ValueError("a tool-call format needs a non-empty str `name`")
    if fmt.name in _FORMATS and not overwrite:
        raise ValueError(f"a tool-call format named {fmt.name!r} is registered; pass overwrite=True to replace it")
    _FORMATS[fmt.name] = fmt
    return fmt


def list_tool_formats() -> list[str]:
    """Names of the registered tool-call formats, in registration order."""
    return list(_FORMATS)


def get_tool_format(name: str) -> ToolCallFormat:
    """A registered tool-call format by name (built in: ``hermes``, ``llama3_json``).

    Raises:
        ValueError: For an unknown name.
    """
    if name not in _FORMATS:
        raise ValueError(f"unknown tool-call format {name!r} (known: {', '.join(sorted(_FORMATS))})")
    return _FORMATS[name]
