"""Off-policy correction: importance weights between the engine that sampled a reply and the trainer's weights.

Replies reach a trainer sampled by an older version of its weights (async rollouts, Ray collection, the capture
endpoint) and by an engine whose numerics differ from the trainer's (vLLM or cached batched generation vs a scoring
forward). Before its update the trainer scores the sampled tokens again under its current weights (no grad: the
proximal log-probs ``old``) and compares them with the log-probs the engine recorded (``rollout``):

- the PG ratio for clipping is ``pi_theta / pi_old`` (against the trainer's own numbers), and
- each token's loss is multiplied by an importance weight ``w`` (no gradient) estimating ``pi_old / pi_rollout``.

:class:`OffPolicyConfig` chooses how ``w`` is made (:func:`correct` computes it for one episode):

- ``level="token"``: ``w_t = exp(old_t - rollout_t)`` per token.
- ``level="sequence"``: one weight per *segment*, the geometric mean of its tokens' ratios,
  ``exp(mean(old_t - rollout_t))``, length-normalised in log space (``exp(sum)`` over a 60-turn episode multiplies
  hundreds of near-1 ratios and swings the whole batch's scale). A segment is a run of consecutive turns sampled by
  one policy version: an episode from one version is one segment; one whose turns came from several versions gets
  one weight per version's turns (:func:`segments`).
- ``level="none"``: ``w = 1`` and the clipping ratio is taken against the rollout's log-probs (no correction).
- ``mode="truncate"`` (TIS): ``w = min(w, cap)``; ``mode="mask"``: tokens (or whole segments) whose ratio lies
  outside ``[low, cap]`` are dropped from the loss.
- ``max_staleness``: tokens sampled more than this many versions behind the trainer's current version are dropped
  (never trained on), whatever the level; tokens of a policy that reported no version (-1) count as stale then.

Dropped tokens leave the per-episode mean of the loss (they are not trained on), and :class:`OffPolicyStats`
counts them. Its metrics: ``mismatch_kl`` (mean per-token k3 estimate of ``KL(rollout || trainer)`` on the sampled
tokens: ``r - 1 - log r`` with ``r = pi_old / pi_rollout``, >= 0, unbiased for samples drawn by the rollout),
``mismatch_k1`` (mean ``rollout - old``), ``is_ratio_mean`` / ``is_ratio_max`` / ``is_ratio_min`` (raw token
ratios), ``is_weight_mean`` (weights applied, over trained tokens), ``is_truncated_frac``, ``is_masked_frac``,
``stale_frac`` (fractions of the sampled tokens), ``version_lag_max`` / ``version_lag_mean`` (versions behind).

Example:
    >>> import torch
    >>> c = correct(torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0]), OffPolicyConfig(cap=2.0))
    >>> [round(v, 3) for v in c.weight.tolist()], c.keep.tolist()
    ([1.0, 2.0], [True, True])
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch

__all__ = [
    "LEVELS",
    "MODES",
    "Correction",
    "OffPolicyConfig",
    "OffPolicyStats",
    "add_arguments",
    "correct",
    "segments",
    "token_versions",
]

#: where importance weights are computed: per token, per segment (a run of turns from one version), or not at all
LEVELS = ("token", "sequence", "none")
#: what happens to ratios out of range: capped (``truncate``) or dropped from the loss (``mask``)
MODES = ("truncate", "mask")


@dataclass(frozen=True)
class OffPolicyConfig:
    """How a trainer corrects for replies sampled by other weights or another engine (see the module).

    The default, token-level truncation at 2, keeps every token (a sampled token is never thrown away for engine
    noise) while bounding any one token's weight, so a token the trainer finds far likelier than the engine did
    cannot dominate the step; a token-level weight cannot be swung by the episode's length, which matters on
    episodes of tens of turns.

    Attributes:
        level: ``"token"`` (default), ``"sequence"`` or ``"none"``.
        mode: ``"truncate"`` (default; ``w = min(ratio, cap)``) or ``"mask"`` (drop ratios outside ``[low, cap]``).
        cap: Upper bound of the weight (truncate) or of the kept ratios (mask); > 1.
        low: Lower bound of the kept ratios with ``mode="mask"`` (default ``1 / cap``); in ``(0, 1)``.
        max_staleness: Drop tokens sampled more than this many versions behind the trainer (None: keep all).
    """

    level: str = "token"
    mode: str = "truncate"
    cap: float = 2.0
    low: float | None = None
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"importance-sampling level must be one of {LEVELS}, got {self.level!r}")
        if self.mode not in MODES:
            raise ValueError(f"importance-sampling mode must be one of {MODES}, got {self.mode!r}")
        if not _number(self.cap) or not self.cap > 1:
            raise ValueError(f"importance-sampling cap must be a finite number > 1, got {self.cap!r}")
        if self.low is not None and (not _number(self.low) or not 0 < self.low < 1):
            raise ValueError(f"importance-sampling low must be a number in (0, 1) or None, got {self.low!r}")
        staleness = self.max_staleness
        if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got {staleness!r}")

    @property
    def lower(self) -> float:
        """The lower bound of the kept ratios with ``mode="mask"``."""
        return self.low if self.low is not None else 1.0 / self.cap


def _number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def token_versions(length: int, starts: torch.Tensor, lengths: torch.Tensor, versions: torch.Tensor) -> torch.Tensor:
    """Per completion token, the version of the policy that sampled it (``-2`` off the replies).

    Args:
        length: The completion's length.
        starts: Per turn, where its reply starts in the completion.
        lengths: Per turn, its reply's length.
        versions: Per turn, the version that sampled the reply (-1: not reported).
    """
    out = torch.full((length,), -2, dtype=torch.long)
    for start, n, version in zip(starts.tolist(), lengths.tolist(), versions.tolist()):
        out[start : start + n] = int(version)
    return out


def segments(versions: torch.Tensor) -> torch.Tensor:
    """Segment ids of the sampled tokens: a new segment wherever the version changes (``(T,)`` in, ``(T,)`` out)."""
    if versions.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    change = torch.ones_like(versions, dtype=torch.long)
    change[1:] = (versions[1:] != versions[:-1]).long()
    return torch.cumsum(change, 0) - 1


@dataclass
class Correction:
    """The correction of one episode's sampled tokens (all ``(T,)``).

    Attributes:
        weight: The importance weight of each token (0 where dropped; no gradient).
        keep: Tokens trained on.
        ratio: Raw token ratio ``pi_old / pi_rollout``.
        truncated: Tokens whose weight was capped.
        masked: Tokens dropped for a ratio out of range.
        stale: Tokens dropped for their version's lag.
        lag: Versions behind the trainer (-1 where unknown).
    """

    weight: torch.Tensor
    keep: torch.Tensor
    ratio: torch.Tensor
    truncated: torch.Tensor
    masked: torch.Tensor
    stale: torch.Tensor
    lag: torch.Tensor


def _stale(
    versions: torch.Tensor | None, current: int | None, max_staleness: int | None, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: versions behind (-1 unknown) and whether it is too stale to train on."""
    if versions is None or current is None:
        return torch.full((n,), -1, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
    known = versions >= 0
    lag = torch.where(known, int(current) - versions, torch.full_like(versions, -1))
    if max_staleness is None:
        return lag, torch.zeros(n, dtype=torch.bool)
    return lag, ~known | (lag > max_staleness)


def correct(
    rollout: torch.Tensor,
    old: torch.Tensor,
    config: OffPolicyConfig,
    *,
    versions: torch.Tensor | None = None,
    current: int | None = None,
) -> Correction:
    """The importance weights of one episode's sampled tokens.

    Args:
        rollout: ``(T,)`` log-probs the engine recorded when sampling.
        old: ``(T,)`` log-probs of the same tokens under the trainer's current weights (no grad).
        config: How to weigh (:class:`OffPolicyConfig`).
        versions: ``(T,)`` per token, the policy version that sampled it (-1 unknown); also delimits the segments
            of ``level="sequence"``. None: one segment, no staleness.
        current: The trainer's version now (None: no staleness).

    Raises:
        ValueError: If the shapes differ or a log-prob is not finite.
    """
    if rollout.shape != old.shape or rollout.dim() != 1 or (versions is not None and versions.shape != old.shape):
        raise ValueError(f"expected (T,) log-probs and versions of one shape, got {rollout.shape} and {old.shape}")
    log_ratio = old.detach().double() - rollout.detach().double()
    if not torch.isfinite(log_ratio).all():
        raise ValueError("importance weights need finite log-probs on every sampled token (rollout and trainer)")
    n = len(log_ratio)
    ratio = torch.exp(log_ratio)
    lag, stale = _stale(versions, current, config.max_staleness, n)
    none = torch.zeros(n, dtype=torch.bool)
    if config.level == "none":
        keep = ~stale
        return Correction(keep.double(), keep, ratio, none, none, stale, lag)
    if config.level == "sequence":
        ids = segments(versions) if versions is not None else torch.zeros(n, dtype=torch.long)
        ones = torch.ones(n, dtype=torch.float64)
        count = torch.zeros(int(ids.max()) + 1 if n else 0, dtype=torch.float64).index_add_(0, ids, ones)
        total = torch.zeros_like(count).index_add_(0, ids, log_ratio)
        raw = torch.exp(total / count.clamp(min=1))[ids]  # the geometric mean of the segment's ratios, per token
    else:
        raw = ratio
    if config.mode == "truncate":
        truncated = (raw > config.cap) & ~stale
        masked = none
        weight = raw.clamp(max=config.cap)
    else:
        truncated = none
        masked = ((raw < config.lower) | (raw > config.cap)) & ~stale
        weight = raw
    keep = ~(stale | masked)
    return Correction(torch.where(keep, weight, 0.0), keep, ratio, truncated, masked, stale, lag)


@dataclass
class OffPolicyStats:
    """Sums of the corrections of one step's episodes; :meth:`metrics` gives the step's numbers (see the module)."""

    tokens: int = 0
    trained: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    ratio_max: float = -math.inf
    ratio_min: float = math.inf
    lag_max: int = -1
    lags: list[int] = field(default_factory=list)

    def add(self, c: Correction) -> None:
        """Count one episode's correction."""
        if not len(c.ratio):
            return
        log_ratio = torch.log(c.ratio)
        parts = {
            "k3": float((c.ratio - 1 - log_ratio).sum()),
            "k1": float((-log_ratio).sum()),
            "ratio": float(c.ratio.sum()),
            "weight": float(c.weight[c.keep].sum()),
            "truncated": float(c.truncated.sum()),
            "masked": float(c.masked.sum()),
            "stale": float(c.stale.sum()),
        }
        for key, value in parts.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.tokens += len(c.ratio)
        self.trained += int(c.keep.sum())
        self.ratio_max = max(self.ratio_max, float(c.ratio.max()))
        self.ratio_min = min(self.ratio_min, float(c.ratio.min()))
        known = c.lag[c.lag >= 0]
        if known.numel():
            self.lag_max = max(self.lag_max, int(known.max()))
            self.lags.extend(known.tolist())

    def metrics(self) -> dict[str, float]:
        """The step's mismatch and correction numbers (NaN where nothing was measured)."""
        n, s = self.tokens, self.sums
        nan = math.nan

        def mean(key: str, over: int) -> float:
            return s.get(key, 0.0) / over if over else nan

        return {
            "mismatch_kl": mean("k3", n),
            "mismatch_k1": mean("k1", n),
            "is_ratio_mean": mean("ratio", n),
            "is_ratio_max": self.ratio_max if n else nan,
            "is_ratio_min": self.ratio_min if n else nan,
            "is_weight_mean": mean("weight", self.trained),
            "is_truncated_frac": mean("truncated", n),
            "is_masked_frac": mean("masked", n),
            "stale_frac": mean("stale", n),
            "version_lag_max": float(self.lag_max) if self.lags else nan,
            "version_lag_mean": sum(self.lags) / len(self.lags) if self.lags else nan,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the correction's command-line flags (named as :class:`wrappers.grpo.GRPOConfig`'s fields).

    ``--is-level``, ``--is-mode``, ``--is-cap`` and ``--max-staleness``; a cap <= 1 or a negative staleness is
    refused by argparse.
    """
    parser.add_argument(
        "--is-level",
        choices=LEVELS,
        default="token",
        help="importance weights between the rollout's and the trainer's log-probs: per token (default), per "
        "segment of turns from one policy version (geometric mean), or none",
    )
    parser.add_argument(
        "--is-mode",
        choices=MODES,
        default="truncate",
        help="truncate: weight min(ratio, --is-cap) (default); mask: drop ratios outside [1/--is-cap, --is-cap]",
    )
    parser.add_argument("--is-cap", type=_cap, default=2.0, help="bound of the importance weights, > 1 (default 2)")
    parser.add_argument(
        "--max-staleness",
        type=_staleness,
        default=None,
        help="drop tokens sampled more than this many policy versions behind the trainer (default: no limit)",
    )


def _cap(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 1):
        raise argparse.ArgumentTypeError(f"expected a finite number > 1, got {text!r}")
    return value


def _staleness(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number of versions >= 0, got {text!r}")
    return int(text)
