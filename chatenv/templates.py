"""Chat templates: rendering with exact assistant spans, parsing back, and a registry.

A :class:`ChatTemplate` is a Jinja source (the same dialect as Hugging Face tokenizers' ``chat_template``,
including ``{% generation %}`` markers around what the assistant produces) plus a parser that turns rendered
text back into messages. Rendering returns the text together with *segments*: which characters are template
markup and which are message content, and which belong to an assistant generation. Tokenization
(:mod:`chatenv.tokenization`) uses the segments so that content is always encoded as plain text (it can
never forge a special token) and so that the assistant mask is exact.

Templates are chosen explicitly by name, or taken from the tokenizer's own ``chat_template`` (used directly
when it has generation markers, otherwise matched by *behaviour* against the registered templates). The
model's name is never used to guess.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateError as JinjaTemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chatenv.errors import TemplateError, TemplateParseError

__all__ = [
    "ChatTemplate",
    "Rendered",
    "Segment",
    "get_template",
    "list_templates",
    "register_template",
    "resolve_template",
]

Message = Mapping[str, Any]
Parser = Callable[[str], list[dict[str, Any]]]

# Unicode noncharacters: reserved by the standard for a program's internal use, so they never occur in
# text a user means. They delimit generation blocks and content placeholders while rendering.
_GEN_OPEN, _GEN_CLOSE = "\ufdd0", "\ufdd1"
_SLOT_OPEN, _SLOT_CLOSE = "\ufdd2", "\ufdd3"
_RESERVED = re.compile("[\ufdd0-\ufdd3]")
_SLOT = re.compile(f"{_SLOT_OPEN}(\\d+){_SLOT_CLOSE}")


@dataclass(frozen=True)
class Segment:
    """A run of rendered characters with one kind.

    Attributes:
        start: Offset of the first character in the rendered text.
        end: Offset one past the last character.
        is_content: True for message content (tokenized as plain text), False for template markup.
        is_generation: True inside a ``{% generation %}`` block (what the assistant produces).
        message: Index of the message the segment belongs to (content segments), or -1 for markup.
    """

    start: int
    end: int
    is_content: bool
    is_generation: bool
    message: int = -1


@dataclass(frozen=True)
class Rendered:
    """The result of rendering a chat: the text and its segments, in order, covering the whole text."""

    text: str
    segments: tuple[Segment, ...]

    def generation_spans(self) -> list[tuple[int, int]]:
        """Character spans of the assistant generations, merged across segments."""
        spans: list[tuple[int, int]] = []
        for seg in self.segments:
            if not seg.is_generation:
                continue
            if spans and spans[-1][1] == seg.start:
                spans[-1] = (spans[-1][0], seg.end)
            else:
                spans.append((seg.start, seg.end))
        return spans


class _GenerationExtension(Extension):
    """Supports ``{% generation %} ... {% endgeneration %}`` by fencing the block's output."""

    tags = {"generation"}

    def parse(self, parser):  # noqa: D102
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_fence", []), [], [], body).set_lineno(lineno)

    def _fence(self, caller):
        return _GEN_OPEN + caller() + _GEN_CLOSE


def _raise_exception(message: str):
    raise TemplateError(f"the chat template refused the chat: {message}")


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
    # Hugging Face's dialect: plain JSON, no HTML escaping.
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


@functools.lru_cache(maxsize=64)
def _compile(source: str):
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationExtension, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except JinjaTemplateError as e:
        raise TemplateError(f"the chat template does not compile: {e}") from e


def _render_fenced(source: str, messages: list[dict], add_generation_prompt: bool, context: dict) -> tuple[str, list]:
    """Render, then strip the generation fences; returns the text and the generation spans."""
    try:
        raw = _compile(source).render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except JinjaTemplateError as e:
        raise TemplateError(f"rendering the chat template failed: {e}") from e
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


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template: a Jinja source with ``{% generation %}`` markers and a parser for its output.

    Attributes:
        name: Registry name (``""`` for a tokenizer's own, unregistered template).
        source: Jinja source, in the Hugging Face ``chat_template`` dialect.
        parser: Function from rendered text to a list of message dicts; the last message may carry
            ``"is_complete": False`` when the text stops inside it. ``None`` if the template cannot be parsed.
        description: One line for listings.
        strips_content: True when the template trims whitespace around message content (Llama 3 does), so
            rendering does not preserve leading or trailing whitespace.
        default_system: The system message the template inserts when a chat has none, if any.

    Example:
        >>> from chatenv.templates import get_template
        >>> t = get_template("chatml")
        >>> print(t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        ...                add_generation_prompt=True).text)
        <|im_start|>system
        Be brief.<|im_end|>
        <|im_start|>user
        Hi<|im_end|>
        <|im_start|>assistant
        <BLANKLINE>
    """

    name: str
    source: str
    parser: Parser | None = None
    description: str = ""
    strips_content: bool = False
    default_system: str | None = None
    context: Mapping[str, Any] = field(default_factory=dict)

    @property
    def has_generation_markers(self) -> bool:
        """Whether the source marks assistant generations with ``{% generation %}``."""
        return re.search(r"{%-?\s*generation\s*-?%}", self.source) is not None

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rendered:
        """Render messages to text with segments marking content and assistant generations.

        Args:
            messages: Message dicts with ``role`` and ``content`` (and optional ``tool_calls``).
            add_generation_prompt: Append the header that opens a new assistant turn.
            tools: Tool (function) schemas, for templates that describe tools to the model.

        Returns:
            The rendered text and its segments.

        Raises:
            TemplateError: If the template fails, or transforms content in a way that cannot be tracked.
        """
        msgs = [dict(m) for m in messages]
        for i, m in enumerate(msgs):
            content = m.get("content")
            if not isinstance(content, str):
                raise TypeError(f"message {i} content must be a str, got {type(content).__name__}")
            if _RESERVED.search(content):
                raise ValueError(
                    f"message {i} content holds a Unicode noncharacter in U+FDD0..U+FDD3, which chatenv "
                    "reserves for rendering; remove it"
                )
        context = dict(self.context)
        context["tools"] = list(tools) if tools else None
        text, gen_spans = _render_fenced(self.source, msgs, add_generation_prompt, context)
        slotted = [dict(m, content=f"{_SLOT_OPEN}{i}{_SLOT_CLOSE}" if m["content"] else "") for i, m in enumerate(msgs)]
        skeleton, _ = _render_fenced(self.source, slotted, add_generation_prompt, context)
        spans = _align(text, skeleton, msgs, self.name or "<tokenizer template>")
        return Rendered(text, tuple(_split_at(spans, gen_spans)))

    def parse(self, text: str) -> list[dict[str, Any]]:
        """Parse rendered text back into message dicts (see :meth:`History.from_text`)."""
        if self.parser is None:
            raise TemplateParseError(
                f"template {self.name or '<tokenizer template>'!r} has no parser; register one with "
                "chatenv.register_template(name, source, parser=...)"
            )
        return self.parser(text)


def _align(text: str, skeleton: str, msgs: list[dict], name: str) -> list[tuple[int, int, int]]:
    """Locate each content slot of the skeleton in the real text.

    Returns (start, end, message index or -1 for markup) spans covering ``text``.
    """
    parts = _SLOT.split(skeleton)  # literal, index, literal, index, ..., literal
    spans: list[tuple[int, int, int]] = []
    pos = 0

    def fail(detail: str):
        raise TemplateError(
            f"template {name!r} renders message content in a way chatenv cannot track ({detail}); "
            "only verbatim or whitespace-trimmed content is supported"
        )

    for k in range(0, len(parts), 2):
        literal = parts[k]
        if not text.startswith(literal, pos):
            fail(f"markup differs at offset {pos}")
        if literal:
            spans.append((pos, pos + len(literal), -1))
        pos += len(literal)
        if k + 1 >= len(parts):
            break
        idx = int(parts[k + 1])
        following = parts[k + 2]
        last = k + 2 == len(parts) - 1
        content = msgs[idx]["content"]
        for cand in dict.fromkeys((content, content.strip(), content.rstrip(), content.lstrip())):
            if not text.startswith(cand, pos):
                continue
            end = pos + len(cand)
            if (text[end:] == following) if last else text.startswith(following, end):
                break
        else:
            fail(f"content of message {idx} not found at offset {pos}")
        if cand:
            spans.append((pos, pos + len(cand), idx))
        pos += len(cand)
    if pos != len(text):
        fail("trailing text")
    return spans


def _split_at(spans: list[tuple[int, int, int]], gen_spans: list[tuple[int, int]]) -> list[Segment]:
    """Cut content/markup spans at generation boundaries."""
    cuts = sorted({p for span in gen_spans for p in span})
    out: list[Segment] = []
    for start, end, msg in spans:
        points = [start] + [c for c in cuts if start < c < end] + [end]
        for a, b in zip(points, points[1:]):
            in_gen = any(gs <= a and b <= ge for gs, ge in gen_spans)
            out.append(Segment(a, b, msg >= 0, in_gen, msg))
    return out


# --------------------------------------------------------------------------------------------- parsers


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
            messages.append({"role": role, "content": "", "is_complete": False})
            # a header cut mid-way cannot be told apart from a complete role name: mark it incomplete
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
    r"""Parse ChatML text (``<|im_start|>role\\ncontent<|im_end|>\\n`` blocks)."""
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


_TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


def parse_qwen25(text: str) -> list[dict[str, Any]]:
    """Parse Qwen2.5 text: ChatML plus ``<tool_call>`` blocks and grouped ``<tool_response>`` turns."""
    out: list[dict[str, Any]] = []
    for m in parse_chatml(text):
        body = m["content"]
        if m["role"] == "assistant" and "<tool_call>\n" in body:
            first = body.index("<tool_call>\n")
            content = body[:first]
            if content and not content.endswith("\n"):
                raise TemplateParseError(f"tool call not on its own line in {body!r}")
            calls_text = body[first:]
            calls = []
            pos = 0
            for k, call in enumerate(_TOOL_CALL.finditer(calls_text)):
                sep = "" if k == 0 else "\n"
                if call.start() != pos + len(sep) or calls_text[pos : call.start()] != sep:
                    raise TemplateParseError(f"unexpected text between tool calls in {body!r}")
                try:
                    payload = json.loads(call.group(1))
                except json.JSONDecodeError as e:
                    if m.get("is_complete", True):
                        raise TemplateParseError(f"tool call is not valid JSON: {call.group(1)!r}") from e
                    payload = None
                if payload is not None:
                    calls.append(payload)
                pos = call.end()
            if pos != len(calls_text) and m.get("is_complete", True):
                raise TemplateParseError(f"unparseable text after tool calls: {calls_text[pos:]!r}")
            msg = {"role": "assistant", "content": content[:-1] if content else "", "tool_calls": calls}
            if m.get("is_complete") is False:
                msg["is_complete"] = False
            out.append(msg)
        elif m["role"] == "user" and body.startswith("<tool_response>\n") and body.endswith("\n</tool_response>"):
            inner = body[len("<tool_response>\n") : -len("\n</tool_response>")]
            out.extend({"role": "tool", "content": c} for c in inner.split("\n</tool_response>\n<tool_response>\n"))
        else:
            out.append(m)
    return out


# ------------------------------------------------------------------------------------------- sources

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim }}{{ '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

_QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
_QWEN_TOOLS_INTRO = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_QWEN_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)

QWEN25 = (
    "{% set first_is_system = messages and messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' }}"
    "{{ messages[0]['content'] if first_is_system else default_system }}"
    "{% if tools %}"
    "{{ tools_intro }}{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}{{ tools_outro }}"
    "{% else %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and first_is_system %}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}"
    "{{ message['content'] }}"
    "{% for call in (message['tool_calls'] or []) %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + (fn['arguments'] | tojson) }}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' }}"
    "{% endgeneration %}"
    "{{ '\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_REGISTRY: dict[str, ChatTemplate] = {}


def register_template(
    name: str,
    source: str,
    parser: Parser | None = None,
    *,
    description: str = "",
    strips_content: bool = False,
    default_system: str | None = None,
    context: Mapping[str, Any] | None = None,
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
    template = ChatTemplate(name, source, parser, description, strips_content, default_system, dict(context or {}))
    if not template.has_generation_markers:
        raise ValueError(
            f"template {name!r} has no {{% generation %}} markers: wrap what the assistant produces (content "
            "and end-of-turn token) in {% generation %}...{% endgeneration %} so assistant masks can be computed"
        )
    _compile(source)
    _REGISTRY[name] = template
    return template


def list_templates() -> list[str]:
    """Names of the registered templates."""
    return sorted(_REGISTRY)


def get_template(name: str | ChatTemplate) -> ChatTemplate:
    """Look a template up by name (a :class:`ChatTemplate` is returned as is).

    Raises:
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


_PROBES: tuple[tuple[dict[str, str], ...], ...] = (
    (
        {"role": "system", "content": "S1"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ),
    ({"role": "user", "content": "U1"}, {"role": "assistant", "content": "A1"}),
)


def _renders_like(source: str, context: Mapping[str, Any], template: ChatTemplate) -> bool:
    for probe in _PROBES:
        for gp in (False, True):
            try:
                mine, _ = _render_fenced(source, [dict(m) for m in probe], gp, dict(context))
                theirs, _ = _render_fenced(template.source, [dict(m) for m in probe], gp, dict(template.context))
            except (TemplateError, JinjaTemplateError):
                return False
            if mine != theirs:
                return False
    return True


def resolve_template(template: str | ChatTemplate | None = None, tokenizer: Any = None) -> ChatTemplate:
    """Pick the template to use: explicit, or the tokenizer's own.

    With ``template`` given (a name or a :class:`ChatTemplate`), that one is used. Otherwise the tokenizer's
    ``chat_template`` is used directly when it has ``{% generation %}`` markers, or else replaced by the
    registered template that renders exactly like it on probe chats. There is no guessing from names.

    Raises:
        TemplateError: When no template can be chosen, with what to pass instead.
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
    matches = [t for t in _REGISTRY.values() if _renders_like(source, context, t)]
    own = ChatTemplate("", source, None, "the tokenizer's own template", context=context)
    if own.has_generation_markers:
        if matches:
            own = ChatTemplate(
                "",
                source,
                matches[0].parser,
                own.description,
                matches[0].strips_content,
                matches[0].default_system,
                context,
            )
        return own
    if matches:
        return matches[0]
    raise TemplateError(
        "the tokenizer's chat template has no {% generation %} markers and renders like none of the registered "
        f"templates ({', '.join(list_templates())}); pass template=<name>, or register one with "
        "chatenv.register_template(name, source_with_generation_markers, parser)"
    )


register_template(
    "chatml",
    CHATML,
    parse_chatml,
    description="ChatML exactly as SmolLM2-Instruct renders it (inserts SmolLM's system prompt when none is given)",
    default_system="You are a helpful AI assistant named SmolLM, trained by Hugging Face",
)
register_template(
    "llama3",
    LLAMA3,
    parse_llama3,
    description="Llama-3 Instruct (<|start_header_id|>, <|eot_id|>); trims whitespace around content",
    strips_content=True,
)
register_template(
    "qwen2.5",
    QWEN25,
    parse_qwen25,
    description="Qwen2.5 Instruct with tool calls (<tool_call>) and tool responses (<tool_response>)",
    default_system=_QWEN_SYSTEM,
    context={"default_system": _QWEN_SYSTEM, "tools_intro": _QWEN_TOOLS_INTRO, "tools_outro": _QWEN_TOOLS_OUTRO},
)
