"""KL coefficient controllers: constant, and adaptive (Ziegler et al., 2019).

Controllers take *observed KL values* (per-token or per-sequence KL estimates, not rewards already multiplied
by the coefficient) and return the coefficient as a plain float.

Example:
    >>> ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=100)
    >>> for _ in range(10):
    ...     coef = ctl.update([3.0])
    >>> round(coef, 3)
    0.098
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["AdaptiveKLController", "ConstantKLController", "KLController"]


def _values(kl: Any) -> list[float]:
    """Observed KL values as floats (a number, an iterable of numbers, or a tensor)."""
    if hasattr(kl, "detach"):
        kl = kl.detach().reshape(-1).tolist()
    elif isinstance(kl, (int, float)):
        kl = [kl]
    elif isinstance(kl, (str, bytes)) or not isinstance(kl, Iterable):
        raise TypeError(f"expected KL values (a number, a list or a tensor), got {type(kl).__name__}")
    out = [float(v) for v in kl]
    if any(math.isnan(v) for v in out):
        raise ValueError("KL values contain NaN; mask undefined positions out before updating the controller")
    return out


class KLController:
    """Base class: ``coef`` is the current coefficient; :meth:`update` observes KL values and returns it."""

    coef: float

    def update(self, kl_values: Any, n_steps: int | None = None) -> float:
        """Observe KL values and return the (possibly new) coefficient."""
        raise NotImplementedError

    def __float__(self) -> float:
        return float(self.coef)


class ConstantKLController(KLController):
    """A fixed coefficient.

    Args:
        kl_coef: The coefficient (>= 0).
    """

    def __init__(self, kl_coef: float = 0.1):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.coef = float(kl_coef)

    def update(self, kl_values: Any = (), n_steps: int | None = None) -> float:
        """Return the constant coefficient (the values are checked but do not change it)."""
        _values(kl_values)
        return self.coef

    def __repr__(self) -> str:
        return f"ConstantKLController(kl_coef={self.coef})"


class AdaptiveKLController(KLController):
    """Adaptive coefficient that steers the observed KL towards a target (Ziegler et al., 2019).

    With ``e = clip(KL / target - 1, -0.2, 0.2)`` for the mean observed KL, each update does
    ``coef <- coef * (1 + e * n_steps / horizon)``.

    Args:
        init_kl_coef: Starting coefficient (> 0).
        target: Target KL (> 0).
        horizon: Steps over which the error is corrected (> 0).
    """

    def __init__(self, init_kl_coef: float = 0.1, target: float = 6.0, horizon: int = 10000):
        if init_kl_coef <= 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"init_kl_coef, target and horizon must be > 0, got {init_kl_coef}, {target}, {horizon}")
        self.coef = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, kl_values: Any, n_steps: int | None = None) -> float:
        """Observe KL values (their mean is the KL of this update) over ``n_steps`` (default: 1)."""
        values = _values(kl_values)
        if not values:
            return self.coef
        kl = sum(values) / len(values)
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        steps = 1 if n_steps is None else n_steps
        self.coef = self.coef * (1.0 + error * steps / self.horizon)
        return self.coef

    def __repr__(self) -> str:
        return f"AdaptiveKLController(coef={self.coef}, target={self.target}, horizon={self.horizon})"
