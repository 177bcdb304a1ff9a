"""KL coefficient controllers: constant, and adaptive (Ziegler et al., 2019).

Controllers take *observed KL values* (per-token or per-sequence KL estimates, not rewards already multiplied by
the coefficient) and return the coefficient as a plain float.

Example:
    >>> ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    >>> round(ctl.update([3.0] * 10), 8)  # KL below target: e = -0.2 over n_steps = 10
    0.09998
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from typing import Any

import numpy as np

from wrappers.kl.estimators import check_kl_coef

__all__ = ["AdaptiveKLController", "ConstantKLController", "KLController"]


def _values(kl: Any) -> list[float]:
    """Observed KL values as floats (a number, an iterable of numbers, or a tensor), checked finite, not none."""
    if hasattr(kl, "detach"):
        kl = kl.detach().reshape(-1).tolist()
    elif isinstance(kl, np.ndarray):
        kl = kl.reshape(-1).tolist()
    elif isinstance(kl, (int, float, np.integer, np.floating)):
        kl = [kl]
    elif isinstance(kl, (str, bytes)) or not isinstance(kl, Iterable):
        raise TypeError(f"expected KL values (a number, a list or a tensor), got {type(kl).__name__}")
    out = []
    for i, v in enumerate(kl):
        if isinstance(v, (str, bytes)):
            raise TypeError(f"KL values must be numbers, got {type(v).__name__} {v!r} at index {i}")
        try:
            v = float(v)
        except (TypeError, ValueError) as e:
            raise TypeError(f"KL values must be numbers, got {type(v).__name__} {v!r} at index {i}") from e
        out.append(v)
        if not math.isfinite(v):
            raise ValueError(
                f"KL values must be finite, got {v} (NaN or inf) at index {i}; mask undefined positions out "
                "before updating the controller"
            )
    if not out:
        raise ValueError(
            "expected at least one observed KL value, got none; skip the update when a batch has no tokens to "
            "measure (the mean KL of nothing is undefined)"
        )
    return out


def _n_steps(n_steps: Any, default: int) -> int:
    if n_steps is None:
        return default
    if isinstance(n_steps, bool):
        raise TypeError("n_steps must be an int, got bool")
    try:
        steps = operator.index(n_steps)
    except TypeError as e:
        raise TypeError(f"n_steps must be an int, got {type(n_steps).__name__}") from e
    if steps < 0:
        raise ValueError(f"n_steps must be >= 0, got {steps}")
    return steps


def _positive(value: Any, name: str) -> float:
    out = check_kl_coef(value, name)
    if out == 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return out


class KLController:
    """Base class: ``coef`` is the current coefficient; :meth:`update` observes KL values and returns it."""

    coef: float

    def update(self, kl_values: Any, n_steps: int | None = None) -> float:
        """Observe KL values (over ``n_steps`` steps) and return the (possibly new) coefficient."""
        raise NotImplementedError

    def __float__(self) -> float:
        return float(self.coef)


class ConstantKLController(KLController):
    """A fixed coefficient.

    Args:
        kl_coef: The coefficient (a finite number >= 0).

    Example:
        >>> ConstantKLController(0.05).update([1.0, 2.0])
        0.05
    """

    def __init__(self, kl_coef: float = 0.1):
        self.coef = check_kl_coef(kl_coef, "kl_coef")

    def update(self, kl_values: Any, n_steps: int | None = None) -> float:
        """Return the constant coefficient (the values and ``n_steps`` are checked like the adaptive one's).

        Raises:
            TypeError: For values that are not numbers, or an ``n_steps`` that is not an int.
            ValueError: For no values, a NaN or infinite value, or a negative ``n_steps``.
        """
        _n_steps(n_steps, len(_values(kl_values)))
        return self.coef

    def __repr__(self) -> str:
        return f"ConstantKLController(kl_coef={self.coef})"


class AdaptiveKLController(KLController):
    """Adaptive coefficient that steers the observed KL towards a target (Ziegler et al., 2019).

    With ``e = clip(KL / target - 1, -0.2, 0.2)`` for the mean observed KL, each update does
    ``coef <- coef * (1 + e * n_steps / horizon)``. The factor is clipped at 0, so the coefficient never becomes
    negative (that only matters when ``n_steps > 5 * horizon``; keep ``horizon`` well above a batch).

    Args:
        init_kl_coef: Starting coefficient (finite, > 0).
        target: Target KL (finite, > 0).
        horizon: Steps over which the error is corrected (finite, > 0).

    Example:
        >>> ctl = AdaptiveKLController(init_kl_coef=1.0, target=6.0, horizon=10)
        >>> round(ctl.update(6.6), 6)  # e = 6.6 / 6 - 1 = 0.1, one step
        1.01
    """

    def __init__(self, init_kl_coef: float = 0.1, target: float = 6.0, horizon: float = 10000):
        self.coef = _positive(init_kl_coef, "init_kl_coef")
        self.target = _positive(target, "target")
        self.horizon = _positive(horizon, "horizon")

    def update(self, kl_values: Any, n_steps: int | None = None) -> float:
        """Observe KL values (their mean is the KL of this update) and adapt the coefficient.

        Args:
            kl_values: Observed KL values (a number, a list or a tensor; finite).
            n_steps: Steps these values cover (an int >= 0; default: how many values there are).

        Returns:
            The new coefficient.

        Raises:
            TypeError: For values that are not numbers, or an ``n_steps`` that is not an int.
            ValueError: For no values, a NaN or infinite value, or a negative ``n_steps``. A refused update leaves
                the coefficient as it was.
        """
        values = _values(kl_values)
        steps = _n_steps(n_steps, len(values))
        kl = sum(values) / len(values)
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.coef = self.coef * max(1.0 + error * steps / self.horizon, 0.0)
        return self.coef

    def __repr__(self) -> str:
        return f"AdaptiveKLController(coef={self.coef}, target={self.target}, horizon={self.horizon})"
