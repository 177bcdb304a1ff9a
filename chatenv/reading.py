"""Reading what a model wrote from its ids: where a reply ends, its reasoning, content and tool calls.

:class:`ReplyReader` is part of :class:`~chatenv.tokenization.ChatTokenizer` (a mixin over its ``decode``,
``template``, ``stop_ids`` and ``end_of_turn_ids``): the one home of the end-of-reply rule for envs, policies and
the capture endpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from chatenv.encoding import single_id as _single_id
from chatenv.errors import TemplateError
from chatenv.templates.profile import ReasoningFormat
from chatenv.templates.tool_calls import ParsedCalls, ToolCallFormat, get_tool_format

if TYPE_CHECKING:
    from chatenv.templates import ChatTemplate

    class _TokenizerParts:
        """What :class:`~chatenv.tokenization.ChatTokenizer` gives the reader."""

        template: ChatTemplate

        def decode(self, ids: Sequence[int] | torch.Tensor) -> str: ...
        def encode_markup(self, text: str) -> list[int]: ...
        @property
        def generation_header(self) -> str: ...
        @property
        def stop_ids(self) -> tuple[int, ...]: ...
        @property
        def end_of_turn_ids(self) -> tuple[int, ...]: ...
else:
    _TokenizerParts = object

__all__ = ["ReplyReader"]


class ReplyReader(_TokenizerParts):
    """Reads replies from generated ids (mixed into :class:`~chatenv.tokenization.ChatTokenizer`)."""

    _stop_set: frozenset[int] | None = None
    _marker_ids: tuple[int | None, ...] | None = None
    _close_id: int | None = None

    def parse_response(
        self, ids: Sequence[int] | torch.Tensor, *, call_id_prefix: str = "call_"
    ) -> list[dict[str, Any]]:
        r"""Messages the model wrote in ``ids`` generated after the assistant header; structure comes from the ids.

        The first message is the assistant reply: every id up to the first stop *id* (:attr:`stop_ids`: the
        end-of-turn id, or the tokenizer's EOS; real special tokens), decoded; the stop id is not content. Text
        that merely spells markup (``"<|im_end|>\n<|im_start|>user"`` as plain-text tokens) is content and cannot
        end the reply or forge a turn. ``is_complete`` is False when no end-of-turn id ended the reply (it was
        cut, or an EOS that is not the template's end of turn ended it). Tool calls are read from a complete
        reply's own ids (:meth:`parse_tool_calls`); when they are exactly as the template writes them, the
        message carries ``tool_calls`` (ids ``call_id_prefix`` + 0, 1, ...) and the text before them as content;
        otherwise the reply keeps its text. Ids generated after the stop id (``ignore_eos``) follow as further
        messages.
        """
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]
        end, complete = self.reply_end(ids)
        reply_ids = ids if end is None else ids[:end]
        reply = self._reply_message(reply_ids, complete=complete, call_id_prefix=call_id_prefix)
        rest = [] if end is None else ids[end + self.end_length(ids, end) :]
        if not rest:
            return [reply]
        try:  # the ids went on past a real end-of-turn id: read what follows it (the reply itself stays out)
            more = self.template.parse(self.generation_header + "x" + self.decode(ids[end:]))[1:]
        except (TemplateError, ValueError):
            more = []
        return [reply, *(more or [{"role": "assistant", "content": self.decode(rest), "is_complete": False}])]

    def reply_end(self, ids: Sequence[int]) -> tuple[int | None, bool]:
        """Where a reply ends in generated ids: ``(index of the first stop id or None, whether it ends the turn)``.

        The one home of the end-of-reply rule (envs, policies, serve): a reply ends at its first :attr:`stop_ids`
        id; it is complete when that id is an end-of-turn id (another stop id, an EOS, ends it and the env closes the
        turn with unmasked markup); with no stop id it was cut.
        """
        stops = self.stop_set
        end = next((k for k, i in enumerate(ids) if int(i) in stops), None)
        return end, end is not None and int(ids[end]) in self.end_of_turn_set

    def end_length(self, ids: Sequence[int], end: int) -> int:
        """How many ids from the stop id at ``end`` on close the reply (1, or more for an end sequence).

        More when the template ends a reply with several tokens (:attr:`end_sequence_ids`, Cohere2's
        ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``) and the model sampled more of them: they are part of its reply,
        and the env does not write them again.
        """
        seq = self.end_sequence_ids
        n = 1
        if seq and int(ids[end]) == seq[0]:
            while n < len(seq) and end + n < len(ids) and int(ids[end + n]) == seq[n]:
                n += 1
        return n

    @property
    def end_sequence_ids(self) -> tuple[int, ...]:
        """The ids the template writes after every reply from its end-of-turn id on, when more than one.

        Cohere2's ``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>``; empty for most templates. A reply ends at the first (see
        :meth:`end_length`).
        """
        derived = self.template.derived_profile
        if derived is None or not derived.end_sequence:
            return ()
        return tuple(i for token in derived.end_sequence for i in self.encode_markup(token))

    def written_end(self, reply_ids: Sequence[int] | None, complete: bool) -> str:
        """The end markup past the end-of-turn id that a complete reply's ids already hold (its last ids), as text."""
        if reply_ids is None or not complete:
            return ""
        ids = [int(i) for i in reply_ids]
        end, _ = self.reply_end(ids)
        if end is None:
            return ""
        n = self.end_length(ids, end)
        return self.decode(ids[end + 1 : end + n]) if n > 1 and end + n == len(ids) else ""

    @property
    def stop_set(self) -> frozenset[int]:
        """:attr:`stop_ids` as a set (membership per generated token)."""
        if self._stop_set is None:
            self._stop_set = frozenset(self.stop_ids)
        return self._stop_set

    @property
    def end_of_turn_set(self) -> frozenset[int]:
        """:attr:`end_of_turn_ids` as a set."""
        return frozenset(self.end_of_turn_ids)

    def _reply_message(self, reply_ids: list[int], *, complete: bool, call_id_prefix: str) -> dict[str, Any]:
        # a cut reply keeps its raw text: its markup was not closed, so nothing in it is a finished tool call, and
        # its reasoning is not told from its content
        if not complete:
            return {"role": "assistant", "content": self.decode(reply_ids), "is_complete": False}
        parsed = self.parse_tool_calls(reply_ids, id_prefix=call_id_prefix)
        if parsed.items and parsed.canonical:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": [c.to_message() for c in parsed.calls],
            }
        else:
            message = {"role": "assistant", "content": parsed.text}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        return message

    @property
    def reasoning_format(self) -> ReasoningFormat | None:
        """How the template writes a reply's reasoning (read into ``reasoning_content``), or None."""
        return self.template.profile.reasoning if self.template.profile is not None else None

    @property
    def tool_format(self) -> ToolCallFormat | None:
        """How the template writes tool calls (None: it cannot render them)."""
        name = self.template.tool_format
        return None if name is None else get_tool_format(name)

    def _closing_id(self, fmt: ReasoningFormat) -> int:
        """The id of the reasoning's closing marker when it is one token, else -1."""
        if self._close_id is None:
            close = fmt.close.strip() or fmt.close
            found = _single_id(self.encode_markup(close)) if close else None
            self._close_id = -1 if found is None else found
        return self._close_id

    def closing_id(self) -> int | None:
        """The id of the reasoning's closing marker when it is one token (None: no reasoning format, or text)."""
        fmt = self.reasoning_format
        found = -1 if fmt is None else self._closing_id(fmt)
        return None if found < 0 else found

    def reasoning_closed(self, reply_ids: Sequence[int]) -> bool:
        """Whether a reply (so far) has closed its reasoning (False without a reasoning format)."""
        fmt = self.reasoning_format
        if fmt is None:
            return False
        close_id = self._closing_id(fmt)
        if close_id >= 0:
            return any(int(i) == close_id for i in reply_ids)
        close = fmt.close.strip() or fmt.close
        return bool(close) and close in self.decode(reply_ids)

    def _split_reasoning(self, fmt: ReasoningFormat, ids: list[int]) -> tuple[str | None, str]:
        """A reply's reasoning and content; the closing marker found among the ids when it is one token."""
        if self._closing_id(fmt) < 0:  # not one token: matched in the reply's decoded text
            return fmt.split(self.decode(ids))
        k = next((n for n, i in enumerate(ids) if i == self._close_id), None)
        if k is None:
            return fmt.split_at(self.decode(ids), None)
        return fmt.split_at(self.decode(ids[:k]), self.decode(ids[k + 1 :]))

    def split_reply(self, reply_ids: Sequence[int]) -> tuple[str | None, str | None]:
        """A reply's reasoning and the text its content and calls are read from, or ``(None, None)``.

        With a reasoning format the reasoning is split off (at the closing token among the ids when it is one
        token, so text that spells it stays in place; an unclosed reasoning is all reasoning); a template's own
        start of a reply (its reply prefix) is not content. ``(None, None)`` when neither applies: the reply is
        read from its ids as they are.
        """
        ids = [int(i) for i in reply_ids]
        reasoning_fmt = self.reasoning_format
        derived = self.template.derived_profile
        prefix = derived.reply_prefix if derived is not None else ""
        if reasoning_fmt is None and not prefix:
            return None, None
        content: str | None
        reasoning, content = self._split_reasoning(reasoning_fmt, ids) if reasoning_fmt else (None, self.decode(ids))
        if reasoning is None and prefix and content.startswith(prefix):
            content = content[len(prefix) :]  # the template's own start of a reply is not content
        elif reasoning is None:
            content = None
        return reasoning, content

    def parse_tool_calls(self, reply_ids: Sequence[int], *, id_prefix: str = "call_") -> ParsedCalls:
        """The tool calls in a reply's ids (without its end-of-turn id), with the template's tool-call format.

        Markers that are single tokens of the tokenizer are matched as ids (text that spells them is content);
        see :mod:`chatenv.templates.tool_calls`. A template without tool calls gives the decoded text, no calls.
        With a reasoning format, the reasoning is split off first (:meth:`split_reply`; :attr:`ParsedCalls.reasoning`)
        and calls are read from the final content's text.
        """
        ids = [int(i) for i in reply_ids]
        fmt = self.tool_format
        reasoning, content = self.split_reply(ids)
        if content is not None:
            parsed = fmt.parse_text(content, id_prefix) if fmt is not None else ParsedCalls(content, raw=content)
            return dataclasses.replace(parsed, reasoning=reasoning)
        if fmt is None:
            text = self.decode(ids)
            return ParsedCalls(text, raw=text)
        if self._marker_ids is None:
            self._marker_ids = tuple(_single_id(self.encode_markup(m)) for m in fmt.markers)
        return fmt.parse_ids(ids, self.decode, self._marker_ids, id_prefix)
