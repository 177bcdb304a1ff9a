"""Encoded chats (:class:`EncodedChat`) and the helpers of :mod:`chatenv.tokenization`.

The helpers: the two tokenizer copies, id utilities, and the turn-by-turn proof.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from chatenv.errors import TemplateNotPrefixStable

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from chatenv.templates import ChatTemplate, Segment

__all__ = [
    "EncodedChat",
    "backends",
    "check_against_tokenizer",
    "encode_segments",
    "encode_whole",
    "first_difference",
    "real_messages",
    "single_id",
    "unmask_after_end",
    "verify_turn_by_turn",
]

Message = Mapping[str, Any]


@dataclass(frozen=True)
class EncodedChat:
    """Token ids of a chat (or of a continuation) with their assistant mask.

    Attributes:
        ids: ``(T,)`` int64 token ids.
        assistant_mask: ``(T,)`` bool, True on tokens the assistant produces (content and end-of-turn).
        text: The text the ids encode.
        drift: For a continuation with a template that rewrites earlier turns: how many tokens of the kept reply
            a fresh render of the chat writes differently (0: none).
    """

    ids: torch.Tensor
    assistant_mask: torch.Tensor
    text: str
    drift: int = 0


class ChatEncoder(Protocol):
    """What the checks below use of a :class:`~chatenv.tokenization.ChatTokenizer` (which calls them)."""

    tokenizer: Any
    template: ChatTemplate

    def encode(  # noqa: D102
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False
    ) -> EncodedChat: ...

    def reply(self, messages: Sequence[Mapping[str, Any]], reply: Mapping[str, Any]) -> EncodedChat: ...  # noqa: D102

    def continuation(  # noqa: D102
        self,
        messages: Sequence[Mapping[str, Any]],
        new_messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
    ) -> EncodedChat: ...


def check_against_tokenizer(ct: ChatEncoder, probe_chat: Sequence[Mapping[str, Any]]) -> None:
    """The probe chat's prompt, rendered and encoded by ``ct``, equals the tokenizer's ``apply_chat_template``.

    Raises:
        TemplateError: With the chat, where text or ids differ.
    """
    from chatenv.errors import TemplateError

    profile = ct.template.profile
    if profile is None:
        raise ValueError("only a template with a derived profile is compared with its tokenizer")
    chat = [dict(m) for m in probe_chat if profile.system or m["role"] != "system"]
    prompt = chat[: next(i for i, m in enumerate(chat) if m["role"] == "assistant")]
    given = [dict(m, content=[{"type": "text", "text": m["content"]}]) if profile.content_blocks else m for m in prompt]
    ours = ct.encode(prompt, add_generation_prompt=True)
    # the template's own variables (a request's switches, such as enable_thinking) go to the tokenizer's render too
    switches = {k: v for k, v in ct.template.context.items() if k not in ("bos_token", "eos_token")}
    theirs = ct.tokenizer.apply_chat_template(given, tokenize=False, add_generation_prompt=True, **switches)
    ids = ct.tokenizer(theirs, add_special_tokens=False)["input_ids"]
    if ours.text != theirs or ours.ids.tolist() != list(ids):
        what = "text" if ours.text != theirs else "ids"
        raise TemplateError(
            f"the derived template renders this chat's {what} unlike tokenizer.apply_chat_template "
            f"({ours.text[-60:]!r} vs {theirs[-60:]!r}); chat: {prompt}"
        )


def verify_turn_by_turn(ct: ChatEncoder, probe_chat: Sequence[Mapping[str, Any]]) -> None:
    """Encode ``probe_chat`` turn by turn, as stepping does, and compare with encoding it whole.

    See :meth:`ChatTokenizer.verify <chatenv.tokenization.ChatTokenizer.verify>`.

    Raises:
        TemplateNotPrefixStable: If the ids or masks differ (for a template not known to rewrite its past).
    """
    chat = list(probe_chat)
    profile = ct.template.derived_profile
    if profile is not None and not profile.system:
        chat = chat[1:]  # the template refuses system messages
    whole = ct.encode(chat)
    first_reply = next(i for i, m in enumerate(chat) if m["role"] == "assistant")
    ids = [ct.encode(chat[:first_reply], add_generation_prompt=True).ids]
    masks = [torch.zeros_like(ids[0], dtype=torch.bool)]
    i = first_reply
    while i < len(chat):
        # what the model generates: the reply's span of the full encoding
        ids.append(ct.reply(chat[:i], chat[i]).ids)
        masks.append(torch.ones(len(ids[-1]), dtype=torch.bool))
        j = next((k for k in range(i + 1, len(chat)) if chat[k]["role"] == "assistant"), len(chat))
        cont = ct.continuation(chat[: i + 1], chat[i + 1 : j], add_generation_prompt=j < len(chat))
        ids.append(cont.ids)
        masks.append(cont.assistant_mask)
        i = j
    stepped = torch.cat(ids)
    if profile is not None and not profile.prefix_stable:
        return  # stepping is append-only with recorded drift; the derivation listed how the past is rewritten
    if not torch.equal(stepped, whole.ids) or not torch.equal(torch.cat(masks), whole.assistant_mask):
        n = first_difference(stepped.tolist(), whole.ids.tolist())
        raise TemplateNotPrefixStable(
            f"template {ct.template.name or '<tokenizer template>'!r} is not prefix-stable: encoding turn "
            f"by turn differs from encoding the whole chat at token {n} "
            f"({ct.tokenizer.decode(stepped[n : n + 8])!r} vs {ct.tokenizer.decode(whole.ids[n : n + 8])!r})"
        )


@functools.lru_cache(maxsize=8)
def backends(serialized: str) -> tuple[Tokenizer, Tokenizer]:
    """Two copies of a tokenizer: for markup (special tokens recognised) and for content (plain text).

    Cached per serialized tokenizer: building them takes a while, and they are never changed afterwards.
    """
    from tokenizers import Tokenizer

    markup, plain = Tokenizer.from_str(serialized), Tokenizer.from_str(serialized)
    for t in (markup, plain):
        t.no_truncation()
        t.no_padding()
    # content is text: special-token strings inside it are encoded as ordinary characters
    plain.encode_special_tokens = True
    return markup, plain


def unmask_after_end(ids: list[int], mask: list[bool], ends: set[int]) -> None:
    """Unmask generation-marked tokens after an end-of-turn id (a model stops there).

    A template may put more inside ``{% generation %}`` (LFM2's trailing newline); the model never writes it.
    """
    stopped = False
    for k, (i, m) in enumerate(zip(ids, mask)):
        if not m:
            stopped = False
        elif stopped:
            mask[k] = False
        elif i in ends:
            stopped = True


def single_id(ids: Sequence[int]) -> int | None:
    """The id of a one-token encoding, else None."""
    return int(ids[0]) if len(ids) == 1 else None


def first_difference(a: Sequence[object], b: Sequence[object]) -> int:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length if one is a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def real_messages(messages: Sequence[Message]) -> list[Message]:
    """Messages without the empty-role padding of ragged batches.

    Padding only ever trails (a chat with an empty role is refused when it is made), so this takes time that does
    not grow with the chat.
    """
    if isinstance(messages, Mapping):
        raise TypeError("expected a sequence of message dicts, got a single dict; wrap it in a list")
    end = len(messages)
    while end and messages[end - 1].get("role", None) == "":
        end -= 1
    return list(messages[:end])


def _encode_pieces(
    markup: Tokenizer, text: str, segments: Sequence[Segment], unmasked_until: int
) -> tuple[list[int], list[tuple[int, int]]]:
    r"""Encode ``text`` in pieces cut where a generation starts.

    The prompt before a reply is encoded on its own, as at inference (a prompt ending ``"\n\n"`` keeps that token,
    whatever the reply starts with).
    """
    cuts = [0]
    previous_end = -1
    for s in segments:
        if s.is_generation and s.end > unmasked_until:
            if s.start != previous_end and s.start > cuts[-1]:
                cuts.append(s.start)  # a generation starts here (not a continuation of the one before)
            previous_end = s.end
    cuts.append(len(text))
    pieces = [text[a:b] for a, b in zip(cuts, cuts[1:])]
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    for base, enc in zip(cuts, markup.encode_batch(pieces, add_special_tokens=False)):
        ids.extend(enc.ids)
        offsets.extend((a + base, b + base) for a, b in enc.offsets)
    return ids, offsets


def encode_whole(
    markup: Tokenizer, text: str, segments: Sequence[Segment], unmasked_until: int, special_ids: frozenset[int]
) -> tuple[list[int], list[bool]] | None:
    r"""Ids of ``text`` encoded in one piece (as ``apply_chat_template`` does), or None where that is unsafe.

    Encoding the whole text gives the ids a Hugging Face tokenizer gives (pre-tokenization sees across segment
    edges: ``"\n\n"`` before content may split as two newlines). It is used only when it keeps the guarantees
    of segment-wise encoding: no special token may come from content (a user who spells ``<|im_end|>`` would forge
    a turn), and no token may straddle the edge of an assistant span (the mask must be exact). Otherwise None, and
    the caller encodes segment by segment.

    Args:
        markup: The tokenizer (``tokenizers.Tokenizer``) that recognises special tokens.
        text: The text.
        segments: Its segments (``start``, ``end``, ``is_content``, ``is_generation``).
        unmasked_until: Generation segments ending at or before this offset are not masked.
        special_ids: Ids of the tokenizer's special tokens.
    """
    ids, offsets = _encode_pieces(markup, text, segments, unmasked_until)
    content = [(s.start, s.end) for s in segments if s.is_content and s.end > s.start]
    masked: list[list[int]] = []
    for s in segments:
        if s.is_generation and s.end > unmasked_until and s.end > s.start:
            if masked and masked[-1][1] == s.start:
                masked[-1][1] = s.end
            else:
                masked.append([s.start, s.end])
    starts = [a for a, _ in masked]
    content_starts = [a for a, _ in content]
    mask: list[bool] = []
    for i, (a, b) in zip(ids, offsets):
        if i in special_ids:
            k = bisect.bisect_right(content_starts, a) - 1
            if k >= 0 and content[k][0] <= a < content[k][1]:
                return None  # content spelled a special token
        k = bisect.bisect_right(starts, a) - 1
        within = k >= 0 and a < masked[k][1]  # the token starts inside masked span k
        later = starts[k + 1] if k + 1 < len(starts) else len(text) + 1
        if later < b or (within and b > masked[k][1]):
            return None  # the token straddles the edge of an assistant span
        mask.append(within)
    return list(ids), mask


def encode_segments(
    markup: Tokenizer, plain: Tokenizer, text: str, segments: Sequence[Segment], unmasked_until: int
) -> tuple[list[int], list[bool]]:
    """Segment by segment: markup with special tokens recognised, content as plain text (never a special token)."""
    pieces = [(s, text[s.start : s.end]) for s in segments]
    marks = [p for s, p in pieces if not s.is_content]
    texts = [p for s, p in pieces if s.is_content]
    enc_m = markup.encode_batch_fast(marks, add_special_tokens=False) if marks else []
    enc_p = plain.encode_batch_fast(texts, add_special_tokens=False) if texts else []
    it_m, it_p = iter(enc_m), iter(enc_p)
    ids: list[int] = []
    mask: list[bool] = []
    for seg, _ in pieces:
        seg_ids = (next(it_p) if seg.is_content else next(it_m)).ids
        ids.extend(seg_ids)
        mask.extend([seg.is_generation and seg.end > unmasked_until] * len(seg_ids))
    return ids, mask
