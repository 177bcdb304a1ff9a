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
from typing import Any

import torch
from tensordict import TensorClass

from chatenv.history import History

__all__ = [
    "ChatHistory",
    "LogProbs",
    "Masks",
    "Text",
    "Tokens",
    "pad_sequences",
    "unpad_sequences",
]

_PARTS = ("prompt", "response")


def pad_sequences(
    sequences: Sequence[torch.Tensor], side: str = "right", value: Any = 0, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D tensors of different lengths into a padded ``(B, T)`` tensor.

    Args:
        sequences: ``(T_b,)`` tensors of one dtype.
        side: ``"left"`` or ``"right"``.
        value: Padding value.
        length: Width ``T`` (default: the longest sequence).

    Returns:
        The padded tensor and the ``(B, T)`` bool mask of real positions.
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    lengths = [int(s.shape[0]) for s in sequences]
    width = max(lengths, default=0) if length is None else length
    if width < max(lengths, default=0):
        raise ValueError(f"length={width} is shorter than the longest sequence ({max(lengths)})")
    dtype = sequences[0].dtype if sequences else torch.long
    out = torch.full((len(sequences), width), value, dtype=dtype)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for b, (s, n) in enumerate(zip(sequences, lengths)):
        sl = slice(width - n, width) if side == "left" else slice(0, n)
        out[b, sl] = s
        mask[b, sl] = True
    return out, mask


def unpad_sequences(padded: torch.Tensor, lengths: torch.Tensor | Sequence[int], side: str = "right") -> list:
    """Inverse of :func:`pad_sequences`: the real positions of each row."""
    width = padded.shape[-1]
    out = []
    for row, n in zip(padded, [int(x) for x in lengths]):
        out.append(row[width - n :] if side == "left" else row[:n])
    return out


def _nested(seqs: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(seqs, layout=torch.jagged)


class _SequenceMixin:
    """Padded/nested conversions shared by Tokens, LogProbs and Masks."""

    _fill: Any = 0

    @classmethod
    def from_sequences(
        cls,
        prompt: Sequence[torch.Tensor] | None = None,
        response: Sequence[torch.Tensor] | None = None,
        *,
        padded: bool = True,
        pad_value: Any = None,
    ):
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
        n = len(prompt if prompt is not None else response)
        fill = cls._fill if pad_value is None else pad_value
        fields: dict[str, Any] = {}
        lengths = {}
        for part, seqs, side in (("prompt", prompt, "left"), ("response", response, "right")):
            if seqs is None:
                continue
            seqs = [torch.as_tensor(s) for s in seqs]
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

    def _parts(self) -> dict[str, list[torch.Tensor]]:
        """Unpadded prompt/response sequences per row."""
        out = {}
        for part, side in (("prompt", "left"), ("response", "right")):
            value = getattr(self, part)
            if value is None:
                continue
            lengths = getattr(self, f"{part}_length")
            out[part] = unpad_sequences(value, lengths, side) if self.padded else list(value.unbind())
        return out

    def full_sequences(self) -> list[torch.Tensor]:
        """The unpadded ``full`` sequence of each row."""
        if not self.padded:
            return list(self.full.unbind())
        p_width = self.prompt.shape[-1] if self.prompt is not None else 0
        out = []
        for row, p, r in zip(self.full, self.prompt_length.tolist(), self.response_length.tolist()):
            out.append(torch.cat([row[p_width - p : p_width], row[p_width : p_width + r]]))
        return out

    def to_padded(self, pad_value: Any = None):
        """The same values in the padded layout (a no-op copy if already padded)."""
        if self.padded:
            return self.clone()
        parts = self._parts()
        return type(self).from_sequences(parts.get("prompt"), parts.get("response"), padded=True, pad_value=pad_value)

    def to_nested(self):
        """The same values as jagged nested tensors (a copy if already nested)."""
        if not self.padded:
            return self.clone()
        parts = self._parts()
        return type(self).from_sequences(parts.get("prompt"), parts.get("response"), padded=False)

    def attention_mask(self) -> torch.Tensor:
        """``(B, P + R)`` bool mask of the real positions of padded ``full``."""
        if not self.padded:
            raise ValueError("attention_mask() describes the padded layout; call to_padded() first")
        p_width = self.prompt.shape[-1] if self.prompt is not None else 0
        width = self.full.shape[-1]
        pos = torch.arange(width)
        p_len = self.prompt_length.unsqueeze(-1)
        r_len = self.response_length.unsqueeze(-1)
        return ((pos >= p_width - p_len) & (pos < p_width)) | ((pos >= p_width) & (pos < p_width + r_len))


class Tokens(_SequenceMixin, TensorClass["nocast"]):
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


class LogProbs(_SequenceMixin, TensorClass["nocast"]):
    """Log-probabilities: position t holds log p(x_t | x_<t); undefined positions are NaN, never 0."""

    _fill = math.nan

    prompt: torch.Tensor | None = None
    response: torch.Tensor | None = None
    full: torch.Tensor | None = None
    prompt_length: torch.Tensor | None = None
    response_length: torch.Tensor | None = None
    padded: bool | None = None


class Masks(TensorClass["nocast"]):
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
        lengths = (tokens.prompt_length + tokens.response_length).tolist()
        if assistant is None:
            assistant = [
                torch.cat([torch.zeros(p, dtype=torch.bool), torch.ones(r, dtype=torch.bool)])
                for p, r in zip(tokens.prompt_length.tolist(), tokens.response_length.tolist())
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
            prompt_length=tokens.prompt_length.clone(),
            response_length=tokens.response_length.clone(),
            padded=tokens.padded,
            batch_size=tokens.batch_size,
        )

    def to_nested(self) -> Masks:
        """The same masks as jagged nested tensors (a copy if already nested)."""
        if not self.padded:
            return self.clone()
        rows = [row[m] for row, m in zip(self.all_assistant_mask, self.all_attention_mask)]
        return Masks(
            all_attention_mask=_nested([torch.ones(int(m.sum()), dtype=torch.bool) for m in self.all_attention_mask]),
            all_assistant_mask=_nested(rows),
            prompt_length=self.prompt_length.clone(),
            response_length=self.response_length.clone(),
            padded=False,
            batch_size=self.batch_size,
        )

    def to_padded(self, prompt_width: int | None = None) -> Masks:
        """Padded layout; ``prompt_width`` is the padded prompt width (default: the longest prompt)."""
        if self.padded:
            return self.clone()
        p_width = int(self.prompt_length.max()) if prompt_width is None else prompt_width
        r_width = int(self.response_length.max())
        n = self.batch_size[0]
        attention = torch.zeros(n, p_width + r_width, dtype=torch.bool)
        assist = torch.zeros_like(attention)
        for b, (p, r, a) in enumerate(
            zip(self.prompt_length.tolist(), self.response_length.tolist(), self.all_assistant_mask.unbind())
        ):
            sl = torch.cat([torch.arange(p_width - p, p_width), torch.arange(p_width, p_width + r)])
            attention[b, sl] = True
            assist[b, sl] = a
        return Masks(
            all_attention_mask=attention,
            all_assistant_mask=assist,
            prompt_length=self.prompt_length.clone(),
            response_length=self.response_length.clone(),
            padded=True,
            batch_size=self.batch_size,
        )


class Text(TensorClass["nocast"]):
    """Text of prompts, responses and both (``full == prompt + response``)."""

    prompt: str | None = None
    response: str | None = None
    full: str | None = None


class ChatHistory(TensorClass["nocast"]):
    """Chats as :class:`~chatenv.history.History`: the prompt, the response messages, and both."""

    prompt: History | None = None
    response: History | None = None
    full: History | None = None
