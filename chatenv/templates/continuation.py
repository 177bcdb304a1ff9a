"""What rendering adds after a chat: continuation and reply tails, and proving a window of the chat enough.

Token-in/token-out stepping never re-renders what the model has seen; it appends a *tail*: the text (and
segments) a template renders after the last assistant generation once new messages are added
(:func:`continuation_tail`), or the span the assistant generates for a reply (:func:`reply_tail`).

A tail usually depends only on the first message (system prompt) and the last ones, so it can be rendered
from a *window* of the chat (:func:`window`: the first message and the last two) at a cost that does not
grow with the chat. That is an assumption about the template, so :func:`window_is_exact` checks it on chats
of varied shapes (with and without a system message, tool calls and results, several user turns in a row,
empty contents, long chats): every tail rendered from the window must equal the tail rendered from the whole
chat. Templates that read further back (e.g. that number the turns) fail the check.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chatenv.errors import TemplateError, TemplateNotPrefixStable
from chatenv.templates.proof_chats import PROOF_CASES
from chatenv.templates.renderer import ChatTemplate, Segment

__all__ = ["Tail", "TailBuilder", "Tools", "continuation_tail", "reply_tail", "window", "window_is_exact"]

Message = Mapping[str, Any]
Tools = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Tail:
    """Rendered text to append after a boundary, with its segments.

    Segment offsets are relative to the tail and carry no message index (``message`` is -1), so a tail does not
    depend on how much of the chat before it was rendered: two renders that agree give equal tails.

    Attributes:
        text: The text to append.
        segments: Segments covering ``text``.
        unmasked_until: Generation segments ending at or before this offset are not assistant tokens (the
            turn-closing markup after a cut-off generation, which the model did not produce).
        drift: For a template that rewrites earlier turns: ``(kept, fresh)``, the reply as the model produced it
            and as a fresh render of the chat now writes it; None when they agree (or nothing was compared).
    """

    text: str
    segments: tuple[Segment, ...]
    unmasked_until: int = 0
    drift: tuple[str, str] | None = None


# a tail as a function of the chat so far: continuation_tail or reply_tail with the other arguments bound
TailBuilder = Callable[[list[Message]], Tail]


def _tail(text: str, segments: Sequence[Segment], start: int, end: int, unmasked_until: int = 0) -> Tail:
    """The part of a render between ``start`` and ``end``, re-based to offset 0."""
    out = []
    for s in segments:
        a, b = max(s.start, start), min(s.end, end)
        if a < b:
            out.append(Segment(a - start, b - start, s.is_content, s.is_generation))
    return Tail(text[start:end], tuple(out), max(unmasked_until - start, 0))


def _name(template: ChatTemplate) -> str:
    return template.name or "<tokenizer template>"


def _first_difference(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def continuation_tail(
    template: ChatTemplate,
    messages: Sequence[Message],
    new_messages: Sequence[Message],
    *,
    after_generation: bool = True,
    generation_complete: bool = True,
    add_generation_prompt: bool = True,
    tools: Tools | None = None,
    kept: str | None = None,
    end_tokens: Sequence[str] = (),
    written_end: str = "",
) -> Tail:
    r"""The tail to append to ``messages`` to add ``new_messages`` (see ``ChatTokenizer.continuation``).

    With ``after_generation`` the tail starts where the last assistant message's generation ends (or, when the
    generation was cut off, where its content ends), otherwise where the render of ``messages`` ends. A complete
    generation whose ids went on past its end-of-turn token with the rest of the template's end sequence
    (``written_end``: Cohere2's ``<|END_OF_TURN_TOKEN|>`` after ``<|END_RESPONSE|>``) has it already: the tail
    starts after it.

    Raises:
        ValueError: If ``after_generation`` and the last message is not an assistant message.
        TemplateError: If the template marks no generation for that message.
        TemplateNotPrefixStable: If adding the messages changes how the earlier chat renders.

    Example:
        >>> from chatenv.templates import get_template
        >>> chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
        >>> continuation_tail(get_template("chatml"), chat, [{"role": "user", "content": "Bye"}]).text
        '\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n'
    """
    messages, new_messages = list(messages), list(new_messages)
    if template.derived:
        return _derived_continuation(
            template,
            messages,
            new_messages,
            after_generation=after_generation,
            generation_complete=generation_complete,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            kept=kept,
            written_end=written_end,
        )
    before = template.render(messages, add_generation_prompt=False, tools=tools)
    after = template.render(messages + new_messages, add_generation_prompt=add_generation_prompt, tools=tools)
    checked = boundary = len(before.text)
    unmasked_until = 0
    if after_generation:
        if not messages or messages[-1].get("role") != "assistant":
            last = messages[-1].get("role") if messages else None
            raise ValueError(
                "after_generation=True needs the chat to end with the generated assistant message, "
                f"got last role {last!r}"
            )
        gen = [s for s in before.segments if s.is_generation]
        if not gen:
            raise TemplateError(f"template {_name(template)!r} marks no generation for the last assistant message")
        checked = boundary = gen[-1].end
        if generation_complete and end_tokens:
            # a generation block that goes on past the end-of-turn token (LFM2's "<|im_end|>\n"): the model stops
            # at the token, the rest is the env's (unmasked) continuation
            content = [s for s in before.segments if s.is_content and s.message == len(messages) - 1]
            anchor = content[-1].end if content else gen[-1].start
            hits = [k + len(t) for t in end_tokens if (k := before.text.find(t, anchor, checked)) >= 0]
            if hits and min(hits) < checked:
                boundary = min(hits)
                unmasked_until = checked
        if not generation_complete:
            content = [s for s in before.segments if s.is_content and s.message == len(messages) - 1]
            boundary = content[-1].end if content else gen[-1].start
            # the turn-closing tokens were not sampled: they are not assistant tokens
            unmasked_until = checked
        elif written_end and after.text.startswith(written_end, boundary):
            boundary += len(written_end)
    if after.text[:checked] != before.text[:checked]:
        raise TemplateNotPrefixStable(
            f"template {_name(template)!r} renders the earlier chat differently once new messages are added "
            f"(first difference at character {_first_difference(before.text[:checked], after.text)}); "
            "token-in/token-out stepping needs a prefix-stable template"
        )
    return _tail(after.text, after.segments, boundary, len(after.text), unmasked_until)


def _derived_continuation(
    template: ChatTemplate,
    messages: list[Message],
    new_messages: list[Message],
    *,
    after_generation: bool,
    generation_complete: bool,
    add_generation_prompt: bool,
    tools: Tools | None,
    kept: str | None,
    written_end: str = "",
) -> Tail:
    """:func:`continuation_tail` for a derived template: the tail of a fresh render, the drift recorded."""
    assistant_new = any(m.get("role") == "assistant" for m in new_messages)
    render = template.render if assistant_new else template.locate
    real = messages
    if after_generation and messages and messages[-1].get("tool_calls"):
        # the reply's end is found in a render whose calls carry no model-written text: an argument that spells
        # an end-of-turn marker (a template may write it raw) cannot move the boundary; the tail does not depend
        # on the arguments (the tool results are their own messages)
        messages = [*messages[:-1], _neutral_calls(messages[-1])]
    try:
        after = render(messages + new_messages, add_generation_prompt=add_generation_prompt, tools=tools)
    except TemplateError:
        if not after_generation or not messages or kept is None:
            raise
        after, messages = _render_refused(
            functools.partial(render, add_generation_prompt=add_generation_prompt, tools=tools), messages, new_messages
        )
    if not after_generation:
        before = template.locate(messages, add_generation_prompt=False, tools=tools)
        boundary = len(before.text)
        drift = None if after.text[:boundary] == before.text else (before.text, after.text[:boundary])
        tail = _tail(after.text, after.segments, boundary, len(after.text))
        return dataclasses.replace(tail, drift=drift)
    if not messages or messages[-1].get("role") != "assistant":
        last = messages[-1].get("role") if messages else None
        raise ValueError(
            f"after_generation=True needs the chat to end with the generated assistant message, got last role {last!r}"
        )
    i = len(messages) - 1
    context = {**template.context, "tools": list(tools) if tools else None}
    own = [s for s in after.segments if s.is_content and s.message == i]
    if own:
        start = own[0].start
    else:
        start = template.generation_span(messages + new_messages, after.text, _spans(after), i, context)[0]
    end = template.reply_end(after.text, after.segments, i, start)
    boundary, unmasked_until = end, 0
    if generation_complete and written_end and after.text.startswith(written_end, end):
        boundary = end + len(written_end)  # the model sampled the rest of the end sequence: not written again
    if not generation_complete:
        boundary = own[-1].end if own else start
        unmasked_until = end
    tail = _tail(after.text, after.segments, boundary, len(after.text), unmasked_until)
    drift = None
    if kept is not None and real[-1] is not messages[-1]:
        drift = _tool_call_drift(template, real + new_messages, add_generation_prompt, tools, kept, tail.text, i)
    elif kept is not None and after.text[max(boundary - len(kept), 0) : boundary] != kept:
        gen_start = template.generation_span(messages + new_messages, after.text, _spans(after), i, context)[0]
        drift = (kept, after.text[gen_start:boundary])
    return dataclasses.replace(tail, drift=drift)


def _render_refused(
    render: Callable[[list[Message]], Any], messages: list[Message], new_messages: list[Message]
) -> tuple[Any, list[Message]]:
    """A render of a chat the template refuses for what replies wrote in their content, and the messages rendered.

    The template interprets a reply's text (Gemma 4 strips what precedes a ``<channel|>`` it finds; gpt-oss refuses
    the channel tags a cut reply holds): the kept ids stay as sampled, and the tail comes from a render with neutral
    replies (the last one, else the earlier ones, else all), the drift recorded.
    """
    last = len(messages) - 1
    earlier = {k for k, m in enumerate(messages[:-1]) if m.get("role") == "assistant"}
    error: TemplateError | None = None
    for neutral in ({last}, earlier, {last, *earlier}):
        tried = [_neutral_reply(m) if k in neutral else m for k, m in enumerate(messages)]
        try:
            return render(tried + new_messages), tried
        except TemplateError as e:
            error = e
    assert error is not None
    raise error


def _neutral_reply(reply: Message) -> dict[str, Any]:
    """A reply with its text replaced by a neutral word and no reasoning (its calls kept)."""
    out = {**reply, "content": "x"}
    out.pop("reasoning_content", None)
    return out


_TOOL_NAME = re.compile(r"[\w.\-]{1,64}")


def _neutral_calls(reply: Mapping[str, Any]) -> dict[str, Any]:
    """The reply with its calls' arguments emptied (and names that are not plain identifiers replaced)."""
    calls = []
    for call in reply.get("tool_calls") or []:
        fn = dict(call.get("function") or {}) if isinstance(call, Mapping) else {}
        name = fn.get("name")
        fn["name"] = name if isinstance(name, str) and _TOOL_NAME.fullmatch(name) else "tool"
        fn["arguments"] = {}
        calls.append({**call, "function": fn} if isinstance(call, Mapping) else call)
    return {**reply, "tool_calls": calls}


def _tool_call_drift(
    template: ChatTemplate,
    chat: list[Message],
    add_generation_prompt: bool,
    tools: Tools | None,
    kept: str,
    tail: str,
    i: int,
) -> tuple[str, str] | None:
    """For a reply with calls: how a fresh render of the real chat writes it (between its start and the tail)."""
    try:
        fresh = template.locate(chat, add_generation_prompt=add_generation_prompt, tools=tools)
    except TemplateError:
        return (kept, "")
    if not fresh.text.endswith(tail):
        return (kept, fresh.text)
    context = {**template.context, "tools": list(tools) if tools else None}
    start = template.generation_span(chat, fresh.text, _spans(fresh), i, context)[0]
    written = fresh.text[start : len(fresh.text) - len(tail)]
    return None if written == kept else (kept, written)


def _spans(rendered: Any) -> list[tuple[int, int, int]]:
    return [(s.start, s.end, s.message if s.is_content else -1) for s in rendered.segments]


def reply_tail(
    template: ChatTemplate, messages: Sequence[Message], reply: Message, *, tools: Tools | None = None
) -> Tail:
    """The span a model generates for ``reply`` after ``messages``: the reply's generation as rendered.

    Raises:
        TemplateError: If the template marks no generation for the reply, or rewrites its content (strips or moves
            reasoning written in it): that render is not what a model writes for the content.
    """
    rendered = template.render([*messages, dict(reply)], add_generation_prompt=False, tools=tools)
    content = str(reply.get("content") or "")
    written = "".join(rendered.text[s.start : s.end] for s in rendered.segments if s.message == len(messages))
    if written not in {content, content.strip(), content.lstrip(), content.rstrip()}:
        raise TemplateError(
            f"template {_name(template)!r} rewrites the content of this reply ({content[:40]!r} is written as "
            f"{written[:40]!r}), so its render is not the ids a model writes for it; give the reply as ids"
        )
    gen = [s for s in rendered.segments if s.is_generation]
    if not gen:
        raise TemplateError(f"template {_name(template)!r} marks no generation for an assistant reply")
    start = gen[-1].start
    while True:
        earlier = [s for s in gen if s.end == start]
        if not earlier:
            break
        start = earlier[0].start
    return _tail(rendered.text, rendered.segments, start, gen[-1].end)


def window(messages: Sequence[Message]) -> list[Message] | None:
    """The messages a windowed render uses: the first and the last two; None when that is all of them.

    Example:
        >>> [m["content"] for m in window([{"content": str(i)} for i in range(6)])]
        ['0', '4', '5']
    """
    if len(messages) <= 3:
        return None
    return [messages[0], *messages[-2:]]


# ------------------------------------------------------------------------------------------- the proof


def _proof_points(
    template: ChatTemplate, chat: Sequence[Message], tools: list[dict[str, Any]] | None
) -> Iterator[tuple[TailBuilder, list[Message]]]:
    """(tail builder, messages) pairs covering every place of ``chat`` where a window is shorter."""
    chat = list(chat)
    for i, message in enumerate(chat):
        head = chat[: i + 1]
        if message["role"] == "assistant":
            if window(chat[:i]) is not None:
                yield functools.partial(reply_tail, template, reply=message, tools=tools), chat[:i]
            if window(head) is None:
                continue
            j = next((k for k in range(i + 1, len(chat)) if chat[k]["role"] == "assistant"), len(chat))
            for complete, prompt in ((True, j < len(chat)), (False, False)):
                build = functools.partial(
                    continuation_tail,
                    template,
                    new_messages=chat[i + 1 : j],
                    generation_complete=complete,
                    add_generation_prompt=prompt,
                    tools=tools,
                )
                yield build, head
        elif window(head) is not None:
            build = functools.partial(
                continuation_tail, template, new_messages=chat[i + 1 : i + 2], after_generation=False, tools=tools
            )
            yield build, head


def _agrees(build: TailBuilder, messages: list[Message]) -> bool:
    shorter = window(messages)
    if shorter is None:
        return True  # the window is the whole chat: nothing to compare
    try:
        full = build(messages)
    except TemplateError:
        return True  # the template does not take this chat at all: nothing to compare
    try:
        return build(shorter) == full
    except TemplateError:
        return False


def _prove(template: ChatTemplate) -> bool:
    for chat, tools in PROOF_CASES:
        for build, messages in _proof_points(template, chat, tools):
            if not _agrees(build, messages):
                return False
    return True


_PROOFS: dict[tuple[str, str], bool] = {}


def window_is_exact(template: ChatTemplate) -> bool:
    """Whether every tail rendered from a window equals the one rendered from the whole chat, on proof chats.

    The proof chats vary in length and roles: with and without a system message, tool calls and results (with
    tool schemas), several user or assistant turns in a row, empty contents and a long chat. At every place of
    each chat where a window is shorter than the chat, continuation tails (after a complete or a cut-off
    generation, with or without the next generation prompt, and after a non-assistant message) and reply tails
    are rendered both ways. A window that fails where the whole chat renders also counts as a difference. The
    result is cached per template source and context.

    Example:
        >>> from chatenv.templates import get_template
        >>> window_is_exact(get_template("chatml"))
        True
    """
    key = (template.source, json.dumps(dict(template.context), sort_keys=True, default=repr))
    if key not in _PROOFS:
        _PROOFS[key] = _prove(template)
    return _PROOFS[key]
