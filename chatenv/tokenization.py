"""Exact, prefix-stable tokenization of chats.

:class:`ChatTokenizer` encodes a chat segment by segment (see :mod:`chatenv.templates`): template markup is
encoded with special tokens recognised, message content always as plain text, so a user or tool message that
contains ``<|im_end|>`` cannot forge a turn or flip the assistant mask. The assistant mask comes from the
template's ``{% generation %}`` spans, so it covers the assistant's content and its end-of-turn token and
nothing else.

For multi-turn stepping, :meth:`ChatTokenizer.continuation` returns only the ids to append after what the
model has already seen (its generated ids kept verbatim): the rest of the closed assistant turn, the new
messages and the next assistant header. Earlier text is never re-tokenized. The template is checked once
per tokenizer to be prefix-stable, and every continuation checks that the rendering of the earlier chat did
not change; a template that rewrites earlier turns raises :class:`~chatenv.errors.TemplateNotPrefixStable`.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from chatenv.errors import TemplateError, TemplateNotPrefixStable
from chatenv.templates import ChatTemplate, Rendered, Segment, resolve_template

__all__ = ["ChatTokenizer", "EncodedChat", "chat_tokenizer"]

Message = Mapping[str, Any]

_PROBE_CHAT: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 10 * 4?\nExplain."},
    {"role": "assistant", "content": "40, since 10 * 4 = 40."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
)


@dataclass(frozen=True)
class EncodedChat:
    """Token ids of a chat (or of a continuation) with their assistant mask.

    Attributes:
        ids: ``(T,)`` int64 token ids.
        assistant_mask: ``(T,)`` bool, True on tokens the assistant produces (content and end-of-turn).
        text: The text the ids encode.
    """

    ids: torch.Tensor
    assistant_mask: torch.Tensor
    text: str


class ChatTokenizer:
    r"""Encodes chats with a template, segment by segment, and appends turns without re-tokenizing.

    Args:
        tokenizer: A Hugging Face *fast* tokenizer (one backed by the ``tokenizers`` library).
        template: Template name or :class:`~chatenv.templates.ChatTemplate`; default: the tokenizer's own
            (see :func:`~chatenv.templates.resolve_template`).
        verify: Check on a probe chat that turn-by-turn encoding equals encoding the whole chat.

    Raises:
        TypeError: If the tokenizer is not a fast tokenizer.
        TemplateNotPrefixStable: If ``verify`` and the template rewrites earlier turns.

    Example:
        >>> from chatenv.models import load_default_tokenizer
        >>> ct = ChatTokenizer(load_default_tokenizer(), "chatml")
        >>> chat = [{"role": "system", "content": "Hi"}, {"role": "user", "content": "2+2?"}]
        >>> enc = ct.encode(chat, add_generation_prompt=True)
        >>> ct.tokenizer.decode(enc.ids[-4:])
        '<|im_start|>assistant\n'
        >>> reply = ct.encode(chat + [{"role": "assistant", "content": "4"}])
        >>> ct.tokenizer.decode(reply.ids[reply.assistant_mask])
        '4<|im_end|>'
    """

    def __init__(self, tokenizer: Any, template: str | ChatTemplate | None = None, *, verify: bool = True):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(
                f"expected a fast tokenizer (backed by the 'tokenizers' library), got {type(tokenizer).__name__}; "
                "load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
            )
        from tokenizers import Tokenizer

        self.tokenizer = tokenizer
        self.template = resolve_template(template, tokenizer)
        serialized = backend.to_str()
        self._markup = Tokenizer.from_str(serialized)
        self._plain = Tokenizer.from_str(serialized)
        for t in (self._markup, self._plain):
            t.no_truncation()
            t.no_padding()
        # content is text: special-token strings inside it are encoded as ordinary characters
        self._plain.encode_special_tokens = True
        # continuations render a window of the chat (first message + last two) instead of all of it, so
        # per-turn cost does not grow with the chat; verify() turns this off for templates where it differs
        self._windowed = True
        self._header: str | None = None
        self._end_of_turn: tuple[int, ...] | None = None
        if verify:
            self.verify()

    def __repr__(self) -> str:
        name = self.template.name or "<tokenizer template>"
        return f"ChatTokenizer(tokenizer={type(self.tokenizer).__name__}, template={name!r})"

    # ------------------------------------------------------------------------------------------ encoding

    def _encode_segments(
        self, text: str, segments: Sequence[Segment], start: int = 0, unmasked_until: int = 0
    ) -> EncodedChat:
        pieces = [(s, text[max(s.start, start) : s.end]) for s in segments if s.end > start]
        markup = [p for s, p in pieces if not s.is_content]
        plain = [p for s, p in pieces if s.is_content]
        enc_m = self._markup.encode_batch_fast(markup, add_special_tokens=False) if markup else []
        enc_p = self._plain.encode_batch_fast(plain, add_special_tokens=False) if plain else []
        it_m, it_p = iter(enc_m), iter(enc_p)
        ids: list[int] = []
        mask: list[bool] = []
        for seg, _ in pieces:
            seg_ids = (next(it_p) if seg.is_content else next(it_m)).ids
            ids.extend(seg_ids)
            mask.extend([seg.is_generation and seg.end > unmasked_until] * len(seg_ids))
        return EncodedChat(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool), text[start:])

    def render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = False, tools: Sequence | None = None
    ) -> Rendered:
        """Render messages with this tokenizer's template (padding messages with an empty role are skipped)."""
        return self.template.render(_real(messages), add_generation_prompt=add_generation_prompt, tools=tools)

    def encode(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = False, tools: Sequence | None = None
    ) -> EncodedChat:
        """Encode a whole chat.

        Args:
            messages: Message dicts (``role``, ``content``, optional ``tool_calls``).
            add_generation_prompt: End with the header of a new assistant turn.
            tools: Tool schemas for templates that describe tools.

        Returns:
            The ids, the assistant mask and the text.
        """
        rendered = self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self._encode_segments(rendered.text, rendered.segments)

    def continuation(
        self,
        messages: Sequence[Message],
        new_messages: Sequence[Message],
        *,
        after_generation: bool = True,
        generation_complete: bool = True,
        add_generation_prompt: bool = True,
        tools: Sequence | None = None,
    ) -> EncodedChat:
        """Ids to append to a conversation's ids to add ``new_messages`` (and the next assistant header).

        Args:
            messages: The chat so far. With ``after_generation`` its last message is the assistant reply the
                model just generated, and the ids so far end with the generated ids.
            new_messages: Messages to add (user, tool, ...). May be empty (then only the turn is closed and
                the next header added).
            after_generation: True when the ids so far end with a generation (prompt + generated ids); False
                when they are ``encode(messages)`` without a generation prompt.
            generation_complete: Whether the generation ended with the end-of-turn token. If not (the model
                hit its token limit), the continuation starts with the template's turn-closing tokens, which
                are not marked as assistant tokens since the model did not produce them.
            add_generation_prompt: End with the header of a new assistant turn.
            tools: Tool schemas, as given when encoding the start of the chat.

        Returns:
            Only the ids to append, with their assistant mask.

        Raises:
            ValueError: If ``after_generation`` and the last message is not an assistant message.
            TemplateNotPrefixStable: If adding the messages changes how the earlier chat renders.
        """
        messages = _real(messages)
        new_messages = _real(new_messages)
        if self._windowed and len(messages) > 3:
            messages = [messages[0], *messages[-2:]]
        before = self.template.render(messages, add_generation_prompt=False, tools=tools)
        after = self.template.render(messages + new_messages, add_generation_prompt=add_generation_prompt, tools=tools)
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
                raise TemplateError(
                    f"template {self.template.name!r} marks no generation for the last assistant message"
                )
            checked = boundary = gen[-1].end
            if not generation_complete:
                content = [s for s in before.segments if s.is_content and s.message == len(messages) - 1]
                boundary = content[-1].end if content else gen[-1].start
                # the turn-closing tokens were not sampled: they are not assistant tokens
                unmasked_until = checked
        if after.text[:checked] != before.text[:checked]:
            raise TemplateNotPrefixStable(
                f"template {self.template.name or '<tokenizer template>'!r} renders the earlier chat differently "
                "once new messages are added (first difference at character "
                f"{_first_difference(before.text[:checked], after.text)}); token-in/token-out stepping needs a "
                "prefix-stable template"
            )
        return self._encode_segments(after.text, _cut(after.segments, boundary), boundary, unmasked_until)

    # ---------------------------------------------------------------------------------------- responses

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Decode ids to text exactly as the template wrote it (special tokens kept, no space clean-up)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._markup.decode(list(ids), skip_special_tokens=False)

    @property
    def generation_header(self) -> str:
        """The text the template puts before an assistant reply (ChatML: ``<|im_start|>assistant`` + newline)."""
        if self._header is None:
            chat = [dict(m) for m in _PROBE_CHAT[:2]]
            bare = self.template.render(chat, add_generation_prompt=False).text
            full = self.template.render(chat, add_generation_prompt=True).text
            if not full.startswith(bare) or full == bare:
                raise TemplateError(
                    f"template {self.template.name or '<tokenizer template>'!r} adds no generation header after "
                    "the chat (add_generation_prompt=True renders nothing new)"
                )
            self._header = full[len(bare) :]
        return self._header

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn: the first token the template writes after the reply's content."""
        if self._end_of_turn is None:
            chat = [dict(m) for m in _PROBE_CHAT[:3]]
            enc = self.encode(chat)
            rendered = self.render(chat)
            content = [s for s in rendered.segments if s.is_content and s.message == 2]
            gen = [s for s in rendered.segments if s.is_generation]
            if not content or not gen or gen[-1].end <= content[-1].end:
                raise TemplateError(
                    f"template {self.template.name or '<tokenizer template>'!r} marks no end-of-turn token "
                    "after the assistant's content"
                )
            closing = self._markup.encode(rendered.text[content[-1].end : gen[-1].end], add_special_tokens=False)
            if not closing.ids or closing.ids[0] not in enc.ids.tolist():
                raise TemplateError("could not find the template's end-of-turn token")
            self._end_of_turn = (closing.ids[0],)
        return self._end_of_turn

    def reply(self, messages: Sequence[Message], reply: Message, *, tools: Sequence | None = None) -> EncodedChat:
        """The ids a model would generate for ``reply`` after ``messages`` and the assistant header.

        That is the reply's generation span as the template renders it (content and end-of-turn token), encoded
        like :meth:`encode` would. Only a window of the chat is rendered, as in :meth:`continuation`.
        """
        messages = _real(messages)
        if self._windowed and len(messages) > 3:
            messages = [messages[0], *messages[-2:]]
        rendered = self.template.render([*messages, dict(reply)], add_generation_prompt=False, tools=tools)
        gen = [s for s in rendered.segments if s.is_generation]
        if not gen:
            raise TemplateError(f"template {self.template.name!r} marks no generation for an assistant reply")
        start = gen[-1].start
        while True:
            earlier = [s for s in gen if s.end == start]
            if not earlier:
                break
            start = earlier[0].start
        end = gen[-1].end
        segments = [s for s in _cut(rendered.segments, start) if s.start < end]
        segments = [Segment(s.start, min(s.end, end), s.is_content, s.is_generation, s.message) for s in segments]
        enc = self._encode_segments(rendered.text[:end], segments, start)
        return enc

    def parse_response(self, ids: Sequence[int] | torch.Tensor) -> list[dict[str, Any]]:
        """Messages the model wrote in ``ids`` generated after the assistant header.

        The first message is the assistant reply (``is_complete: False`` when the ids stop before the end of
        turn). Its content holds no template markup and no end-of-turn token. Text that the template cannot
        parse (a model writing free-form markup) is kept whole as the reply's content, never dropped.
        """
        text = self.decode(ids)
        try:
            messages = self.template.parse(self.generation_header + text)
        except (TemplateError, ValueError):
            messages = []
        if not messages or messages[0].get("role") != "assistant":
            eot = self.end_of_turn_ids
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            done = bool(ids) and ids[-1] in eot
            msg: dict[str, Any] = {"role": "assistant", "content": self.decode(ids[:-1] if done else ids)}
            if not done:
                msg["is_complete"] = False
            return [msg]
        return messages

    # ---------------------------------------------------------------------------------------- checking

    def verify(self) -> None:
        """Check on a probe chat that encoding turn by turn gives the ids of encoding the whole chat.

        Raises:
            TemplateNotPrefixStable: If appending turn by turn gives other ids or masks.
        """
        chat = list(_PROBE_CHAT)
        window_ids = []
        for windowed in (True, False):
            self._windowed = windowed
            cont = self.continuation(chat[:5], chat[5:6])
            window_ids.append((cont.ids.tolist(), cont.assistant_mask.tolist()))
        self._windowed = window_ids[0] == window_ids[1]
        whole = self.encode(chat)
        first_reply = next(i for i, m in enumerate(chat) if m["role"] == "assistant")
        ids = [self.encode(chat[:first_reply], add_generation_prompt=True).ids]
        masks = [torch.zeros_like(ids[0], dtype=torch.bool)]
        i = first_reply
        while i < len(chat):
            reply = self.encode(chat[: i + 1])
            end = int(reply.assistant_mask.nonzero()[-1]) + 1
            # what the model generates: the last assistant span of the full encoding
            ids.append(reply.ids[_last_run_start(reply.assistant_mask, end) : end])
            masks.append(torch.ones(len(ids[-1]), dtype=torch.bool))
            j = i + 1
            while j < len(chat) and chat[j]["role"] != "assistant":
                j += 1
            more = j < len(chat)
            cont = self.continuation(chat[: i + 1], chat[i + 1 : j], add_generation_prompt=more)
            ids.append(cont.ids)
            masks.append(cont.assistant_mask)
            i = j
        stepped = torch.cat(ids)
        if not torch.equal(stepped, whole.ids) or not torch.equal(torch.cat(masks), whole.assistant_mask):
            n = _first_difference(stepped.tolist(), whole.ids.tolist())
            raise TemplateNotPrefixStable(
                f"template {self.template.name or '<tokenizer template>'!r} is not prefix-stable: encoding turn "
                f"by turn differs from encoding the whole chat at token {n} "
                f"({self.tokenizer.decode(stepped[n : n + 8])!r} vs {self.tokenizer.decode(whole.ids[n : n + 8])!r})"
            )


def _last_run_start(mask: torch.Tensor, end: int) -> int:
    i = end
    while i > 0 and bool(mask[i - 1]):
        i -= 1
    return i


def _cut(segments: Sequence[Segment], at: int) -> list[Segment]:
    out = []
    for s in segments:
        if s.start < at < s.end:
            out.append(Segment(at, s.end, s.is_content, s.is_generation, s.message))
        elif s.start >= at:
            out.append(s)
    return out


def _first_difference(a: Sequence, b: Sequence) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _real(messages: Sequence[Message]) -> list[Message]:
    """Messages without the empty-role padding of ragged batches."""
    if isinstance(messages, Mapping):
        raise TypeError("expected a sequence of message dicts, got a single dict; wrap it in a list")
    return [m for m in messages if m.get("role", None) != ""]


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chat_tokenizer(tokenizer: Any, template: str | ChatTemplate | None = None) -> ChatTokenizer:
    """A :class:`ChatTokenizer` for ``tokenizer`` and ``template``, verified once and cached per tokenizer.

    The template choice is cached too, so picking the tokenizer's own template (probe renders) happens once.
    """
    if isinstance(template, ChatTemplate):
        key: tuple = (template.name, template.source)
    else:
        # the tokenizer's own template may be replaced by the user: it is part of the key
        key = (template, None if template is not None else str(getattr(tokenizer, "chat_template", None)))
    per_tok = _CACHE.setdefault(tokenizer, {})
    if key not in per_tok:
        per_tok[key] = ChatTokenizer(tokenizer, template)
    return per_tok[key]
