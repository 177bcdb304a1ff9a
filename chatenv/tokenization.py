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

Continuations render only a window of the chat (its first message and its last two, see
:mod:`chatenv.templates.continuation`), so their cost does not grow with the chat. That holds only for
templates whose continuations do not read further back: :meth:`ChatTokenizer.verify` proves it on chats of
many shapes (templates that fail render whole chats instead), and at run time every ``check_window_every``-th
windowed continuation (less often in long chats, so the checks' cost stays bounded) is compared with a render of
the whole chat. On a difference the whole-chat result is
returned, the tokenizer renders whole chats from then on, and a :class:`TemplateWindowWarning` is emitted.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from chatenv.encoding import EncodedChat, check_against_tokenizer, encode_segments, encode_whole, verify_turn_by_turn
from chatenv.encoding import backends as _backends
from chatenv.encoding import first_difference as _first_difference
from chatenv.encoding import real_messages as _real
from chatenv.encoding import unmask_after_end as _unmask_after_end
from chatenv.errors import TemplateError
from chatenv.reading import ReplyReader
from chatenv.templates import ChatTemplate, Rendered, resolve_template
from chatenv.templates.continuation import (
    Tail,
    TailBuilder,
    Tools,
    continuation_tail,
    reply_tail,
    window,
    window_is_exact,
)

__all__ = ["ChatTokenizer", "EncodedChat", "TemplateWindowWarning", "chat_tokenizer"]

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


class TemplateWindowWarning(UserWarning):
    """A continuation rendered from a window of the chat differed from rendering the whole chat.

    The template reads messages outside the window (the first message and the last two) in a way the proof
    chats of :meth:`ChatTokenizer.verify` did not show. The ids returned were the whole chat's, and that
    :class:`ChatTokenizer` renders whole chats from then on (correct, at a cost that grows with the chat).
    """


class ChatTokenizer(ReplyReader):
    r"""Encodes chats with a template, segment by segment, and appends turns without re-tokenizing.

    Args:
        tokenizer: A Hugging Face *fast* tokenizer (one backed by the ``tokenizers`` library).
        template: Template name or :class:`~chatenv.templates.ChatTemplate`; default: the tokenizer's own
            (see :func:`~chatenv.templates.resolve_template`).
        verify: Check the template up front (:meth:`verify`): turn-by-turn encoding must equal encoding the
            whole chat, and continuations may render a window of the chat only where that was proven exact.
            Without it, windowing is only checked at run time.
        check_window_every: Compare every N-th windowed continuation (and reply) with a render of the whole
            chat, starting with the first; ``1`` checks all of them, ``None`` none. For chats longer than 32
            messages N grows with the chat (N x messages / 32), so the checks never make a step's cost grow with
            the chat's length.

    Raises:
        TypeError: If the tokenizer is not a fast tokenizer.
        ValueError: If ``check_window_every`` is not a positive int or None.
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

    def __init__(
        self,
        tokenizer: Any,
        template: str | ChatTemplate | None = None,
        *,
        verify: bool = True,
        check_window_every: int | None = 32,
    ):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(
                f"expected a fast tokenizer (backed by the 'tokenizers' library), got {type(tokenizer).__name__}; "
                "load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
            )
        if check_window_every is not None and (
            isinstance(check_window_every, bool) or not isinstance(check_window_every, int) or check_window_every < 1
        ):
            raise ValueError(f"check_window_every must be a positive int or None, got {check_window_every!r}")
        self.tokenizer = tokenizer
        self.template = resolve_template(template, tokenizer)
        self.check_window_every = check_window_every
        self._markup, self._plain = _backends(backend.to_str())
        self._special_ids = frozenset(
            int(i) for i, t in self._markup.get_added_tokens_decoder().items() if getattr(t, "special", False)
        )
        self._windowing = True
        self._next_window_check = 1  # the windowed call that is compared with a whole render next
        self._window_calls = 0
        self._header: str | None = None
        self._end_of_turn: tuple[int, ...] | None = None
        self._marker_ids: tuple[int | None, ...] | None = None
        self._stop_set: frozenset[int] | None = None
        if verify:
            self.verify()

    def __repr__(self) -> str:
        name = self.template.name or "<tokenizer template>"
        return f"ChatTokenizer(tokenizer={type(self.tokenizer).__name__}, template={name!r})"

    @property
    def windowed(self) -> bool:
        """Whether continuations and replies render a window of the chat rather than all of it."""
        return self._windowing

    # ------------------------------------------------------------------------------------------ encoding

    def encode_markup(self, text: str) -> list[int]:
        """Token ids of template markup: special-token strings become their special tokens."""
        return self._markup.encode(text, add_special_tokens=False).ids

    def encode_content(self, text: str) -> list[int]:
        """Token ids of message content: special-token strings are encoded as plain text."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def _encode_tail(self, tail: Tail) -> EncodedChat:
        whole = encode_whole(self._markup, tail.text, tail.segments, tail.unmasked_until, self._special_ids)
        if whole is not None:
            ids, mask = whole
        else:
            ids, mask = encode_segments(self._markup, self._plain, tail.text, tail.segments, tail.unmasked_until)
        if self._end_of_turn is not None and not self.template.derived:
            _unmask_after_end(ids, mask, set(self._end_of_turn))
        return EncodedChat(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool), tail.text)

    def render(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = False, tools: Tools | None = None
    ) -> Rendered:
        """Render messages with this tokenizer's template (padding messages with an empty role are skipped)."""
        return self.template.render(_real(messages), add_generation_prompt=add_generation_prompt, tools=tools)

    def encode(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = False, tools: Tools | None = None
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
        return self._encode_tail(Tail(rendered.text, rendered.segments))

    def continuation(
        self,
        messages: Sequence[Message],
        new_messages: Sequence[Message],
        *,
        after_generation: bool = True,
        generation_complete: bool = True,
        add_generation_prompt: bool = True,
        tools: Tools | None = None,
        reply_ids: Sequence[int] | None = None,
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
            reply_ids: The ids the model generated for the last message (kept verbatim). With a template that
                rewrites earlier turns they are compared with a fresh render, and the difference is counted in
                :attr:`EncodedChat.drift`. When they end with more of the template's end sequence than its first
                token (:attr:`end_sequence_ids`), the continuation starts after what they hold.

        Returns:
            Only the ids to append, with their assistant mask (and the drift).

        Raises:
            ValueError: If ``after_generation`` and the last message is not an assistant message.
            TemplateNotPrefixStable: If adding the messages changes how the earlier chat renders.
        """
        build = functools.partial(
            continuation_tail,
            self.template,
            new_messages=_real(new_messages),
            after_generation=after_generation,
            generation_complete=generation_complete,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            kept=None if reply_ids is None or not self.template.derived else self.decode(reply_ids),
            end_tokens=() if self.template.derived else self._end_strings(),
            written_end=self.written_end(reply_ids, generation_complete) if after_generation else "",
        )
        tail = self._render_tail(build, _real(messages))
        encoded = self._encode_tail(tail)
        if tail.drift is None:
            return encoded
        return dataclasses.replace(encoded, drift=self._drift_tokens(*tail.drift))

    def _end_strings(self) -> tuple[str, ...]:
        if self._end_of_turn is None:
            return ()  # computing the end-of-turn ids itself renders continuations
        return tuple(self.decode([i]) for i in self._end_of_turn)

    def _drift_tokens(self, kept: str, fresh: str) -> int:
        """Tokens of ``kept`` a fresh render writes differently: what is left once common ends are removed."""
        a, b = self.encode_markup(kept), self.encode_markup(fresh)
        head = _first_difference(a, b)
        tail = 0
        while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
            tail += 1
        return max(len(a), len(b)) - head - tail

    def _render_tail(self, build: TailBuilder, messages: list[Message]) -> Tail:
        """``build(messages)``, from a window of the messages where allowed, checked every N-th time."""
        shorter = window(messages) if self._windowing else None
        if shorter is None:
            return build(messages)
        self._window_calls += 1
        every = self.check_window_every
        checked = every is not None and self._window_calls >= self._next_window_check
        if every is not None and checked:
            # the next check comes later in long chats: checks cost a bounded share of every step
            self._next_window_check = self._window_calls + every * max(1, len(messages) // 32)
        try:
            tail: Tail | None = build(shorter)
        except TemplateError:
            tail = None  # the whole chat decides: it raises the same error, or shows the window is wrong
        if tail is not None and not checked:
            return tail
        full = build(messages)
        if tail != full:
            self._windowing = False
            name = self.template.name or "<tokenizer template>"
            warnings.warn(
                f"template {name!r} renders a continuation differently from a window of the chat (first message "
                f"and last two) than from the whole chat (windowed call {self._window_calls}, chat of "
                f"{len(messages)} messages); the whole chat's ids were used, and this ChatTokenizer renders whole "
                "chats from now on",
                TemplateWindowWarning,
                stacklevel=4,
            )
        return full

    # ---------------------------------------------------------------------------------------- responses

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Decode ids to text exactly as the template wrote it (special tokens kept, no space clean-up)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._markup.decode(list(ids), skip_special_tokens=False)

    @property
    def generation_header(self) -> str:
        """The text the template puts before an assistant reply (ChatML: ``<|im_start|>assistant`` + newline)."""
        derived = self.template.derived_profile
        if self._header is None and derived is not None and derived.generation_prompt:
            self._header = derived.generation_prompt
        if self._header is None:
            chat = [dict(m) for m in _PROBE_CHAT[:2]]
            if derived is not None and not derived.system:
                chat = chat[1:]
            rendered = self.template.render(chat, add_generation_prompt=False)
            bare = rendered.text
            full = self.template.render(chat, add_generation_prompt=True).text
            if full == bare and self.template.derived:
                # the header follows every user message whatever add_generation_prompt says (Phi-3, LLaVA-Next): it
                # is the markup after the user's content (its closing included)
                content = [seg for seg in rendered.segments if seg.is_content]
                self._header = bare[content[-1].end :] if content else ""
                return self._header
            if not full.startswith(bare) or full == bare:
                raise TemplateError(
                    f"template {self.template.name or '<tokenizer template>'!r} adds no generation header after "
                    "the chat (add_generation_prompt=True renders nothing new)"
                )
            self._header = full[len(bare) :]
        return self._header

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a reply: the template's end-of-turn ids, then the tokenizer's EOS if it is another id.

        A reply ended by the end-of-turn id is complete; one ended by a different EOS id is closed by the env with
        the template's markup (unmasked: the model did not write it), as a cut reply is.
        """
        eos = getattr(self.tokenizer, "eos_token_id", None)
        ends = self.end_of_turn_ids
        return ends if eos is None or int(eos) in ends else (*ends, int(eos))

    @property
    def end_of_turn_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn: the first token the template writes after the reply's content."""
        derived = self.template.derived_profile
        if self._end_of_turn is None and derived is not None:
            ids = []
            for token in derived.stops:
                enc = self.encode_markup(token)
                if len(enc) != 1:
                    raise TemplateError(f"the end-of-turn token {token!r} is not one token of this tokenizer ({enc})")
                ids.append(enc[0])
            self._end_of_turn = tuple(dict.fromkeys(ids))
        if self._end_of_turn is None:
            chat = [dict(m) for m in _PROBE_CHAT[:3]]
            encoded = self.encode(chat)
            rendered = self.render(chat)
            content = [s for s in rendered.segments if s.is_content and s.message == 2]
            gen = [s for s in rendered.segments if s.is_generation]
            if not content or not gen or gen[-1].end <= content[-1].end:
                raise TemplateError(
                    f"template {self.template.name or '<tokenizer template>'!r} marks no end-of-turn token "
                    "after the assistant's content"
                )
            closing = self.encode_markup(rendered.text[content[-1].end : gen[-1].end])
            if not closing or closing[0] not in encoded.ids.tolist():
                raise TemplateError("could not find the template's end-of-turn token")
            self._end_of_turn = (closing[0],)
        return self._end_of_turn

    def reply(self, messages: Sequence[Message], reply: Message, *, tools: Tools | None = None) -> EncodedChat:
        """The ids a model would generate for ``reply`` after ``messages`` and the assistant header.

        That is the reply's generation span as the template renders it (content and end-of-turn token), encoded
        like :meth:`encode` would. Only a window of the chat is rendered, as in :meth:`continuation`.
        """
        build = functools.partial(reply_tail, self.template, reply=dict(reply), tools=tools)
        encoded = self._encode_tail(self._render_tail(build, _real(messages)))
        ids = encoded.ids.tolist()
        stops = set(self.stop_ids)
        cut = next((k for k, i in enumerate(ids) if i in stops), None)
        if cut is not None and cut + 1 < len(ids):
            # a model stops at the end-of-turn id: what the template writes after it is the env's continuation
            return EncodedChat(encoded.ids[: cut + 1], encoded.assistant_mask[: cut + 1], self.decode(ids[: cut + 1]))
        derived = self.template.derived_profile
        if cut is None and derived is not None:
            # the template closes a reply with the next message's header (GLM): a model ends it with that token
            stop = derived.tool_stop if reply.get("tool_calls") else None
            end = torch.tensor(self.encode_markup(stop) if stop else [self.end_of_turn_ids[0]])
            return EncodedChat(
                torch.cat([encoded.ids, end]),
                torch.cat([encoded.assistant_mask, torch.ones(1, dtype=torch.bool)]),
                encoded.text + self.decode(end.tolist()),
            )
        return encoded

    # ---------------------------------------------------------------------------------------- checking

    def verify(self) -> None:
        """Check the template: windowed rendering where proven exact, and turn-by-turn encoding on a probe chat.

        Windowing is allowed only when :func:`~chatenv.templates.continuation.window_is_exact` proves it on
        chats of many shapes; otherwise continuations render whole chats. Then the probe chat is encoded turn
        by turn, as stepping does, and must give the ids and mask of encoding it whole (a derived template that
        rewrites earlier turns is append-only instead, with the drift recorded per step).

        A template derived from the tokenizer's own is also compared with the tokenizer: the probe chat's text
        and prompt ids must equal what ``tokenizer.apply_chat_template`` gives.

        Raises:
            TemplateNotPrefixStable: If appending turn by turn gives other ids or masks.
            TemplateError: If a derived template renders the probe chat unlike the tokenizer itself.
        """
        self._windowing = window_is_exact(self.template)
        self.end_of_turn_ids  # noqa: B018  (computed before stepping: continuations need the end-of-turn token)
        if self.template.derived and self.template.source == getattr(self.tokenizer, "chat_template", None):
            check_against_tokenizer(self, _PROBE_CHAT)
        verify_turn_by_turn(self, _PROBE_CHAT)
        self._window_calls = 0  # run-time sampling counts the caller's continuations


_CACHE: weakref.WeakKeyDictionary[Any, dict[tuple[str | None, str | None], ChatTokenizer]] = weakref.WeakKeyDictionary()


def chat_tokenizer(tokenizer: Any, template: str | ChatTemplate | None = None) -> ChatTokenizer:
    """A :class:`ChatTokenizer` for ``tokenizer`` and ``template``, verified once and cached per tokenizer.

    The template choice is cached too, so picking the tokenizer's own template (probe renders) happens once.
    """
    if isinstance(template, ChatTemplate):
        key: tuple[str | None, str | None] = (template.name, template.source)
    else:
        # the tokenizer's own template may be replaced by the user: it is part of the key
        key = (template, None if template is not None else str(getattr(tokenizer, "chat_template", None)))
    per_tok = _CACHE.setdefault(tokenizer, {})
    if key not in per_tok:
        per_tok[key] = ChatTokenizer(tokenizer, template)
    return per_tok[key]
