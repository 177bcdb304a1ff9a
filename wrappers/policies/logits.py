"""The sampling distribution, written once: from a model's logits to the logits of what is sampled.

:func:`process_logits` applies the generation settings in the order ``transformers``' ``generate`` applies
them (repetition penalty, the end-of-turn ban of ``min_new_tokens``, then temperature, top-k, top-p and min-p),
so scoring a sampled sequence, stepping a token-level env and ``model.generate`` agree on every log-prob. It
works on logits of any leading shape: ``(B, T, V)`` when scoring (row t predicts token t + 1), ``(B, V)`` for
one next token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from chatenv.sampling import GenerationSettings

__all__ = [
    "apply_repetition_penalty",
    "new_token_counts",
    "prefix_seen",
    "process_logits",
    "reports_processed",
    "seen_tokens",
]


def reports_processed(settings: GenerationSettings, raw_log_probs: bool) -> bool:
    """Whether reported log-probs come from the processed distribution (else from the model's own logits).

    Greedy decoding and ``raw_log_probs=True`` report the model's own distribution.
    """
    return not raw_log_probs and not settings.greedy


def process_logits(
    logits: torch.Tensor,
    settings: GenerationSettings,
    *,
    stop_ids: Sequence[int] = (),
    new_tokens: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits of the distribution the settings sample from (for greedy settings: whose argmax is chosen).

    Args:
        logits: ``(..., V)`` float logits of the next token at each position. Not modified.
        settings: The generation settings.
        stop_ids: The ids ``min_new_tokens`` forbids (end-of-turn, EOS and extra stop ids).
        new_tokens: ``(...)`` long, how many response tokens come before the token each row predicts (negative
            in the prompt); needed when ``settings.min_new_tokens`` is set.
        seen: ``(..., V)`` bool, the tokens already in the sequence at each row (prompt included); needed when
            ``settings.repetition_penalty`` is not 1.

    Returns:
        ``(..., V)`` logits; forbidden or filtered tokens hold ``-inf``.

    Raises:
        ValueError: If a setting needs ``new_tokens`` or ``seen`` and they are missing or of the wrong shape.

    Example:
        >>> s = GenerationSettings(temperature=0.5, top_k=2)
        >>> process_logits(torch.tensor([1.0, 3.0, 2.0]), s).tolist()
        [-inf, 6.0, 4.0]
    """
    out = logits
    if settings.repetition_penalty != 1.0:
        if seen is None or seen.shape != logits.shape:
            raise ValueError(f"repetition_penalty needs the tokens seen at each position, a bool {tuple(logits.shape)}")
        out = apply_repetition_penalty(out, seen, settings.repetition_penalty)
    if settings.min_new_tokens and stop_ids:
        if new_tokens is None or new_tokens.shape != logits.shape[:-1]:
            raise ValueError(
                f"min_new_tokens needs the response tokens before each position, {tuple(logits.shape[:-1])}"
            )
        new_tokens = new_tokens.to(logits.device)
        early = (new_tokens >= 0) & (new_tokens < settings.min_new_tokens)
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        banned[list(stop_ids)] = True
        out = out.masked_fill(early.unsqueeze(-1) & banned, -math.inf)
    if settings.greedy:
        return out
    return _warp(out, settings)


def _warp(logits: torch.Tensor, s: GenerationSettings) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (sampling only), with ``transformers``' own filters for exact agreement."""
    from transformers.generation import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    if s.temperature != 1.0:
        logits = logits / s.temperature
    if not (s.top_k or s.top_p < 1.0 or s.min_p > 0.0):
        return logits
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])  # (N, V): the filters work on one row per distribution
    unused = torch.zeros(flat.shape[0], 1, dtype=torch.long, device=flat.device)
    if s.top_k:
        flat = TopKLogitsWarper(top_k=s.top_k)(unused, flat)
    if s.top_p < 1.0:
        flat = TopPLogitsWarper(top_p=s.top_p)(unused, flat)
    if s.min_p > 0.0:
        flat = MinPLogitsWarper(min_p=s.min_p)(unused, flat)
    return flat.reshape(shape)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make the ``seen`` tokens less likely: positive logits are divided by ``penalty``, negative multiplied.

    Args:
        logits: ``(..., V)`` logits.
        seen: ``(..., V)`` bool, True for the tokens to penalize.
        penalty: The penalty (> 1 discourages repeats).
    """
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def seen_tokens(rows: Sequence[Sequence[int]], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``(N, V)`` bool: the tokens each row holds (for a next-token distribution after each row)."""
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for b, row in enumerate(rows):
        if isinstance(row, torch.Tensor):
            ids = row.to(device=device, dtype=torch.long)
        else:
            ids = torch.tensor(np.asarray(row, dtype=np.int64), device=device)
        seen[b, ids] = True
    return seen


def prefix_seen(ids: torch.Tensor, lengths: Sequence[int], vocab: int) -> torch.Tensor:
    """``(B, T, V)`` bool: ``[b, t, v]`` is True when token v is among ``ids[b, : t + 1]``.

    Row t of scoring logits predicts token t + 1 after the prefix ``ids[: t + 1]``: the tokens a repetition
    penalty applies to there. Positions past a row's length stay False.

    Args:
        ids: ``(B, T)`` right-padded ids.
        lengths: The real length of each row.
        vocab: Size of the vocabulary (last dimension of the logits).
    """
    batch, width = ids.shape
    seen = torch.zeros(batch, width, vocab, dtype=torch.bool, device=ids.device)
    for b, n in enumerate(lengths):
        seq = ids[b, :n]
        uniq, inverse = torch.unique(seq, return_inverse=True)
        first = torch.full((len(uniq),), n, dtype=torch.long, device=ids.device)
        first = first.scatter_reduce(0, inverse, torch.arange(n, device=ids.device), reduce="amin")
        # (n, U): position t has seen distinct token u from its first occurrence on
        rows, cols = (torch.arange(n, device=ids.device)[:, None] >= first[None, :]).nonzero(as_tuple=True)
        seen[b, rows, uniq[cols]] = True
    return seen


def new_token_counts(prompt_lengths: Sequence[int], width: int) -> torch.Tensor:
    """``(B, T)`` long: response tokens before the token row t predicts (``t + 1 - prompt_length``)."""
    positions = torch.arange(width, dtype=torch.long)
    return positions[None, :] + 1 - torch.as_tensor(list(prompt_lengths), dtype=torch.long)[:, None]
