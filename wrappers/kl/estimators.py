"""KL estimators and KL reward shaping: the one implementation every KL module of ``wrappers.kl`` uses.

- :func:`kl_estimate`: per-token KL(p || q) from the log-probs of the sampled tokens (Schulman's k1, k2, k3).
- :func:`shape_token_rewards`: per-token rewards ``r_t = -coef * kl_t`` on the positions that count (0 elsewhere),
  with the task reward added on the last counted position (Ziegler et al. 2019, TRL, OpenRLHF).
- :func:`check_kl_coef`, :func:`check_log_probs`, :func:`check_estimator`: the input checks they share, with
  errors that name where a bad value came from.

Example:
    >>> import torch
    >>> kl = kl_estimate(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0]))
    >>> kl
    tensor([ 0.5000, -1.0000])
    >>> shape_token_rewards(kl, task_reward=1.0, coef=0.1)
    tensor([-0.0500,  1.1000])
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import numpy as np
import torch

__all__ = [
    "KL_ESTIMATORS",
    "check_estimator",
    "check_kl_coef",
    "check_log_probs",
    "kl_estimate",
    "shape_token_rewards",
]

#: The estimator names :func:`kl_estimate` accepts (k1 is the default everywhere).
KL_ESTIMATORS = ("k1", "k2", "k3")

# log-probs from low-precision (bf16) logits can round a little above 0; anything larger is not a log-prob
_LOG_PROB_SLACK = 1e-2


def check_estimator(estimator: Any) -> str:
    """Return ``estimator`` if it names a KL estimator.

    Raises:
        ValueError: For any other value (with the closest name, if one is close).
    """
    if estimator in KL_ESTIMATORS:
        return estimator
    hint = difflib.get_close_matches(str(estimator).lower(), KL_ESTIMATORS, n=1, cutoff=0.5)
    extra = f"; did you mean {hint[0]!r}?" if hint else ""
    raise ValueError(f"estimator must be one of 'k1', 'k2', 'k3', got {estimator!r}{extra}")


def check_kl_coef(coef: Any, source: str = "coef") -> float:
    """``coef`` as a float, if it is a finite number >= 0.

    Args:
        coef: The KL coefficient.
        source: Where it came from, for the error message (e.g. ``"AdaptiveKLController.coef"``).

    Raises:
        TypeError: If it is not a real number.
        ValueError: If it is NaN, infinite or negative.
    """
    if isinstance(coef, bool) or not isinstance(coef, (int, float, np.integer, np.floating)):
        if not (isinstance(coef, torch.Tensor) and coef.numel() == 1):
            raise TypeError(f"{source} must be a number, got {type(coef).__name__}")
    value = float(coef)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{source} must be a finite number >= 0, got {value}")
    return value


def check_log_probs(values: Any, n: int, source: str) -> torch.Tensor:
    """``values`` as a ``(n,)`` float32 tensor of finite log-probs.

    Args:
        values: Log-probs of ``n`` tokens (a list, an array or a tensor; a number for one token).
        n: How many tokens they belong to.
        source: What they are, for the error message (e.g. ``"the policy's log-probs (ScoredAction.log_probs)"``).

    Raises:
        TypeError: For values that are not numbers.
        ValueError: For the wrong number of values, a NaN or infinite value, or a positive one (a log-prob is
            <= 0: probabilities or logits were passed).
    """
    try:
        arr = values.detach().cpu().float().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
        arr = arr.astype(np.float32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{source} must be numbers, got {type(values).__name__}: {e}") from e
    if sum(d != 1 for d in arr.shape) > 1:
        raise ValueError(f"{source} must be one value per generated token, got shape {arr.shape} for {n} tokens")
    t = torch.from_numpy(arr).reshape(-1)  # (n,)
    if t.shape[0] != n:
        raise ValueError(f"{source} has {t.shape[0]} values for {n} generated tokens")
    bad = (~torch.isfinite(t)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"{source} is not finite at token {i} of {n} ({float(t[i])}); a KL needs defined log-probs on every "
            "generated token"
        )
    positive = (t > _LOG_PROB_SLACK).nonzero()
    if len(positive):
        i = int(positive[0])
        raise ValueError(
            f"{source} is positive at token {i} of {n} ({float(t[i])}): log-probs are <= 0; were probabilities or "
            "logits passed instead?"
        )
    return t


def kl_estimate(log_p: torch.Tensor, log_q: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token estimates of KL(p || q) from the log-probs of tokens sampled from p.

    With ``r = log p - log q``: k1 = r (unbiased, can be negative per token); k2 = r² / 2 (low variance, biased);
    k3 = exp(-r) - 1 + r (unbiased and >= 0). Computed in the dtype of the inputs.

    Args:
        log_p: Log-probs under the sampling (policy) distribution, any shape.
        log_q: Log-probs of the same tokens under the reference, same shape.
        estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"``.

    Returns:
        The estimates, shaped like ``log_p``.

    Raises:
        ValueError: For an unknown estimator or different shapes.
    """
    check_estimator(estimator)
    log_p, log_q = torch.as_tensor(log_p), torch.as_tensor(log_q)
    if log_p.shape != log_q.shape:
        raise ValueError(f"log_p and log_q must have the same shape, got {tuple(log_p.shape)} and {tuple(log_q.shape)}")
    log_ratio = log_p - log_q
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.expm1(-log_ratio) + log_ratio


def shape_token_rewards(kl: Any, task_reward: Any, coef: Any, mask: Any = None) -> torch.Tensor:
    """Per-token KL-shaped rewards: ``-coef * kl_t`` where counted, 0 elsewhere, plus the task reward at the end.

    The task reward goes on the **last** counted position of each row (a row with no counted position gets it on
    its last position, so it is never lost). Uncounted positions are 0 whatever ``kl`` holds there (NaN included).

    Args:
        kl: Per-token KL estimates, ``(..., T)``.
        task_reward: The task reward of each row: a number, or ``(...)`` (a trailing 1 is allowed).
        coef: The KL coefficient (a finite number >= 0).
        mask: ``(..., T)`` bool, the positions that count (default: all).

    Returns:
        ``(..., T)`` rewards in the floating dtype of ``kl``.

    Raises:
        ValueError: For a negative or non-finite ``coef``, a non-finite ``task_reward`` or a non-finite KL on a
            counted position, or shapes that do not match.

    Example:
        >>> import torch
        >>> shape_token_rewards(torch.tensor([[0.5, 9.0, 0.5]]), torch.tensor([2.0]), 0.1,
        ...                     mask=torch.tensor([[True, False, True]]))
        tensor([[-0.0500,  0.0000,  1.9500]])
    """
    coef = check_kl_coef(coef, "coef")
    kl = torch.as_tensor(kl)
    if not kl.is_floating_point():
        kl = kl.float()
    if kl.dim() == 0:
        raise ValueError("kl must have a token dimension, got a scalar")
    counted = torch.ones_like(kl, dtype=torch.bool) if mask is None else torch.as_tensor(mask, dtype=torch.bool)
    if counted.shape != kl.shape:
        raise ValueError(f"mask must have the shape of kl {tuple(kl.shape)}, got {tuple(counted.shape)}")
    task = _task_rewards(task_reward, kl.shape[:-1]).to(kl.dtype)  # (...)
    bad = counted & ~torch.isfinite(kl)
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"kl is not finite on a counted position {where}: {float(kl[where])}")
    rewards = torch.where(counted, -coef * kl, torch.zeros_like(kl))  # (..., T)
    t = kl.shape[-1]
    positions = torch.arange(t).expand_as(counted)
    last = torch.where(counted, positions, torch.full_like(positions, -1)).amax(-1)  # (...)
    last = torch.where(last < 0, torch.full_like(last, t - 1), last)
    return rewards.scatter_add(-1, last.unsqueeze(-1), task.unsqueeze(-1))


def _task_rewards(task_reward: Any, batch_shape: torch.Size) -> torch.Tensor:
    """The task rewards as a ``batch_shape`` tensor, checked finite."""
    task = torch.as_tensor(task_reward, dtype=torch.float64)
    if task.dim() == len(batch_shape) + 1 and task.shape[-1] == 1:
        task = task.squeeze(-1)
    if task.dim() == 0:
        task = task.expand(batch_shape)
    if task.shape != batch_shape:
        raise ValueError(f"task_reward must be a number or of shape {tuple(batch_shape)}, got {tuple(task.shape)}")
    bad = (~torch.isfinite(task)).nonzero()
    if len(bad):
        where = tuple(int(i) for i in bad[0])
        row = f" at row {where[0] if len(where) == 1 else where}" if where else ""
        raise ValueError(f"task_reward must be finite, got {float(task[where])}{row}")
    return task
