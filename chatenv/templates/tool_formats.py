r"""More tool-call formats: the ways today's chat templates write calls, read back from a reply.

Each format is registered (:func:`~chatenv.templates.tool_calls.register_tool_format`), so derivation
(:mod:`chatenv.templates.derive`) checks it against every template: a call the template renders must be read back
as the same call.

- ``qwen3_xml`` (Qwen3.5/3.6/3.8, Nemotron 3): ``<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>
  ...</function>\n</tool_call>``;
- ``pythonic`` (LFM2): ``<|tool_call_start|>[name(key='value', n=2)]<|tool_call_end|>``;
- ``gemma4`` (Gemma 4): ``<|tool_call>call:NAME{key:<|"|>value<|"|>,n:2}<tool_call|>``;
- ``glm`` (GLM-4.5/4.6): ``<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>``;
- ``deepseek_v3`` (DeepSeek V3): ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```
  <｜tool▁call▁end｜>`` inside ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>``;
- ``gpt_oss`` (gpt-oss): `` to=functions.NAME<|channel|>commentary json<|message|>{...}``, ended by ``<|call|>``;
- ``atem`` (Muse Glimmer): `` to=NAME<|message|><atem:function_calls><atem:invoke name="NAME">`` with
  ``<atem:parameter name="KEY">VALUE</atem:parameter>`` lines.

Values written as text (XML-like formats) are read as JSON when they parse (``2`` is the number 2), else as
strings.

Example:
    >>> from chatenv.templates.tool_calls import get_tool_format
    >>> calls = get_tool_format("gemma4").parse_text('<|tool_call>call:add{a:1,b:<|"|>x<|"|>}<tool_call|>')
    >>> calls.calls[0].name, calls.calls[0].arguments, calls.canonical
    ('add', {'a': 1, 'b': 'x'}, True)
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Sequence
from typing import Any

from chatenv.templates.tool_calls import (
    MalformedCall,
    ParsedCalls,
    ToolCall,
    ToolCallFormat,
    block_body,
    register_tool_format,
)

__all__ = [
    "AtemFormat",
    "BlockFormat",
    "DeepSeekV3Format",
    "Gemma4Format",
    "GlmFormat",
    "GptOssFormat",
    "PythonicFormat",
    "Qwen3XmlFormat",
]


def _value(text: str) -> Any:
    """A value written as text: JSON when it parses, else the text."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return text


def _is_outer_marker(piece: str | int) -> bool:
    """Whether a piece is a marker that may stand between blocks (any after the opening and the closing one)."""
    return isinstance(piece, int) and piece >= 2


class BlockFormat(ToolCallFormat):
    """Calls written as blocks between an opening and a closing marker, after any text content.

    Subclasses set :attr:`markers` (opening, closing, then markers that may stand between blocks and are ignored)
    and implement :meth:`read`.
    """

    def read(self, body: str, call_id: str) -> ToolCall | MalformedCall:
        """One call from the text between the markers."""
        raise NotImplementedError

    def parse_pieces(self, pieces: Sequence[str | int], id_prefix: str) -> ParsedCalls:  # noqa: D102
        text = [p if isinstance(p, str) else self.markers[p] for p in pieces]
        if 0 not in pieces:
            return ParsedCalls("".join(text))
        first = pieces.index(0)
        while first > 0 and _is_outer_marker(pieces[first - 1]):
            first -= 1  # an outer marker that opens the list of calls
        content = "".join(text[:first])
        canonical = all(not isinstance(p, int) for p in pieces[:first])
        items: list[ToolCall | MalformedCall] = []
        k = first
        while k < len(pieces):
            piece = pieces[k]
            if piece != 0:
                canonical = canonical and (isinstance(piece, int) and piece >= 2 or not str(piece).strip())
                k += 1
                continue
            call_id = f"{id_prefix}{len(items)}"
            body = block_body(pieces, k)
            after = k + 1 + bool(body)
            if after >= len(pieces) or pieces[after] != 1:
                closing = self.markers[1]
                items.append(MalformedCall(call_id, self.markers[0] + body, f"the call has no closing {closing}"))
                canonical = False
                k = after
                continue
            items.append(self.read(body, call_id))
            canonical = canonical and isinstance(items[-1], ToolCall)
            k = after + 1
        return ParsedCalls(content.rstrip("\n"), tuple(items), canonical)


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)


class Qwen3XmlFormat(BlockFormat):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`` (XML-like)."""

    name = "qwen3_xml"
    markers = ("<tool_call>", "</tool_call>")

    def read(self, body: str, call_id: str) -> ToolCall | MalformedCall:  # noqa: D102
        m = _XML_FUNCTION.fullmatch(body)
        if m is None:
            return MalformedCall(call_id, body, "write <function=NAME> then <parameter=KEY>VALUE</parameter> blocks")
        args, pos, inner = {}, 0, m.group(2)
        for p in _XML_PARAMETER.finditer(inner):
            if inner[pos : p.start()].strip():
                return MalformedCall(call_id, body, f"unexpected text in the call: {inner[pos : p.start()]!r:.60}")
            args[p.group(1).strip()] = _value(p.group(2))
            pos = p.end()
        if inner[pos:].strip():
            return MalformedCall(call_id, body, f"unexpected text in the call: {inner[pos:]!r:.60}")
        return ToolCall(call_id, m.group(1).strip(), args)


class GlmFormat(BlockFormat):
    """``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``."""

    name = "glm"
    markers = ("<tool_call>", "</tool_call>")
    _PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)

    def read(self, body: str, call_id: str) -> ToolCall | MalformedCall:  # noqa: D102
        name, _, rest = body.partition("\n") if "<arg_key>" in body else (body, "", "")
        name = name.strip()
        if not name or "<" in name or "{" in name:
            return MalformedCall(call_id, body, "write the function name, then <arg_key>/<arg_value> pairs")
        args, pos = {}, 0
        for p in self._PAIR.finditer(rest):
            if p.start() != pos:
                return MalformedCall(call_id, body, f"unexpected text in the call: {rest[pos : p.start()]!r:.60}")
            args[p.group(1).strip()] = _value(p.group(2))
            pos = p.end()
        if rest[pos:].strip():
            return MalformedCall(call_id, body, f"unexpected text in the call: {rest[pos:]!r:.60}")
        return ToolCall(call_id, name, args)


class PythonicFormat(BlockFormat):
    """``<|tool_call_start|>[name(key=value, ...), ...]<|tool_call_end|>``: a Python list of calls (literals only)."""

    name = "pythonic"
    markers = ("<|tool_call_start|>", "<|tool_call_end|>")

    def read(self, body: str, call_id: str) -> ToolCall | MalformedCall:  # noqa: D102
        calls = self.read_all(body, call_id)
        return calls[0] if len(calls) == 1 else MalformedCall(call_id, body, "one call per block")

    def read_all(self, body: str, call_id: str) -> list[ToolCall | MalformedCall]:
        """Every call of one block (a Python list)."""
        try:
            tree = ast.parse(body.strip(), mode="eval").body
        except SyntaxError as e:
            return [MalformedCall(call_id, body, f"not a Python list of calls: {e.msg}")]
        nodes = tree.elts if isinstance(tree, ast.List) else [tree]
        out: list[ToolCall | MalformedCall] = []
        for k, node in enumerate(nodes):
            cid = call_id if k == 0 else f"{call_id}_{k}"
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                out.append(MalformedCall(cid, body, "write name(key=value, ...) with keyword arguments"))
                continue
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            except ValueError:
                out.append(MalformedCall(cid, body, "argument values must be literals (strings, numbers, lists)"))
                continue
            out.append(ToolCall(cid, node.func.id, args))
        return out

    def parse_pieces(self, pieces: Sequence[str | int], id_prefix: str) -> ParsedCalls:  # noqa: D102
        parsed = super().parse_pieces(pieces, id_prefix)
        if not any(isinstance(c, MalformedCall) and c.reason == "one call per block" for c in parsed.items):
            return parsed
        items: list[ToolCall | MalformedCall] = []  # several calls in one list: number them in order
        for item in parsed.items:
            many = self.read_all(item.text, item.id) if isinstance(item, MalformedCall) else [item]
            items.extend(many)
        items = [
            ToolCall(f"{id_prefix}{k}", c.name, c.arguments) if isinstance(c, ToolCall) else c
            for k, c in enumerate(items)
        ]
        return ParsedCalls(
            parsed.content, tuple(items), parsed.canonical and all(isinstance(c, ToolCall) for c in items)
        )


_QUOTE = '<|"|>'
_BARE_KEY = re.compile(r"([{,]\s*)([A-Za-z_][A-Za-z0-9_]*)\s*:")


def _gemma_json(text: str) -> str:
    """Gemma 4's call arguments as JSON: ``<|"|>``-quoted strings, bare keys."""
    parts = text.split(_QUOTE)
    if len(parts) % 2 == 0:
        raise ValueError('an unclosed <|"|> string')
    out = []
    for k, part in enumerate(parts):
        out.append(json.dumps(part) if k % 2 else _BARE_KEY.sub(r'\1"\2":', part))
    return "".join(out)


class Gemma4Format(BlockFormat):
    """``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:2}<tool_call|>``."""

    name = "gemma4"
    markers = ("<|tool_call>", "<tool_call|>")

    def read(self, body: str, call_id: str) -> ToolCall | MalformedCall:  # noqa: D102
        m = re.fullmatch(r"call:([A-Za-z_][\w.\-]*)(\{.*\})", body.strip(), re.S)
        if m is None:
            return MalformedCall(call_id, body, 'write call:NAME{key:<|"|>value<|"|>,...}')
        try:
            args = json.loads(_gemma_json(m.group(2)))
        except (ValueError, json.JSONDecodeError) as e:
            return MalformedCall(call_id, body, f"the arguments cannot be read: {e}")
        if not isinstance(args, dict):
            return MalformedCall(call_id, body, "the arguments must be an object")
        return ToolCall(call_id, m.group(1), args)


class DeepSeekV3Format(BlockFormat):
    """``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + a fenced JSON object + ``<｜tool▁call▁end｜>``."""

    name = "deepseek_v3"
    markers = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    _BODY = re.compile(r"(\w+)<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*)\n```", re.S)

    def read(self, body: str, call_id: str) -> ToolCall | MalformedCall:  # noqa: D102
        m = self._BODY.fullmatch(body.strip())
        if m is None:
            return MalformedCall(call_id, body, "write function<｜tool▁sep｜>NAME, a newline, then ```json {...} ```")
        try:
            args = json.loads(m.group(3))
        except json.JSONDecodeError as e:
            return MalformedCall(call_id, body, f"the arguments are not valid JSON: {e.msg} (at char {e.pos})")
        if not isinstance(args, dict):
            return MalformedCall(call_id, body, "the arguments must be a JSON object")
        return ToolCall(call_id, m.group(2).strip(), args)


_GPT_OSS_CALL = re.compile(
    r"\s*(?:<\|channel\|>analysis<\|message\|>(?P<thought>.*?)<\|end\|><\|start\|>assistant)?"  # reasoning first
    r"(?:\s*to=functions\.(?P<head>[\w.\-]+)\s*<\|channel\|>commentary"  # the recipient in the role header
    r"|\s*<\|channel\|>commentary\s+to=functions\.(?P<channel>[\w.\-]+))"  # or in the channel header
    r"(?:\s*json)?(?:\s*<\|constrain\|>\s*json)?\s*<\|message\|>(?P<args>.*)",
    re.S,
)


class GptOssFormat(ToolCallFormat):
    """gpt-oss (harmony): one call per reply, ended by ``<|call|>`` (a stop token).

    A call is `` to=functions.NAME<|channel|>commentary json<|message|>{...}`` (as the template writes it) or
    ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`` (as the models often write it;
    then not canonical), optionally after an ``analysis`` message (the reasoning).
    """

    name = "gpt_oss"

    def parse_pieces(self, pieces: Sequence[str | int], id_prefix: str) -> ParsedCalls:  # noqa: D102
        text = "".join(p for p in pieces if isinstance(p, str))
        m = _GPT_OSS_CALL.fullmatch(text)
        if m is None:
            return ParsedCalls(text)
        call_id = f"{id_prefix}0"
        reasoning = m.group("thought")
        canonical = m.group("head") is not None and reasoning is None
        try:
            args = json.loads(m.group("args"))
        except json.JSONDecodeError as e:
            reason = f"the arguments are not valid JSON: {e.msg} (at char {e.pos})"
            bad = MalformedCall(call_id, text, reason, m.group("head") or m.group("channel"))
            return ParsedCalls("", (bad,), False, reasoning=reasoning)
        name = m.group("head") or m.group("channel")
        if not isinstance(args, dict):
            bad = MalformedCall(call_id, text, "the arguments must be a JSON object", name)
            return ParsedCalls("", (bad,), False, reasoning=reasoning)
        return ParsedCalls("", (ToolCall(call_id, name, args),), canonical, reasoning=reasoning)


_ATEM_BLOCK = re.compile(
    r"\s*to=([\w.\-]+)<\|message\|><atem:function_calls>\n?(.*?)</atem:function_calls>(?:<\|eom\|><\|start\|>assistant)?",
    re.S,
)
_ATEM_INVOKE = re.compile(r'\s*<atem:invoke name="([^"]+)">\n?(.*?)</atem:invoke>\s*', re.S)
_ATEM_PARAMETER = re.compile(r'<atem:parameter name="([^"]+)">(.*?)</atem:parameter>\n?', re.S)


class AtemFormat(ToolCallFormat):
    """Muse Glimmer's calls: `` to=NAME<|message|><atem:function_calls>`` blocks.

    Each holds one ``<atem:invoke name=NAME>`` with its parameters; calls are joined by ``<|eom|><|start|>assistant``.
    """

    name = "atem"

    def parse_pieces(self, pieces: Sequence[str | int], id_prefix: str) -> ParsedCalls:  # noqa: D102
        text = "".join(p for p in pieces if isinstance(p, str))
        if not _ATEM_BLOCK.match(text):
            return ParsedCalls(text)
        items: list[ToolCall | MalformedCall] = []
        pos = 0
        for block in _ATEM_BLOCK.finditer(text):
            call_id = f"{id_prefix}{len(items)}"
            if block.start() != pos:
                break
            pos = block.end()
            invoke = _ATEM_INVOKE.fullmatch(block.group(2))
            if invoke is None or invoke.group(1) != block.group(1):
                items.append(MalformedCall(call_id, block.group(0), "write one <atem:invoke name=...> per call"))
                continue
            params = {m.group(1): _value(m.group(2)) for m in _ATEM_PARAMETER.finditer(invoke.group(2))}
            items.append(ToolCall(call_id, invoke.group(1), params))
        canonical = pos == len(text) and all(isinstance(c, ToolCall) for c in items)
        return ParsedCalls("", tuple(items), canonical)


for _fmt in (
    Qwen3XmlFormat(),
    GlmFormat(),
    PythonicFormat(),
    Gemma4Format(),
    DeepSeekV3Format(),
    GptOssFormat(),
    AtemFormat(),
):
    register_tool_format(_fmt, overwrite=True)
