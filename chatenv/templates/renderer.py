"""Rendering a chat with a Jinja chat template, keeping track of what each character is.

A :class:`ChatTemplate` renders in the Hugging Face ``chat_template`` dialect, including the
``{% generation %}`` markers around what the assistant produces. Rendering returns a :class:`Rendered`: the
text and its *segments*, which tell template markup from message content and mark the assistant's
generations. Content is located by rendering the chat a second time with placeholders instead of contents
and aligning the two texts, so a message whose content looks like markup is still known to be content.

Compiling a source and rendering it in the Hugging Face dialect is :mod:`chatenv.templates.dialect`
(``compile_source`` and ``render_text`` are importable from here too).
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from chatenv.errors import TemplateError, TemplateParseError
from chatenv.templates.dialect import compile_source, render_text
from chatenv.templates.profile import TemplateProfile

__all__ = [
    "ChatTemplate",
    "Parser",
    "Rendered",
    "Segment",
    "common_prefix",
    "compile_source",
    "render_text",
    "text_blocks",
]

Message = Mapping[str, Any]
Parser = Callable[[str], list[dict[str, Any]]]

# Unicode noncharacters: reserved by the standard for a program's internal use, so they never occur in
# text a user means. They delimit generation blocks (U+FDD0, U+FDD1: see dialect.py) and content placeholders
# while rendering.
_SLOT_OPEN, _SLOT_CLOSE = "\ufdd2", "\ufdd3"
_RESERVED = re.compile("[\ufdd0-\ufdd3]")
_SLOT = re.compile(f"{_SLOT_OPEN}(\\d+){_SLOT_CLOSE}")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass(frozen=True)
class Segment:
    """A run of rendered characters with one kind.

    Attributes:
        start: Offset of the first character in the rendered text.
        end: Offset one past the last character.
        is_content: True for message content (tokenized as plain text), False for template markup.
        is_generation: True inside a ``{% generation %}`` block (what the assistant produces).
        message: Index of the message a content segment belongs to; -1 for markup, and for segments whose
            message is not tracked (see :class:`~chatenv.templates.continuation.Tail`).
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
        context: Extra variables the source reads (a tokenizer's ``bos_token``, ...).
        tool_format: How the template writes tool calls (``"hermes"``, ``"llama3_json"``; see
            :mod:`chatenv.templates.tool_calls`), or None if it cannot render them.
        tool_variant: Name of a registered template that renders like this one and can render tools (used
            when an env has tools and this template has no ``tool_format``).
        profile: What was derived from a template without ``{% generation %}`` markers (see
            :mod:`chatenv.templates.derive`): its assistant spans run from the generation prompt to the
            end-of-turn token, found in each render.

    Example:
        >>> from chatenv.templates import get_template
        >>> chat = [{"role": "user", "content": "Hi"}]
        >>> print(get_template("chatml").render(chat, add_generation_prompt=True).text)
        <|im_start|>user
        Hi<|im_end|>
        <|im_start|>assistant
        <BLANKLINE>
        >>> print(get_template("smollm2").render(chat).text)
        <|im_start|>system
        You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
        <|im_start|>user
        Hi<|im_end|>
        <BLANKLINE>
    """

    name: str
    source: str
    parser: Parser | None = None
    description: str = ""
    strips_content: bool = False
    default_system: str | None = None
    context: Mapping[str, Any] = field(default_factory=dict)
    tool_format: str | None = None
    tool_variant: str | None = None
    profile: TemplateProfile | None = None

    @property
    def derived(self) -> bool:
        """Whether assistant spans come from a derived profile rather than ``{% generation %}`` markers.

        A template with markers whose profile shows it rewrites earlier turns is stepped as derived too (append-only,
        drift recorded).
        """
        return self.profile is not None and (not self.has_generation_markers or not self.profile.prefix_stable)

    @property
    def derived_profile(self) -> TemplateProfile | None:
        """The profile when assistant spans come from it (:attr:`derived`), else None."""
        return self.profile if self.derived else None

    @property
    def has_generation_markers(self) -> bool:
        """Whether the source marks assistant generations with ``{% generation %}``."""
        return _GENERATION_TAG.search(self.source) is not None

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
            TypeError: If a message's content is not a str.
            ValueError: If a content holds a character chatenv reserves for rendering.
            TemplateError: If the template fails, or transforms content in a way that cannot be tracked.
        """
        return self._render(messages, add_generation_prompt, tools, generation=True)

    def locate(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> Rendered:
        """Like :meth:`render`, but a derived template marks no generation (cheaper: no prefix renders)."""
        return self._render(messages, add_generation_prompt, tools, generation=False)

    def _render(
        self, messages: Sequence[Message], add_generation_prompt: bool, tools: Any, *, generation: bool
    ) -> Rendered:
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
        text, gen_spans = render_text(self.source, self._prepare(msgs), add_generation_prompt, context)
        slotted = [dict(m, content=f"{_SLOT_OPEN}{i}{_SLOT_CLOSE}" if m["content"] else "") for i, m in enumerate(msgs)]
        skeleton, _ = render_text(self.source, self._prepare(slotted), add_generation_prompt, context)
        spans, rewritten = _align(text, skeleton, msgs, self.name or "<tokenizer template>")
        if rewritten:
            # the template rewrote a reply's content: what was located must be what it writes for that content
            # (rendered again from the located text, the chat renders the same), or the alignment is not trusted
            fixed = [dict(m, content=rewritten.get(i, m["content"])) for i, m in enumerate(msgs)]
            if render_text(self.source, self._prepare(fixed), add_generation_prompt, context)[0] != text:
                raise TemplateError(
                    f"template {self.name or '<tokenizer template>'!r} rewrites the content of assistant message(s) "
                    f"{sorted(rewritten)} in a way chatenv cannot track; only verbatim or whitespace-trimmed "
                    "content, or a reply whose reasoning the template strips or re-renders, is supported"
                )
        if self.derived and not generation:
            gen_spans = []  # a template with markers stepped as derived: its markers are not used
        elif self.derived:
            gen_spans = [
                self.generation_span(msgs, text, spans, i, context)
                for i, m in enumerate(msgs)
                if m.get("role") == "assistant"
            ]
            gen_spans = [g for g in gen_spans if g[1] > g[0]]
        return Rendered(text, tuple(_split_at(spans, gen_spans)))

    def _prepare(self, msgs: Sequence[Message]) -> Sequence[Message]:
        """Messages as the template reads them (content as text blocks for templates that want blocks)."""
        if self.profile is None:
            return msgs
        if self.profile.json_arguments:
            msgs = [
                dict(m, tool_calls=[_json_arguments(c) for c in m["tool_calls"]]) if m.get("tool_calls") else m
                for m in msgs
            ]
        return [text_blocks(m) for m in msgs] if self.profile.content_blocks else msgs

    def generation_span(
        self,
        msgs: Sequence[Message],
        text: str,
        spans: Sequence[tuple[int, int, int]],
        i: int,
        context: Mapping[str, Any] | None = None,
    ) -> tuple[int, int]:
        """Where assistant message ``i`` is generated in a render of a derived template: ``(start, end)``.

        The span starts where the render stops agreeing with a render of the messages before it plus the
        generation prompt, and ends after the first end-of-turn token that follows the message's content (or,
        when none follows before the next message, where its content ends).
        """
        if context is None:
            context = dict(self.context)
        own = [(a, b) for a, b, k in spans if k == i]
        earlier = [b for a, b, k in spans if 0 <= k < i]
        later = [a for a, b, k in spans if k > i]
        floor = max(earlier, default=0)
        ceiling = own[0][0] if own else (min(later) if later else len(text))
        try:
            head, _ = render_text(self.source, self._prepare(msgs[:i]), True, context)
            start = common_prefix(head, text)
        except TemplateError:
            prompt = self.profile.generation_prompt if self.profile else ""
            k = text.rfind(prompt, floor, ceiling) if prompt else -1
            start = k + len(prompt) if k >= 0 else floor
        start = min(max(start, floor), ceiling)
        return start, self.reply_end(text, spans, i, start)

    def reply_end(
        self, text: str, spans: Sequence[tuple[int, int, int]] | Sequence[Segment], i: int, start: int
    ) -> int:
        """End of assistant message ``i``'s reply in a render: after the first end-of-turn token past its content."""
        own_end = start
        limit = len(text)
        for sp in spans:
            a, b, k = (sp.start, sp.end, sp.message) if isinstance(sp, Segment) else sp
            if k == i:
                own_end = max(own_end, b)
            elif k > i and k >= 0:
                limit = min(limit, a)
        best: tuple[int, int] | None = None
        for token in self.profile.end_of_turn if self.profile else ():
            k = text.find(token, own_end, limit)
            if k >= 0 and (best is None or k < best[0]):
                best = (k, k + len(token))
        if best is not None:
            return best[1]
        if limit == len(text) and self.profile is not None:
            # no token closes the last reply (GLM ends it with the next header): it runs to the end of the render,
            # less a generation prompt after it
            prompt = self.profile.generation_prompt
            return (
                len(text) - len(prompt)
                if prompt and text.endswith(prompt) and len(text) - len(prompt) >= own_end
                else len(text)
            )
        return own_end

    def parse(self, text: str) -> list[dict[str, Any]]:
        """Parse rendered text back into message dicts (see :meth:`History.from_text`).

        Raises:
            TemplateParseError: If the template has no parser or the text does not follow the template.
        """
        if self.parser is None:
            raise TemplateParseError(
                f"template {self.name or '<tokenizer template>'!r} has no parser; register one with "
                "chatenv.register_template(name, source, parser=...)"
            )
        return self.parser(text)


def text_blocks(message: Message) -> Message:
    """A message whose str content is given as one text block (for templates that read content blocks)."""
    content = message.get("content")
    return dict(message, content=[{"type": "text", "text": content}]) if isinstance(content, str) else message


def _json_arguments(call: Any) -> Any:
    """A tool call with its ``arguments`` as a JSON string (for templates that want OpenAI's wire form)."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    fn = dict(call["function"])
    if not isinstance(fn.get("arguments"), str):
        fn["arguments"] = json.dumps(fn.get("arguments", {}), ensure_ascii=False)
    return {**call, "function": fn}


def common_prefix(a: str, b: str) -> int:
    """Length of the common prefix of two renders, never ending inside a ``<...>`` marker (a special token)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        k = n
    else:
        lo, hi = 0, n  # binary search on equal prefixes: long renders compare in C
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[:mid] == b[:mid]:
                lo = mid
            else:
                hi = mid - 1
        k = lo
    for text in (a, b):
        if k < len(text):
            opened = max(text.rfind("<", 0, k), text.rfind("\uff5c", 0, k) - 1)
            if opened >= 0 and text.rfind(">", 0, k) < opened and ">" in text[k : k + 64]:
                k = text.rfind("<", 0, k)  # the prefix would end inside a marker: end before it
    return k


def _content_end(text: str, pos: int, content: str, following: str, last: bool) -> int | None:
    """Where a message's content (verbatim or whitespace-trimmed) ends if it starts at ``pos``, or None."""
    for cand in dict.fromkeys((content, content.strip(), content.rstrip(), content.lstrip())):
        if not text.startswith(cand, pos):
            continue
        end = pos + len(cand)
        if (text[end:] == following) if last else text.startswith(following, end):
            return end
    return None


def _rewritten_end(text: str, pos: int, content: str, following: str, last: bool) -> int | None:
    """Where an assistant message's content ends when the template rewrote it (stripped or moved its reasoning).

    The rewritten content runs up to the markup that follows it: the end of the render for the last slot, else the
    latest occurrence of that markup whose text before it is a piece of the content (the template kept part of
    it), or the first occurrence when no piece fits (it re-rendered the content). None when nothing tells.
    """
    if last:
        end = len(text) - len(following)
        return end if end >= pos and text.endswith(following) else None
    if not following:
        return None
    ends = []
    k = text.find(following, pos)
    while k >= 0:
        ends.append(k)
        k = text.find(following, k + 1)
    kept = [e for e in ends if text[pos:e].strip() in content]
    return kept[-1] if kept else (ends[0] if ends else None)


def _align(
    text: str, skeleton: str, msgs: list[dict[str, Any]], name: str
) -> tuple[list[tuple[int, int, int]], dict[int, str]]:
    """Locate each content slot of the skeleton in the real text.

    An assistant message whose content the template rewrites (Gemma 4 strips the thinking a reply holds, Nemotron
    drops what precedes ``</think>``) is located by the markup around it; what the template wrote there is its
    content (plain text: it came from the model). Other content must be verbatim or whitespace-trimmed.

    Returns (start, end, message index or -1 for markup) spans covering ``text``, and the text located for each
    rewritten message (by index).
    """
    parts = _SLOT.split(skeleton)  # literal, index, literal, index, ..., literal
    spans: list[tuple[int, int, int]] = []
    rewritten: dict[int, str] = {}
    pos = 0

    def fail(detail: str) -> NoReturn:
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
        last = k + 2 == len(parts) - 1
        end = _content_end(text, pos, msgs[idx]["content"], parts[k + 2], last)
        if end is None and msgs[idx].get("role") == "assistant":
            end = _rewritten_end(text, pos, msgs[idx]["content"], parts[k + 2], last)
            if end is not None:
                rewritten[idx] = text[pos:end]
        if end is None:
            fail(f"content of message {idx} not found at offset {pos}")
        if end > pos:
            spans.append((pos, end, idx))
        pos = end
    if pos != len(text):
        fail("trailing text")
    return spans, rewritten


def _split_at(spans: list[tuple[int, int, int]], gen_spans: list[tuple[int, int]]) -> list[Segment]:
    """Cut content/markup spans at generation boundaries (O(n log n): chats of thousands of turns stay fast)."""
    cuts = sorted({p for span in gen_spans for p in span})
    gens = sorted(gen_spans)
    starts = [gs for gs, _ in gens]
    reach = list(itertools.accumulate((ge for _, ge in gens), max))  # the furthest end of the spans so far
    out: list[Segment] = []
    for start, end, msg in spans:
        points = [start, *cuts[bisect.bisect_right(cuts, start) : bisect.bisect_left(cuts, end)], end]
        for a, b in zip(points, points[1:]):
            k = bisect.bisect_right(starts, a) - 1  # the spans starting at or before a: does one reach b?
            out.append(Segment(a, b, msg >= 0, k >= 0 and reach[k] >= b, msg))
    return out
