"""What the distributed pieces share: the lazy Ray import, their errors, and the policy attributes rollout reads."""

from __future__ import annotations

import math
import pickle
from typing import Any

from chatenv.errors import DistributedError, InferenceUnavailable, MissingDependencyError
from chatenv.protocols import LAYOUT_FIELDS, OutputLayout

__all__ = [
    "POLICY_ATTRIBUTES",
    "DistributedError",
    "InferenceUnavailable",
    "PolicySpec",
    "check_count",
    "check_resource",
    "import_ray",
    "picklable",
    "unwrap",
]

#: what :func:`chatenv.rollout` reads of a policy (:class:`~chatenv.protocols.RolloutPolicy`): its checks and input
#: key, and its output layout (all that assembling the rows needs)
POLICY_ATTRIBUTES = ("generate", "num_samples", "input_key", *LAYOUT_FIELDS)


def import_ray(what: str = "distributed collection") -> Any:
    """The ``ray`` module.

    Raises:
        MissingDependencyError: If Ray is not installed (it names the extra).
    """
    try:
        import ray
    except ImportError as e:
        raise MissingDependencyError(f"{what} needs Ray: pip install 'chatenv-gym[ray]'") from e
    return ray


def unwrap(error: BaseException) -> BaseException:
    """The user's own exception inside Ray's task-error wrappers (the error itself when it wraps nothing)."""
    seen = 0
    while seen < 8 and type(error).__name__.startswith("RayTaskError"):
        cause = getattr(error, "cause", None)
        if not isinstance(cause, BaseException):
            break
        error, seen = cause, seen + 1
    return error


def picklable(error: BaseException) -> BaseException | None:
    """``error`` if it survives pickling (it crosses processes), else None."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # any pickling failure: the caller sends the text only
        return None
    return error


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    """An int >= ``minimum``.

    Raises:
        ValueError: For anything else (bools included).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_resource(name: str, value: Any, *, positive: bool = False) -> float:
    """A finite number >= 0 (> 0 with ``positive``).

    Raises:
        TypeError: For something that is not a number.
        ValueError: For a negative (or zero, with ``positive``) or non-finite number.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value}")
    return float(value)


class PolicySpec:
    """The attributes of a policy that rollout reads, without the policy (a stand-in in other processes).

    Args:
        attributes: ``{name: value}`` for every name in :data:`POLICY_ATTRIBUTES`.
    """

    def __init__(self, attributes: dict[str, Any]):
        missing = [name for name in POLICY_ATTRIBUTES if name not in attributes]
        if missing:
            raise ValueError(f"a policy spec needs {missing}")
        self.attributes = dict(attributes)
        for name, value in self.attributes.items():
            setattr(self, name, value)

    @classmethod
    def of(cls, policy: Any) -> PolicySpec:
        """The spec of a policy object.

        Raises:
            TypeError: If the policy lacks an attribute rollout needs.
        """
        missing = [name for name in POLICY_ATTRIBUTES if not hasattr(policy, name)]
        if missing:
            raise TypeError(
                f"the policy factory must return a generating policy (a chatenv.protocols.RolloutPolicy, e.g. "
                f"wrappers.policies.TransformersWrapper), got {type(policy).__name__} without {missing}"
            )
        return cls({name: getattr(policy, name) for name in POLICY_ATTRIBUTES})

    @property
    def layout(self) -> OutputLayout:
        """The policy's output layout (what the trainer's process assembles the workers' episodes with)."""
        return OutputLayout(**{name: self.attributes[name] for name in LAYOUT_FIELDS})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolicySpec) and self.attributes == other.attributes

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PolicySpec({self.attributes!r})"
