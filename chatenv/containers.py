"""Containers for what a policy reads and writes: ``ChatHistory``, ``Text``, ``Tokens``, ``Masks``, ``LogProbs``.

Each holds a ``prompt``, a ``response`` and their concatenation ``full``. Sequence containers (``Tokens``,
``LogProbs``, ``Masks``) come in two layouts with the same values:

- padded (``padded=True``): ``prompt`` is ``(B, P)`` padded on the left, ``response`` is ``(B, R)`` padded on
  the right, and ``full`` is ``(B, P + R)``, i.e. ``cat([prompt, response], -1)``;
- nested (``padded=False``): jagged ``torch.nested`` tensors holding exactly the unpadded sequences.

They also record ``prompt_length`` and ``response_length`` per row, so conversions both ways are lossless
even when the pad id is a real token (SmolLM2 pads with its end-of-turn token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from tensordict import TensorClass

from chatenv.history import History
from chatenv.padding import nested as _nested
from chatenv.padding import pad_sequences, unpad_sequences

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "ChatHistory",
    "LogProbs",
    "Masks",
    "Text",
    "Tokens",
]

_PARTS = ("prompt", "response")
_ALL_PARTS = ("prompt", "response", "full")

# tensordict ships no type information: to the type checker its classes are Any
_TensorClass: Any = TensorClass["nocast"]


def _required(value: torch.Tensor | None, owner: object, name: str) -> torch.Tensor:
    """A field that the constructors always set (None only in a container built by hand without it)."""
    if value is None:
        raise ValueError(f"this {type(owner).__name__} has no {name!r}")
    return value


class _HasLengths(Protocol):
    prompt_length: torch.Tensor | None
    response_length: torch.Tensor | None


def _lengths(owner: _HasLengths) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``prompt_length`` and ``response_length`` of a container."""
    prompt_length = _required(owner.prompt_length, owner, "prompt_length")
    return prompt_length, _required(owner.response_length, owner, "response_length")


class _SequenceMixin:
    """Padded/nested conversions shared by Tokens, LogProbs and Masks."""

    _fill: Any = 0

    if TYPE_CHECKING:  # the fields of the tensorclasses it is mixed into
        prompt: torch.Tensor | None
        response: torch.Tensor | None
        full: torch.Tensor | None
        prompt_length: torch.Tensor | None
        response_length: torch.Tensor | None
        padded: bool | None

        def __init__(self, **fields: Any) -> None: ...
        def clone(self) -> Self: ...

    @classmethod
    def from_sequences(
        cls,
        prompt: Sequence[torch.Tensor] | None = None,
        response: Sequence[torch.Tensor] | None = None,
        *,
        padded: bool = True,
        pad_value: Any = None,
    ) -> Self:
        """Build from per-row 1-D tensors; ``full`` is their concatenation.

        Args:
            prompt: One ``(P_b,)`` tensor per row, or None.
            response: One ``(R_b,)`` tensor per row, or None.
            padded: Padded layout (prompts left, responses right) or nested.
            pad_value: Padding value (default: 0 for tokens, NaN for log-probs, False for masks).
        """
        if prompt is None and response is None:
            raise ValueError("give a prompt, a response, or both")
        if prompt is not None and response is not None and len(prompt) != len(response):
            raise ValueError(f"{len(prompt)} prompts but {len(response)} responses")
        n = len(prompt) if prompt is not None else len(response or ())
        fill = cls._fill if pad_value is None else pad_value
        fields: dict[str, Any] = {}
        lengths = {}
        for part, given, side in (("prompt", prompt, "left"), ("response", response, "right")):
            if given is None:
                continue
            seqs = [torch.as_tensor(s) for s in given]
            lengths[part] = torch.tensor([s.shape[0] for s in seqs], dtype=torch.long)
            fields[part] = pad_sequences(seqs, side, fill)[0] if padded else _nested(seqs)
        if padded:
            fields["full"] = torch.cat([fields[p] for p in _PARTS if p in fields], dim=-1)
        else:
            pieces = [s for s in (prompt, response) if s is not None]
            fields["full"] = _nested([torch.cat([torch.as_tensor(p[b]) for p in pieces]) for b in range(n)])
        return cls(
            **fields,
            prompt_length=lengths.get("prompt", torch.zeros(n, dtype=torch.long)),
            response_length=lengths.get("response", torch.zeros(n, dtype=torch.long)),
            padded=padded,
            batch_size=(n,),
        )

    def has(self, part: str) -> bool:
        """Whether ``part`` (``"prompt"``, ``"response"`` or ``"full"``) is set."""
        if part not in _ALL_PARTS:
            raise ValueError(f"part must be one of {_ALL_PARTS}, got {part!r}")
        return getattr(self, part) is not None

    def unpadded(self, part: str = "full") -> list[torch.Tensor]:
        """The exact sequence of each row of ``part`` (``"prompt"``, ``"response"`` or ``"full"``), unpadded.

        Works the same for the padded and the nested layout (a container of batch shape ``(B,)``).

        Raises:
            ValueError: For an unknown part, or a part that is not set.
        """
        if not self.has(part):
            raise ValueError(f"this {type(self).__name__} has no {part!r} (it holds {self._set_parts()})")
        if part == "full":
            return self.full_sequences()
        value: torch.Tensor = getattr(self, part)
        if not self.padded:
            return list(value.unbind())
        return unpad_sequences(value, getattr(self, f"{part}_length"), "left" if part == "prompt" else "right")

    def _set_parts(self) -> list[str]:
        return [p for p in _ALL_PARTS if getattr(self, p) is not None]

    def full_sequences(self) -> list[torch.Tensor]:
        """The unpadded ``full`` sequence of each row."""
        full = _required(self.full, self, "full")
        if not self.padded:
            return list(full.unbind())
        p_width = self.prompt.shape[-1] if self.prompt is not None else 0
        p_len, r_len = _lengths(self)
        out = []
        for row, p, r in zip(full, p_len.tolist(), r_len.tolist()):
            out.append(torch.cat([row[p_width - p : p_width], row[p_width : p_width + r]]))
        return out

    def to_padded(self, pad_value: Any = None) -> Self:
        """The same values in the padded layout (a no-op copy if already padded)."""
        if self.padded:
            return self.clone()
        return type(self).from_sequences(*self._prompt_response(), padded=True, pad_value=pad_value)

    def to_nested(self) -> Self:
        """The same values as jagged nested tensors (a copy if already nested)."""
        if not self.padded:
            return self.clone()
        return type(self).from_sequences(*self._prompt_response(), padded=False)

    def _prompt_response(self) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
        prompt, response = (self.unpadded(p) if self.has(p) else None for p in _PARTS)
        return prompt, response

    def attention_mask(self) -> torch.Tensor:
        """``(B, P + R)`` bool mask of the real positions of padded ``full``."""
        if not self.padded:
            raise ValueError("attention_mask() describes the padded layout; call to_padded() first")
        p_width = self.prompt.shape[-1] if self.prompt is not None else 0
        width = _required(self.full, self, "full").shape[-1]
        pos = torch.arange(width)
        p_len, r_len = (length.unsqueeze(-1) for length in _lengths(self))
        return ((pos >= p_width - p_len) & (pos < p_width)) | ((pos >= p_width) & (pos < p_width + r_len))


class Tokens(_SequenceMixin, _TensorClass):  # type: ignore[misc]  # tensordict's TensorClass is untyped (Any)
    """Token ids of prompts, responses and both.

    Example:
        >>> t = Tokens.from_sequences([torch.tensor([5, 6]), torch.tensor([7])],
        ...                           [torch.tensor([1]), torch.tensor([2, 3])], pad_value=0)
        >>> t.full
        tensor([[5, 6, 1, 0],
                [0, 7, 2, 3]])
        >>> [s.tolist() for s in t.to_nested().full.unbind()]
        [[5, 6, 1], [7, 2, 3]]
    """

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None
    prompt_length: torch.Tensor | None = None
    response_length: torch.Tensor | None = None
    padded: bool | None = None


class LogProbs(_SequenceMixin, _TensorClass):  # type: ignore[misc]  # tensordict's TensorClass is untyped (Any)
    """Log-probabilities: position t holds log p(x_t | x_<t); undefined positions are NaN, never 0."""

    _fill = math.nan

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None
    prompt_length: torch.Tensor | None = None
    response_length: torch.Tensor | None = None
    padded: bool | None = None


class Masks(_TensorClass):  # type: ignore[misc]  # tensordict's TensorClass is untyped (Any)
    """Masks with the shape of ``Tokens.full``.

    Attributes:
        all_attention_mask: True on real (non-padding) positions.
        all_assistant_mask: True on tokens the assistant produced, end-of-turn tokens included.
    """

    all_attention_mask: torch.Tensor | None = None
    all_assistant_mask: torch.Tensor | None = None
    prompt_length: torch.Tensor | None = None
    response_length: torch.Tensor | None = None
    padded: bool | None = None

    @classmethod
    def from_tokens(cls, tokens: Tokens, assistant: Sequence[torch.Tensor] | None = None) -> Masks:
        """Masks for ``tokens``: attention from its layout, assistant from per-row ``full``-length masks.

        Args:
            tokens: The tokens the masks describe.
            assistant: One bool tensor per row with the length of that row's unpadded ``full``; default: the
                response tokens (all that the model generated).
        """
        p_len, r_len = _lengths(tokens)
        lengths = (p_len + r_len).tolist()
        if assistant is None:
            assistant = [
                torch.cat([torch.zeros(p, dtype=torch.bool), torch.ones(r, dtype=torch.bool)])
                for p, r in zip(p_len.tolist(), r_len.tolist())
            ]
        for b, (a, n) in enumerate(zip(assistant, lengths)):
            if a.shape[0] != n:
                raise ValueError(f"row {b}: assistant mask has {a.shape[0]} entries, its full sequence {n}")
        if tokens.padded:
            attention = tokens.attention_mask()
            assist = torch.zeros_like(attention)
            assist[attention] = torch.cat(list(assistant)) if assistant else torch.zeros(0, dtype=torch.bool)
        else:
            attention = _nested([torch.ones(n, dtype=torch.bool) for n in lengths])
            assist = _nested([a.to(torch.bool) for a in assistant])
        return cls(
            all_attention_mask=attention,
            all_assistant_mask=assist,
            prompt_length=p_len.clone(),
            response_length=r_len.clone(),
            padded=tokens.padded,
            batch_size=tokens.batch_size,
        )

    def unpadded(self, name: str = "all_assistant_mask") -> list[torch.Tensor]:
        """The mask ``name`` of each row over its exact (unpadded) ``full`` sequence."""
        if name not in ("all_assistant_mask", "all_attention_mask"):
            raise ValueError(f"name must be 'all_assistant_mask' or 'all_attention_mask', got {name!r}")
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"these Masks have no {name!r}")
        if not self.padded:
            return list(value.unbind())
        return [row[m] for row, m in zip(value, _required(self.all_attention_mask, self, "all_attention_mask"))]

    def to_nested(self) -> Masks:
        """The same masks as jagged nested tensors (a copy if already nested)."""
        if not self.padded:
            return cast(Masks, self.clone())
        attention = _required(self.all_attention_mask, self, "all_attention_mask")
        rows = [row[m] for row, m in zip(_required(self.all_assistant_mask, self, "all_assistant_mask"), attention)]
        p_len, r_len = _lengths(self)
        return Masks(
            all_attention_mask=_nested([torch.ones(int(m.sum()), dtype=torch.bool) for m in attention]),
            all_assistant_mask=_nested(rows),
            prompt_length=p_len.clone(),
            response_length=r_len.clone(),
            padded=False,
            batch_size=self.batch_size,
        )

    def to_padded(self, prompt_width: int | None = None) -> Masks:
        """Padded layout; ``prompt_width`` is the padded prompt width (default: the longest prompt)."""
        if self.padded:
            return cast(Masks, self.clone())
        p_len, r_len = _lengths(self)
        p_width = int(p_len.max()) if prompt_width is None else prompt_width
        r_width = int(r_len.max())
        n = self.batch_size[0]
        attention = torch.zeros(n, p_width + r_width, dtype=torch.bool)
        assist = torch.zeros_like(attention)
        assistant = _required(self.all_assistant_mask, self, "all_assistant_mask")
        for b, (p, r, a) in enumerate(zip(p_len.tolist(), r_len.tolist(), assistant.unbind())):
            sl = torch.cat([torch.arange(p_width - p, p_width), torch.arange(p_width, p_width + r)])
            attention[b, sl] = True
            assist[b, sl] = a
        return Masks(
            all_attention_mask=attention,
            all_assistant_mask=assist,
            prompt_length=p_len.clone(),
            response_length=r_len.clone(),
            padded=True,
            batch_size=self.batch_size,
        )


class Text(_TensorClass):  # type: ignore[misc]  # tensordict's TensorClass is untyped (Any)
    """Text of prompts, responses and both (``full == prompt + response``)."""

    prompt: str | None = None
    response: str | None = None
    full: str | None = None


class ChatHistory(_TensorClass):  # type: ignore[misc]  # tensordict's TensorClass is untyped (Any)
    """Chats as :class:`~chatenv.history.History`: the prompt, the response messages, and both."""

    prompt: History | None = None
    response: History | None = None
    full: History | None = None
