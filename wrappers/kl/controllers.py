"""KL coefficient controllers: constant, and adaptive (Ziegler et al., 2019).

Controllers take *observed KL values* (per-token or per-sequence KL estimates, not rewards already multiplied by
the coefficient) and return the coefficient as a plain float.

This module is also the one home of the controller arguments the rest of :mod:`wrappers.kl` takes:
:func:`kl_controller` (``kl=``: a number or a controller; the old spellings refused by :func:`refuse_renamed`),
:func:`as_controller` (a number or a controller),
:func:`current_coef` (the coefficient, checked) and :func:`use_and_update` (the coefficient a step uses and the
update it makes, as one atomic section: a controller shared by envs stepped on threads is updated once per env
step, exactly as if the steps ran one after another).

Example:
    >>> ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    >>> round(ctl.update([3.0] * 10), 8)  # KL below target: e = -0.2 over n_steps = 10
    0.09998
"""

from __future__ import annotations

import math
import operator
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from wrappers.kl.estimators import check_kl_coef

__all__ = [
    "RENAMED",
    "AdaptiveKLController",
    "ConstantKLController",
    "KLController",
    "as_controller",
    "check_controller",
    "current_coef",
    "kl_controller",
    "refuse_renamed",
    "use_and_update",
]

# Serialises every read-coefficient-then-update section (microseconds each; env steps run outside it), so
# controllers shared by envs on threads see their updates one at a time, in a well-defined order.
_UPDATE_LOCK = threading.Lock()


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
    """``value`` as a float if it is a finite number > 0 (the bound stated is the one that holds)."""
    try:
        out = check_kl_coef(value, name)
    except ValueError:
        out = None
    if out is None or out == 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
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


def current_coef(controller: Any) -> float:
    """The controller's coefficient now, checked (a finite number >= 0).

    Raises:
        TypeError: If it is not a number.
        ValueError: If it is NaN, infinite or negative (the message names the controller's class).
    """
    return check_kl_coef(controller.coef, f"{type(controller).__name__}.coef")


def check_controller(controller: Any, name: str = "controller", hint: str = "") -> Any:
    """``controller`` if it is a KL controller (``coef`` and ``update(kl_values)``) with a valid coefficient.

    Args:
        controller: The value given.
        name: The argument it was given as, for the error message.
        hint: Appended to the error message (e.g. how to give a constant instead).

    Raises:
        TypeError: For anything without ``coef`` and a callable ``update``, or a coefficient that is not a number.
        ValueError: For a NaN, infinite or negative coefficient.
    """
    if not (hasattr(controller, "coef") and callable(getattr(controller, "update", None))):
        raise TypeError(
            f"{name} must be a KL controller (with .coef and .update(kl_values)), got "
            f"{type(controller).__name__} {controller!r:.80}{hint}"
        )
    current_coef(controller)
    return controller


def as_controller(value: Any, name: str = "kl") -> Any:
    """A KL coefficient given as a number or as a controller, as a controller.

    Raises:
        TypeError: For a value that is neither a number nor a controller.
        ValueError: For a NaN, infinite or negative coefficient.

    Example:
        >>> as_controller(0.05)
        ConstantKLController(kl_coef=0.05)
    """
    if hasattr(value, "coef") or hasattr(value, "update"):
        return check_controller(value, name)
    return ConstantKLController(check_kl_coef(value, name))


#: the KL spellings that were renamed: old keyword -> what to write now
RENAMED = {
    "coef": "kl=",
    "controller": "kl=",
    "kl_coef": "kl=",
    "kl_controller": "kl=",
    "kl_estimator": "estimator=",
}


def kl_controller(kl: Any, owner: str, renamed: dict[str, Any] | None = None) -> Any:
    """The controller of ``kl=`` (a number or a KL controller), refusing the old spellings.

    Args:
        kl: A constant coefficient (finite, >= 0) or a controller (``coef`` and ``update``).
        owner: Who takes it (e.g. ``"KLPenalty"``), for the messages.
        renamed: Keyword arguments the caller did not know: an old spelling gets a message naming the new one.

    Raises:
        TypeError: For an old or unknown keyword, a coefficient that is not a number, or a controller without
            ``coef`` and ``update``.
        ValueError: For a NaN, infinite or negative coefficient, or ``kl=None``.

    Example:
        >>> kl_controller(0.05, "KLPenalty")
        ConstantKLController(kl_coef=0.05)
    """
    refuse_renamed(owner, renamed or {})
    if kl is None:
        raise ValueError(
            f"{owner} needs kl=...: a constant coefficient (e.g. kl=0.1) or a controller "
            "(e.g. kl=AdaptiveKLController(0.1, target=6.0, horizon=10000))"
        )
    return as_controller(kl, "kl")


def refuse_renamed(owner: str, given: dict[str, Any]) -> None:
    """Raise for keywords ``owner`` does not take: an old KL spelling names its new one.

    Raises:
        TypeError: For any keyword in ``given``.
    """
    for name in given:
        if name in RENAMED:
            raise TypeError(
                f"{owner} takes {RENAMED[name]}... now, not {name}= (one KL vocabulary everywhere: kl= a number or "
                "a KL controller, estimator= 'k1' | 'k2' | 'k3')"
            )
        raise TypeError(f"{owner} got an unexpected keyword argument {name!r}")


def use_and_update(controller: Any, kl_values: Any, n_steps: int | None = None) -> float:
    """Read the coefficient a step uses and feed the step's KL to the controller, as one atomic section.

    Env wrappers call this once per step, after the step succeeded. Envs that share a controller and step on
    threads then get exactly the coefficients of stepping them one after another (in the order their steps
    finish): no two steps read the same coefficient and no update is lost.

    Args:
        controller: A KL controller.
        kl_values: The KL observed in the step (see :meth:`KLController.update`).
        n_steps: Steps the values cover (default: how many values there are).

    Returns:
        The coefficient in force before this update (the one the step's reward uses).

    Raises:
        TypeError, ValueError: For a bad coefficient or bad KL values (nothing is updated then).
    """
    with _UPDATE_LOCK:
        coef = current_coef(controller)
        if n_steps is None:
            controller.update(kl_values)
        else:
            controller.update(kl_values, n_steps=n_steps)
    return coef
