"""Per-position distributions over the vocabulary, aligned with ``tokens.full`` (what ``get_dist`` returns)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from tensordict import TensorDictBase

from chatenv.containers import Masks, Tokens

__all__ = [
    "TORCHRL_MASKS",
    "MaskedCategorical",
    "TorchRLDistributions",
    "dist_positions",
    "dist_request",
    "input_tokens",
    "masked_distribution",
    "position_mask",
]

MaskChoice = Literal["assistant", "response", "attention"]

#: TorchRL's loss masking strategies (``GRPOLoss(masking_strategy=...)``) as :meth:`get_dist` mask choices
TORCHRL_MASKS = {"sft": "response", "rlhf": "assistant", "generic": "attention"}


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


_TORCHRL_OPTIONS = frozenset({"logits_key", "tensordict_out", "as_padded_tensor", "as_nested_tensor", "layout"})


def dist_request(
    tensordict: TensorDictBase, mask: Any, mask_key: Any, padding_side: Any, options: dict[str, Any]
) -> MaskChoice | torch.Tensor | None:
    """Check ``get_dist``'s layout options and resolve its mask (``mask``, or the tensor at ``mask_key``).

    Of TorchRL's ``get_dist`` keywords, ``logits_key`` and ``tensordict_out`` are accepted and unused (logits are
    computed, not read); ``as_padded_tensor``, ``as_nested_tensor`` and ``layout`` may only ask for the padded
    result a :class:`MaskedCategorical` is.

    Raises:
        TypeError: For an unknown keyword.
        ValueError: For both ``mask`` and ``mask_key``, a nested or non-strided layout, or a padding side other
            than ``"left"``/``"right"``.
    """
    unknown = sorted(set(options) - _TORCHRL_OPTIONS)
    if unknown:
        raise TypeError(f"get_dist got unknown keyword(s) {unknown}; TorchRL's accepted: {sorted(_TORCHRL_OPTIONS)}")
    layout = options.get("layout")
    if (
        options.get("as_nested_tensor")
        or options.get("as_padded_tensor") is False
        or layout not in (None, torch.strided)
    ):
        raise ValueError(
            "get_dist returns distributions over padded (B, T) positions only; drop as_nested_tensor/"
            "as_padded_tensor=False/layout, and convert nested tokens with Tokens.to_padded() if needed"
        )
    if padding_side not in (None, "left", "right"):
        raise ValueError(f"padding_side must be None, 'left' or 'right', got {padding_side!r}")
    if mask_key is None:
        return mask
    if mask is not None:
        raise ValueError("give mask or mask_key, not both")
    return tensordict.get(mask_key)


class TorchRLDistributions:
    """The distribution methods TorchRL's LLM losses (``GRPOLoss`` and its variants) call on their actor by name.

    One per ``masking_strategy``: ``"sft"`` keeps the response tokens, ``"rlhf"`` the assistant's tokens,
    ``"generic"`` every real token. TorchRL reads the batch's ``tokens.full`` as it is, so the batch must hold
    padded containers (what :func:`chatenv.integrations.torchrl.grpo_batch` returns): the distribution takes their
    layout, position for position.
    """

    def _torchrl_dist(self: Any, tensordict: TensorDictBase, strategy: str) -> MaskedCategorical:
        tokens = input_tokens(tensordict, self.config.evolve(generate=False).resolved_input_key)
        if tokens is not None and not tokens.padded:
            raise ValueError(
                "TorchRL's loss reads the batch's tokens as they are, and these are nested: give it padded containers "
                "(chatenv.integrations.torchrl.grpo_batch(rollout) returns them; or Tokens/Masks/LogProbs.to_padded())"
            )
        dist = self.get_dist(tensordict, TORCHRL_MASKS[strategy])
        if strategy == "rlhf" and not dist.mask.any():
            raise ValueError(
                "masking_strategy='rlhf' keeps the assistant's tokens, but the batch marks none: give the assistant "
                f"masks (a chatenv Masks at {self.masks_key!r}, as chatenv.rollout records them) or use "
                "masking_strategy='sft'"
            )
        return dist

    def _get_sft_dist(self, tensordict: TensorDictBase, **kwargs: Any) -> MaskedCategorical:
        return self._torchrl_dist(tensordict, "sft")

    def _get_rlhf_dist(self, tensordict: TensorDictBase, **kwargs: Any) -> MaskedCategorical:
        return self._torchrl_dist(tensordict, "rlhf")

    def _get_generic_dist(self, tensordict: TensorDictBase, **kwargs: Any) -> MaskedCategorical:
        return self._torchrl_dist(tensordict, "generic")


def _flush(lengths: torch.Tensor, width: int, side: str) -> torch.Tensor:
    """``(B, width)`` bool: each row's ``lengths[b]`` real positions, all on the right (``"left"`` padding) or left."""
    pos = torch.arange(width)
    return pos >= width - lengths[:, None] if side == "left" else pos < lengths[:, None]


def dist_positions(
    tensordict: TensorDictBase, input_key: Any, attention: torch.Tensor, padding_side: str | None
) -> torch.Tensor:
    """Where the real tokens of each sequence sit in the distribution's ``(B, T)`` layout.

    Args:
        tensordict: The input of ``get_dist``.
        input_key: The policy's input key.
        attention: ``(B, T)`` real positions of the sequences padded as the policy writes ``tokens.full``.
        padding_side: ``"left"``/``"right"``: every sequence flush right/left (TorchRL's padding of nested
            sequences). None: the layout of the input's own padded ``Tokens`` at ``input_key`` when it has one (so
            a batch sampled from a replay buffer, wider than its longest prompt, stays aligned), else
            ``attention``'s.
    """
    lengths = attention.sum(-1)
    if padding_side is not None:
        return _flush(lengths, attention.shape[-1], padding_side)
    tokens = input_tokens(tensordict, input_key)
    if tokens is not None and tokens.padded and tokens.has("prompt"):
        positions = tokens.attention_mask()
        if torch.equal(positions.sum(-1), lengths):
            return positions
    return attention


def input_tokens(tensordict: TensorDictBase, input_key: Any) -> Tokens | None:
    """The :class:`Tokens` container ``input_key`` (``(..., "full")``) points into, if it is one."""
    if isinstance(input_key, tuple) and len(input_key) >= 2 and input_key[-1] in ("prompt", "full"):
        parent = tensordict.get(input_key[:-1] if len(input_key) > 2 else input_key[0], None)
        if isinstance(parent, Tokens):
            return parent
    return None


def masked_distribution(
    tokens: Tokens,
    masks: Masks,
    logits: Sequence[torch.Tensor],
    mask: MaskChoice | torch.Tensor = "assistant",
    padding_value: float = 0.0,
    positions: torch.Tensor | None = None,
) -> MaskedCategorical:
    """A :class:`MaskedCategorical` over padded sequences from per-sequence logits.

    Args:
        tokens: Padded tokens of the sequences.
        masks: Their masks.
        logits: Per sequence, ``(T_b, V)`` logits whose row t is the distribution of token t.
        mask: Which positions to keep (see :func:`position_mask`); a tensor is read in the layout of ``positions``.
        padding_value: What masked positions give.
        positions: ``(B, T')`` bool, where each sequence's tokens go (see :func:`dist_positions`); default: the
            layout of ``tokens.full``.

    Raises:
        ValueError: For a mask tensor whose shape is not the layout's.
    """
    attention = masks.all_attention_mask
    target = attention if positions is None else positions
    out = torch.zeros(*target.shape, logits[0].shape[-1], dtype=logits[0].dtype)  # (B, T', V)
    out[target] = torch.cat(list(logits))
    if isinstance(mask, torch.Tensor):
        if mask.shape != target.shape:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not match the sequences' padded layout {tuple(target.shape)}"
            )
        first = torch.zeros_like(target)
        first[torch.arange(target.shape[0]), target.long().argmax(-1)] = True
        keep = mask.to(torch.bool) & target & ~first
    else:
        keep = torch.zeros_like(target)
        keep[target] = position_mask(tokens, masks, mask)[attention]
    return MaskedCategorical(out, keep, padding_value=padding_value)
