r"""Deriving what the envs need from any chat template, by rendering probe chats.

A Hugging Face chat template is a Jinja program that turns messages into text; it rarely marks what the assistant
produces (``{% generation %}``). :func:`derive_profile` renders small probe chats whose contents are unique words,
finds those words in the output and reads off, from where they land:

- how content is given to the template (a str, or a list of ``{"type": "text"}`` blocks for vision models);
- the generation prompt (what ``add_generation_prompt=True`` appends);
- the end-of-turn tokens: the first special token the template writes after a reply's content, mid-chat and as
  the last message (gpt-oss: ``<|end|>`` and ``<|return|>``; GLM: the next header ``<|user|>``);
- whether a system message is accepted;
- the reasoning format: where a reply's ``reasoning_content`` (or ``thinking``) is written (the markup before and
  after it), and whether the generation prompt already opens it (``<think>\n``, as DeepSeek-R1 does);
- the tool-call format: a probe call rendered by the template is read back by each registered format, and the
  format that returns the same call is used;
- how the template rewrites earlier turns (dropped reasoning, trailing tokens after the last reply, ...), with
  the smallest probe chat that shows it.

The result, a :class:`TemplateProfile`, lets :class:`~chatenv.templates.ChatTemplate` mark assistant spans in any
render (from the generation prompt to the end-of-turn token) and lets continuations append only new messages'
tokens to the ids the model produced. A property the envs cannot do without (a locatable content, a generation
prompt, an end-of-turn token) raises :class:`TemplateDerivationError` with the probe chat that shows the problem.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chatenv.errors import TemplateError
from chatenv.templates.markers import special_strings, template_markers, tokenizer_for_template
from chatenv.templates.probes import (
    PROBE_TOOL,
    Prober,
    derive_reasoning,
    lcp,
    message,
    probe_call,
    special_at,
    word,
)
from chatenv.templates.profile import ReasoningFormat, TemplateProfile
from chatenv.templates.renderer import ChatTemplate
from chatenv.templates.tool_calls import get_tool_format, list_tool_formats

__all__ = [
    "ReasoningFormat",
    "TemplateDerivationError",
    "TemplateProfile",
    "derive_profile",
    "derive_template",
    "special_strings",
    "template_markers",
    "tokenizer_for_template",
]


class TemplateDerivationError(TemplateError):
    """A property the envs need cannot be derived from a chat template.

    Attributes:
        chat: The smallest probe chat that shows the problem (message dicts), or None.
    """

    def __init__(self, message: str, chat: Sequence[Mapping[str, Any]] | None = None):
        self.chat = [dict(m) for m in chat] if chat is not None else None
        shown = f"\n  counterexample chat: {json.dumps(self.chat, ensure_ascii=False)}" if chat is not None else ""
        super().__init__(message + shown)


def derive_profile(
    source: str, context: Mapping[str, Any], specials: Iterable[str], name: str = "<tokenizer template>"
) -> TemplateProfile:
    """Derive a :class:`TemplateProfile` from a chat template by rendering probe chats.

    Args:
        source: The template's Jinja source (no ``{% generation %}`` markers needed).
        context: Variables the template reads (``bos_token``, ``eos_token``).
        specials: The tokenizer's special-token strings (candidates for the end-of-turn token).
        name: How to name the template in errors.

    Raises:
        TemplateDerivationError: With a counterexample chat, when content cannot be located, the template adds no
            generation prompt, or no special token ends an assistant turn.
    """
    specials = sorted({s for s in specials if s}, key=len, reverse=True)
    p = Prober(source, dict(context))
    u1 = [message("user", word(1))]
    plain = p.render(u1)
    if plain is None or word(1) not in plain:
        p.blocks = True
        plain = p.render(u1)
        if plain is None or word(1) not in plain:
            raise TemplateDerivationError(
                f"template {name!r}: the content of a user message does not appear in the render (neither as a str "
                "nor as text blocks)",
                u1,
            )
    prompted = p.render(u1, gp=True)
    replied = p.render([*u1, message("assistant", word(2))])
    generation_prompt = _generation_prompt(plain, prompted, replied)
    if generation_prompt is None:
        raise TemplateDerivationError(
            f"template {name!r} adds no generation prompt after the chat (add_generation_prompt=True renders nothing "
            "new, and no reply header follows the user message), so a reply cannot be prompted",
            u1,
        )
    mid_chat = [*u1, message("assistant", word(2)), message("user", word(3))]
    ends = _end_of_turn(p, mid_chat, specials, name)
    system = p.render([message("system", word(0)), *u1], gp=True)
    reasoning = derive_reasoning(p, u1, generation_prompt)
    profile = TemplateProfile(
        end_of_turn=ends,
        generation_prompt=generation_prompt,
        content_blocks=p.blocks,
        system=system is not None and word(0) in system,
        reasoning=reasoning,
    )
    rewrites, counterexample = _rewrites(p, profile)
    reply_prefix = ""
    head = p.render(u1, gp=True)
    if head is not None and replied is not None and replied.startswith(head) and word(2) in replied[len(head) :]:
        reply_prefix = replied[len(head) : replied.index(word(2), len(head))]
    probe = _tool_probe(p, specials)
    if probe is not None and probe.stop and probe.stop not in ends:
        ends = (*ends, probe.stop)
    tool_format = _tool_format(probe, dataclasses.replace(profile, reply_prefix=reply_prefix))
    return TemplateProfile(
        end_of_turn=ends,
        generation_prompt=generation_prompt,
        content_blocks=p.blocks,
        system=profile.system,
        reasoning=reasoning,
        tool_format=tool_format,
        rewrites=tuple(rewrites),
        counterexample=tuple(counterexample) if counterexample else None,
        reply_prefix=reply_prefix,
        strips_content=_strips(p),
        json_arguments=probe is not None and probe.json_arguments,
        tool_stop=probe.stop if probe is not None else None,
        past_only=ends[:1] if len(ends) > 1 and _last_end(p, mid_chat, specials) not in (None, ends[0]) else (),
        end_sequence=_end_sequence(p, mid_chat, specials, ends[0]),
    )


def _generation_prompt(plain: str, prompted: str | None, replied: str | None) -> str | None:
    """What a render gains to prompt a reply: after the chat, or after what only a last message is followed by."""
    if prompted is None:
        return None
    if prompted.startswith(plain) and prompted != plain:
        return prompted[len(plain) :]
    if prompted == plain and replied is not None and replied.startswith(plain) and word(2) in replied[len(plain) :]:
        return ""  # the reply header follows every user message whatever add_generation_prompt says
    k = lcp(plain, prompted)
    if k < len(prompted) and word(1) not in plain[k:]:
        return prompted[k:]  # the last message is followed by something only while it is last (Phi-3's EOS)
    return None


def _strips(p: Prober) -> bool:
    """Whether the template trims whitespace around content (a padded probe word loses its padding)."""
    text = p.render([message("user", word(1)), message("assistant", f" {word(2)}\n")])
    return text is not None and f" {word(2)}\n" not in text


def _last_end(p: Prober, mid_chat: list[dict[str, Any]], specials: Sequence[str]) -> str | None:
    """The special token written after a reply's content when the reply is the last message."""
    last = p.render(mid_chat[:2])
    if last is None or word(2) not in last:
        return None
    found = special_at(last, last.index(word(2)) + len(word(2)), specials)
    return found[1] if found else None


def _end_sequence(p: Prober, mid_chat: list[dict[str, Any]], specials: Sequence[str], first: str) -> tuple[str, ...]:
    """The special tokens written back to back after a reply's content from ``first`` on.

    They must be the same mid-chat and after the last message (Cohere2: ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``);
    empty when that is ``first`` alone.
    """
    runs = []
    for text in (p.render(mid_chat), p.render(mid_chat[:2])):
        if text is None or word(2) not in text:
            return ()
        k = text.find(first, text.index(word(2)) + len(word(2)))
        run: list[str] = []
        while k >= 0 and (found := special_at(text, k, specials)) is not None and found[0] == k:
            run.append(found[1])
            k += len(found[1])
        runs.append(run)
    n = next((j for j, (a, b) in enumerate(zip(*runs)) if a != b), min(len(runs[0]), len(runs[1])))
    return tuple(runs[0][:n]) if n > 1 else ()


def _end_of_turn(p: Prober, mid_chat: list[dict[str, Any]], specials: Sequence[str], name: str) -> tuple[str, ...]:
    text = p.render(mid_chat)
    if text is None or word(2) not in text or word(3) not in text:
        raise TemplateDerivationError(f"template {name!r} does not render a plain three-message chat", mid_chat)
    after = text.index(word(2)) + len(word(2))
    found = special_at(text, after, specials)
    if found is None or found[0] >= text.index(word(3)):
        raise TemplateDerivationError(
            f"template {name!r}: no special token follows the assistant's content before the next message, so the "
            "end of a reply cannot be told from its ids (add the end-of-turn marker to the tokenizer as a special "
            "token)",
            mid_chat,
        )
    ends = [found[1]]
    last = p.render(mid_chat[:2])
    if last is not None and word(2) in last:
        more = special_at(last, last.index(word(2)) + len(word(2)), specials)
        if more is not None:
            ends.append(more[1])
    return tuple(dict.fromkeys(ends))


@dataclass(frozen=True)
class _ToolProbe:
    span: str  # the reply's call as the template writes it (from the generation start to the closing token)
    json_arguments: bool  # the template wants arguments as a JSON string (OpenAI's wire form)
    stop: str | None  # the special token that ends a reply with calls, when not an end-of-turn token


def _tool_probe(p: Prober, specials: Sequence[str]) -> _ToolProbe | None:
    """How the template writes one call, and which special token closes a reply that makes calls."""
    for json_arguments in (False, True):
        chat = [message("user", word(1)), message("assistant", "", tool_calls=[probe_call(json_arguments)])]
        text = p.render(chat, tools=[PROBE_TOOL])
        head = p.render(chat[:1], gp=True, tools=[PROBE_TOOL])
        if text is None or head is None or "Paris" not in text[len(head) :]:
            continue
        start, paris = lcp(head, text), text.rindex("Paris")
        inside = {s for s in specials if s in text[start:paris]}
        after = [(k, s) for s in specials if s not in inside for k in _occurrences(text, s, paris)]
        stop = max(after)[1] if after else None
        if stop is None:  # nothing closes a last reply with calls: the token the next (tool) message opens with
            mid = p.render([*chat, {"role": "tool", "content": word(8), "tool_call_id": "call_0"}], tools=[PROBE_TOOL])
            if mid is not None and word(8) in mid:
                found = [(k, s) for s in specials if s not in inside for k in _occurrences(mid, s, paris)]
                found = [f for f in found if f[0] < mid.index(word(8))]
                stop = min(found)[1] if found else None
        end = text.find(stop, paris) if stop else -1
        return _ToolProbe(text[start : end if end >= 0 else len(text)], json_arguments, stop)
    return None


def _occurrences(text: str, token: str, after: int) -> list[int]:
    out, k = [], text.find(token, after)
    while k >= 0:
        out.append(k)
        k = text.find(token, k + 1)
    return out


def _tool_format(probe: _ToolProbe | None, profile: TemplateProfile) -> str | None:
    """The registered tool-call format that reads back the probe call as the template writes it."""
    if probe is None:
        return None
    span = probe.span
    fmt = profile.reasoning
    if fmt is not None and (fmt.prompt != "open" or (fmt.close.strip() or fmt.close) in span):
        _, span = fmt.split(span)
    if profile.reply_prefix and span.startswith(profile.reply_prefix):
        span = span[len(profile.reply_prefix) :]
    for fmt_name in list_tool_formats():
        parsed = get_tool_format(fmt_name).parse_text(span)
        calls = parsed.calls
        if parsed.canonical and len(calls) == 1 and calls[0].name == "get_weather":
            if calls[0].arguments == {"city": "Paris"} and not parsed.content.strip():
                return fmt_name
    return None


def _rewrites(p: Prober, profile: TemplateProfile) -> tuple[list[str], list[dict[str, Any]] | None]:
    """How adding messages changes the render of the chat before them, with the smallest probe chat showing it."""
    probes: list[list[dict[str, Any]]] = [
        [message("user", word(1)), message("assistant", word(2)), message("user", word(3))],
    ]
    if profile.reasoning is not None and profile.reasoning.key is not None:
        key = profile.reasoning.key
        probes.append(
            [message("user", word(1)), message("assistant", word(2), **{key: word(9)}), message("user", word(3))]
        )
    elif profile.reasoning is not None:
        probes.append(
            [
                message("user", word(1)),
                message("assistant", f"{word(9)}{profile.reasoning.close}{word(2)}"),
                message("user", word(3)),
            ]
        )
    if profile.system:
        probes.append(
            [
                message("system", word(0)),
                message("user", word(1)),
                message("assistant", word(2)),
                message("user", word(3)),
            ]
        )
    found: list[str] = []
    example: list[dict[str, Any]] | None = None
    first = probes[0][:2]
    last = p.render(first)
    if last is not None and word(2) in last and special_at(last, last.index(word(2)), profile.end_of_turn) is None:
        found.append(
            "a reply is closed by the next message's header: the end-of-turn token a model stops with is not "
            "written after the last reply of a chat"
        )
        example = first
    head, past = p.render(first[:1], gp=True), p.render(first)
    if head is not None and past is not None and not past.startswith(head):
        k = lcp(head, past)
        found.append(
            f"the generation prompt ends {head[k:][:40]!r} where a past reply is written {past[k:][:40]!r}: the "
            "prompt a reply was sampled from is not how the template writes it afterwards"
        )
        example = first
    for chat in probes:
        before = p.render(chat[:-1])
        after = p.render(chat, gp=True)
        if before is None or after is None:
            continue
        reply_end = before.index(word(2)) + len(word(2))
        end = special_at(before, reply_end, profile.end_of_turn)
        boundary = end[0] + len(end[1]) if end else reply_end
        if after[:boundary] != before[:boundary]:
            k = lcp(before, after)
            found.append(
                f"adding {chat[-1]['role']!r} after a reply rewrites the chat before it: "
                f"{before[k : min(boundary, k + 40)]!r} becomes {after[k : k + 40]!r}"
            )
            example = example or chat
    return found, example


def derive_template(tokenizer: Any, source: str | None = None, name: str = "") -> ChatTemplate:
    """A :class:`ChatTemplate` for ``source`` (default: the tokenizer's own template) with a derived profile.

    Raises:
        TemplateDerivationError: When a property the envs need cannot be derived (with a counterexample chat).
    """
    if source is None:
        source = getattr(tokenizer, "chat_template", None)
        if isinstance(source, dict):
            source = source.get("default")
    if not source:
        raise TemplateError("the tokenizer has no chat template; pass template=<name> or a template source")
    context = {
        "bos_token": getattr(tokenizer, "bos_token", None) or "",
        "eos_token": getattr(tokenizer, "eos_token", None) or "",
    }
    profile = derive_profile(source, context, special_strings(tokenizer), name or "<tokenizer template>")
    return ChatTemplate(
        name,
        source,
        None,
        "derived from the template by rendering probe chats",
        strips_content=profile.strips_content,
        context=context,
        tool_format=profile.tool_format,
        profile=profile,
    )
