"""Padding utilities: stack ragged 1-D tensors into ``(B, T)`` and back, or into jagged nested tensors.

A leaf module: it imports nothing from chatenv, so every other module can use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["nested", "pad_sequences", "tokenizer_pad_id", "unpad_sequences"]


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

    Example:
        >>> ids, mask = pad_sequences([torch.tensor([1, 2]), torch.tensor([3])], "left", 0)
        >>> ids
        tensor([[1, 2],
                [0, 3]])
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


def unpad_sequences(
    padded: torch.Tensor, lengths: torch.Tensor | Sequence[int], side: str = "right"
) -> list[torch.Tensor]:
    """Inverse of :func:`pad_sequences`: the real positions of each row (views, not copies)."""
    width = padded.shape[-1]
    out = []
    for row, n in zip(padded, [int(x) for x in lengths]):
        out.append(row[width - n :] if side == "left" else row[:n])
    return out


def nested(sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    """A jagged nested tensor holding exactly ``sequences``."""
    return torch.nested.as_nested_tensor(list(sequences), layout=torch.jagged)


def tokenizer_pad_id(tokenizer: Any) -> int:
    """The id padded token tensors are filled with: the tokenizer's pad id, else its EOS id.

    Raises:
        ValueError: If the tokenizer has neither (set ``tokenizer.pad_token``).
    """
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token")
    return int(pad)
