"""Per-position distributions over the vocabulary, aligned with ``tokens.full`` (what ``get_dist`` returns)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from chatenv.containers import Masks, Tokens

__all__ = ["MaskedCategorical", "masked_distribution", "position_mask"]

MaskChoice = Literal["assistant", "response", "attention"]


class MaskedCategorical(torch.distributions.Distribution):
    """Categorical distributions over the vocabulary, one per position of ``tokens.full``, with a position mask.

    Position t is the distribution of token t given the tokens before it (what :class:`LogProbs` holds).
    Masked positions (padding, the first token of each sequence, and whatever ``mask`` excludes) give
    ``padding_value`` from :meth:`log_prob` and :meth:`entropy`, so sums over positions count only the kept
    ones; :attr:`mask` says which those are.

    Args:
        logits: ``(B, T, V)`` logits.
        mask: ``(B, T)`` bool, True where the distribution is used.
        padding_value: What masked positions give.

    Example:
        >>> dist = MaskedCategorical(torch.zeros(1, 3, 4), torch.tensor([[False, True, True]]))
        >>> dist.log_prob(torch.tensor([[0, 1, 2]])).exp().tolist()
        [[1.0, 0.25, 0.25]]
    """

    arg_constraints: dict = {}
    has_enumerate_support = False

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor, padding_value: float = 0.0):
        if mask.shape != logits.shape[:-1]:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not match logits {tuple(logits.shape)}")
        self.logits = logits.log_softmax(-1)
        self.mask = mask.to(torch.bool)
        self.padding_value = padding_value
        super().__init__(batch_shape=mask.shape, validate_args=False)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of ``value`` (``(B, T)`` token ids)."""
        lp = self.logits.gather(-1, value.long().clamp(0, self.logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        return torch.where(self.mask, lp, torch.full_like(lp, self.padding_value))

    def entropy(self) -> torch.Tensor:
        """Entropy per position."""
        p = self.logits.exp()
        ent = -(p * torch.where(p > 0, self.logits, torch.zeros_like(self.logits))).sum(-1)
        return torch.where(self.mask, ent, torch.full_like(ent, self.padding_value))

    def sample(self, sample_shape: torch.Size | tuple = ()) -> torch.Tensor:
        """Sample token ids per position (masked positions hold -1)."""
        probs = self.logits.exp().reshape(-1, self.logits.shape[-1])
        n = int(np.prod(sample_shape)) if sample_shape else 1
        draws = torch.multinomial(probs, n, replacement=True).T.reshape(*sample_shape, *self.mask.shape)
        return torch.where(self.mask, draws, torch.full_like(draws, -1))

    @property
    def mode(self) -> torch.Tensor:
        """Most likely token per position (masked positions hold -1)."""
        top = self.logits.argmax(-1)
        return torch.where(self.mask, top, torch.full_like(top, -1))


def position_mask(tokens: Tokens, masks: Masks, mask: MaskChoice | torch.Tensor) -> torch.Tensor:
    """``(B, T)`` bool: the positions of padded ``tokens.full`` a distribution is kept at.

    Args:
        tokens: Padded tokens of the sequences.
        masks: Their masks.
        mask: ``"assistant"`` (the assistant's tokens), ``"response"``, ``"attention"`` (every real token), or a
            ``(B, T)`` bool tensor in the layout of ``tokens.full``. The first token of each sequence (no
            distribution) is always dropped.

    Raises:
        ValueError: For another ``mask`` value or a tensor of the wrong shape.
    """
    attention = masks.all_attention_mask
    if isinstance(mask, torch.Tensor):
        if mask.shape != attention.shape:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not match tokens.full {tuple(attention.shape)}")
        keep = mask.to(torch.bool) & attention
    elif mask == "assistant":
        keep = masks.all_assistant_mask
    elif mask == "response":
        keep = attention.clone()
        keep[:, : tokens.prompt.shape[-1]] = False
    elif mask == "attention":
        keep = attention
    else:
        raise ValueError(f"mask must be 'assistant', 'response', 'attention' or a bool tensor, got {mask!r}")
    first = torch.zeros_like(attention)
    first[torch.arange(attention.shape[0]), attention.long().argmax(-1)] = True
    return keep & ~first


def masked_distribution(
    tokens: Tokens,
    masks: Masks,
    logits: Sequence[torch.Tensor],
    mask: MaskChoice | torch.Tensor = "assistant",
    padding_value: float = 0.0,
) -> MaskedCategorical:
    """A :class:`MaskedCategorical` over padded ``tokens.full`` from per-sequence logits.

    Args:
        tokens: Padded tokens of the sequences.
        masks: Their masks.
        logits: Per sequence, ``(T_b, V)`` logits whose row t is the distribution of token t.
        mask: Which positions to keep (see :func:`position_mask`).
        padding_value: What masked positions give.
    """
    attention = masks.all_attention_mask
    out = torch.zeros(*attention.shape, logits[0].shape[-1], dtype=logits[0].dtype)  # (B, T, V)
    out[attention] = torch.cat(list(logits))
    return MaskedCategorical(out, position_mask(tokens, masks, mask), padding_value=padding_value)
