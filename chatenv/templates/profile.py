"""What a chat template was found to do: the values :mod:`chatenv.templates.derive` reads off probe renders.

A leaf module (no imports from the rest of chatenv), so the renderer can carry a profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ReasoningFormat", "TemplateProfile"]


@dataclass(frozen=True)
class ReasoningFormat:
    r"""How a template writes a reply's reasoning, and reading it back from what the model wrote.

    Attributes:
        key: The message key the template renders the reasoning from (``reasoning_content``, ``thinking``), or None
            when it renders none (it drops past reasoning and only prompts with an opening tag).
        open: Markup before the reasoning (``"<think>\n"``).
        close: Markup between the reasoning and the final content (``"\n</think>\n\n"``).
        prompt: ``"open"`` when the generation prompt already opens the reasoning (the model starts inside it),
            ``"closed"`` when it holds an empty, closed reasoning block (the model writes the final content only),
            ``"none"`` when the model writes the opening itself.

    Example:
        >>> fmt = ReasoningFormat("reasoning_content", "<think>\n", "\n</think>\n\n", "none")
        >>> fmt.split("<think>\n2+2 is 4\n</think>\n\nThe answer is 4.")
        ('2+2 is 4', 'The answer is 4.')
        >>> fmt.split("The answer is 4.")
        (None, 'The answer is 4.')
    """

    key: str | None
    open: str
    close: str
    prompt: str = "none"

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a reply's text; reasoning None when the reply has none.

        Whitespace around the reasoning is not part of it; a reply whose reasoning was opened but never closed is
        all reasoning (its final content is empty). The closing marker is found as text (see :meth:`split_at` for
        a reply whose closing token was found among its ids).
        """
        if self.prompt == "closed":
            return None, text
        close = self.close.strip() or self.close
        j = text.find(close) if close else -1
        return self.split_at(text, None) if j < 0 else self.split_at(text[:j], text[j + len(close) :])

    def split_at(self, before: str, after: str | None) -> tuple[str | None, str]:
        """``(reasoning, content)`` given the text before the reasoning's closing marker and after it.

        ``after`` is None when the reply never closed its reasoning. Used with the closing token found among the
        reply's ids, so text that merely spells the marker stays where it is.
        """
        close = self.close.strip() or self.close
        if self.prompt == "closed":
            return None, before if after is None else before + close + after
        if self.prompt == "open":
            body = before
        else:
            opening = self.open.strip() or self.open
            stripped = before.lstrip()
            if not opening or not stripped.startswith(opening):
                return None, before if after is None else before + close + after
            body = stripped[len(opening) :]
        if after is None:
            return body.strip(), ""
        trailing = self.close[self.close.find(close) + len(close) :] if close in self.close else ""
        if trailing and after.startswith(trailing):
            after = after[len(trailing) :]
        elif not trailing:
            after = after.lstrip("\n")  # the newlines a model writes after a bare closing tag are not content
        return body.strip(), after


@dataclass(frozen=True)
class TemplateProfile:
    """What the envs need from a chat template, derived by rendering probe chats.

    Attributes:
        end_of_turn: The special-token strings that end an assistant reply (the first one mid-chat, then the one
            written after the last reply when it differs).
        generation_prompt: What ``add_generation_prompt=True`` appends after a user message.
        content_blocks: The template reads content as a list of ``{"type": "text", "text": ...}`` blocks.
        system: The template accepts a system message.
        reasoning: How replies write reasoning, or None.
        tool_format: The registered tool-call format that reads back the template's calls, or None.
        rewrites: How adding messages changes the render of earlier ones (empty: prefix-stable on the probes).
        counterexample: The smallest probe chat that shows the first rewrite.
        reply_prefix: Markup the template writes at the start of a reply, before its content, after the
            generation prompt (gpt-oss: ``<|channel|>final<|message|>``; Idefics3: a space). A reply that starts
            with it keeps the rest as content.
        strips_content: The template trims whitespace around message content.
        json_arguments: The template renders a call's ``arguments`` given as a JSON string (DeepSeek V3), not as
            a dict; calls are handed to it that way.
        tool_stop: The special token that ends a reply with tool calls (also in ``end_of_turn``), when the template
            closes such replies with another token than plain ones (gpt-oss ``<|call|>``, GLM ``<|observation|>``).
        past_only: End-of-turn tokens the template writes only after past replies, never after the last one
            (gpt-oss: ``<|end|>``, while the model ends its reply with ``<|return|>``): they end replies in renders,
            but a model does not stop at them.
        end_sequence: The special tokens the template writes right after every reply's content, from its first
            end-of-turn token on, when that is more than one token (Cohere2: ``<|END_RESPONSE|>`` then
            ``<|END_OF_TURN_TOKEN|>``). A reply ends at the first; a model may go on to sample the rest, which then
            belongs to its reply and is not written again.
    """

    end_of_turn: tuple[str, ...]
    generation_prompt: str
    content_blocks: bool = False
    system: bool = True
    reasoning: ReasoningFormat | None = None
    tool_format: str | None = None
    rewrites: tuple[str, ...] = ()
    counterexample: tuple[dict[str, Any], ...] | None = None
    reply_prefix: str = ""
    strips_content: bool = False
    json_arguments: bool = False
    tool_stop: str | None = None
    past_only: tuple[str, ...] = ()
    end_sequence: tuple[str, ...] = ()

    @property
    def stops(self) -> tuple[str, ...]:
        """The end-of-turn tokens a model writes: :attr:`end_of_turn` less those written only for past replies."""
        return tuple(t for t in self.end_of_turn if t not in self.past_only)

    @property
    def prefix_stable(self) -> bool:
        """Whether the probes showed no rewrite of earlier turns."""
        return not self.rewrites
