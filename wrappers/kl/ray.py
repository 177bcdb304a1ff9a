"""A reference model hosted in a Ray actor, shared by many envs and workers.

The actor builds its model from a *factory* (a picklable callable returning a :class:`~wrappers.kl.ReferenceModel`,
or a model path), so no model is ever pickled. :class:`RayRefModel` has the ``log_probs(sequences)`` method that
:class:`~wrappers.kl.RefLogProbs` and :class:`~wrappers.kl.KLPenalty` use, so it drops in for a local reference.

If the actor dies, calls raise :class:`RefModelUnavailable` (after ``max_restarts`` restarts by Ray, if set);
a call that takes longer than ``timeout`` seconds raises too. Nothing hangs and no zeros are returned.
"""

from __future__ import annotations

import functools
import math
import pickle
from collections.abc import Callable
from typing import Any

import torch

from chatenv.cpus import set_torch_threads
from chatenv.errors import ChatEnvError

__all__ = ["RayRefModel", "RefModelUnavailable"]


class RefModelUnavailable(ChatEnvError, RuntimeError):
    """The Ray-hosted reference model cannot answer (actor dead, cluster gone, or too slow)."""


def _import_ray():
    try:
        import ray
    except ImportError as e:
        from chatenv.errors import MissingDependencyError

        raise MissingDependencyError("RayRefModel needs Ray: pip install 'chatenv-gym[ray]'") from e
    return ray


def _from_path(path: str, batch_size: int | None = None) -> Any:
    from wrappers.kl.reference import ReferenceModel

    return ReferenceModel(path, batch_size=batch_size)


def _picklable(error: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # any pickling failure: send the text only
        return None
    return error


def _build(factory: Callable[[], Any]) -> Any:
    """The factory's reference scorer (a transformers model gets wrapped in a ReferenceModel)."""
    model = factory()
    if callable(getattr(model, "log_probs", None)):
        return model
    if isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        from wrappers.kl.reference import ReferenceModel

        return ReferenceModel(model)
    raise _BadFactoryResult(
        f"the RayRefModel factory must return a ReferenceModel (anything with a log_probs(sequences) method) or a "
        f"transformers model, got {type(model).__name__} {model!r:.80}"
    )


class _BadFactoryResult(TypeError):
    """The factory returned something that cannot score."""


class _RefActor:
    """Holds the model; a factory that fails is reported by :meth:`ready` instead of killing the actor."""

    def __init__(self, factory: Callable[[], Any]):
        set_torch_threads()  # torch's choice, at most the cores the actor's process may use
        self.model: Any = None
        self.failure: tuple[str, str, BaseException | None] | None = None
        try:
            self.model = _build(factory)
        except Exception as e:  # reported to the caller by ready(), with its type and message
            self.failure = (type(e).__name__, str(e), _picklable(e))

    def log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        return [torch.as_tensor(t).tolist() for t in self.model.log_probs(sequences)]

    def ready(self) -> tuple[str, str, BaseException | None] | None:
        return self.failure


def _check_options(num_cpus: Any, num_gpus: Any, max_restarts: Any, timeout: Any, start_timeout: Any) -> None:
    numbers = (("num_cpus", num_cpus), ("num_gpus", num_gpus), ("timeout", timeout), ("start_timeout", start_timeout))
    for name, value in numbers:
        positive = name.endswith("timeout")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < -1:
        raise ValueError(f"max_restarts must be an int >= 0 (or -1: without limit), got {max_restarts!r}")


def _raise_factory_failure(factory: Any, type_name: str, message: str, error: BaseException | None) -> None:
    if isinstance(error, _BadFactoryResult):
        raise TypeError(message)
    name = getattr(factory, "__qualname__", None) or type(factory).__name__
    raise RefModelUnavailable(
        f"the reference model's factory {name} raised {type_name}: {message} (in the Ray actor, which was stopped; "
        "fix the factory and create a new RayRefModel)"
    ) from error


class RayRefModel:
    """A reference model in a Ray actor.

    Args:
        factory: A picklable callable that returns a :class:`~wrappers.kl.ReferenceModel` (or a transformers model
            with its tokenizer loadable from its config), or a model path / ``"default"``.
        num_cpus: CPUs reserved for the actor.
        num_gpus: GPUs reserved for the actor.
        max_restarts: How many times Ray restarts a dead actor (0: none; then calls raise).
        timeout: Seconds to wait for one call.
        start_timeout: Seconds to wait for the actor to start and load the model (default: 600).
        name: Optional actor name (a named actor can be looked up by other processes with ``ray.get_actor``).

    Ray must be initialised (``ray.init(...)``) before; the constructor waits until the model is loaded.

    Raises:
        TypeError: For a factory that is not callable, or one that returns something without ``log_probs`` that is
            not a transformers model; for options that are not numbers.
        ValueError: For negative resources, a timeout that is not a finite number > 0, or a bad ``max_restarts``.
        RefModelUnavailable: If Ray is not initialised, the actor does not load within ``start_timeout``, or the
            factory raises
            (the message holds the factory's own exception type and message; the exception is chained when it
            pickles). A failed constructor leaves no actor behind.
    """

    def __init__(
        self,
        factory: Callable[[], Any] | str,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        max_restarts: int = 0,
        timeout: float = 600.0,
        start_timeout: float = 600.0,
        name: str | None = None,
    ):
        if isinstance(factory, str):
            factory = functools.partial(_from_path, factory)
        if not callable(factory):
            raise TypeError(f"factory must be a callable or a model path, got {type(factory).__name__}")
        _check_options(num_cpus, num_gpus, max_restarts, timeout, start_timeout)
        ray = _import_ray()
        if not ray.is_initialized():
            raise RefModelUnavailable("Ray is not initialised: call ray.init(...) before creating a RayRefModel")
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts}
        if max_restarts:
            options["max_task_retries"] = max_restarts
        if name is not None:
            options["name"] = name
        self.timeout = float(timeout)
        self.actor: Any = ray.remote(_RefActor).options(**options).remote(factory)
        try:
            failure = self._call("ready", timeout=float(start_timeout))
        except BaseException:
            self.close()
            raise
        if failure is not None:
            self.close()
            _raise_factory_failure(factory, *failure)

    def _call(self, name: str, *args: Any, timeout: float | None = None) -> Any:
        """Call the actor's method ``name``; ``timeout`` (default: :attr:`timeout`) bounds the wait."""
        ray = _import_ray()
        if self.actor is None:
            raise RefModelUnavailable("this RayRefModel was closed; create a new one")
        starting = timeout is not None
        timeout = self.timeout if timeout is None else timeout
        try:
            return ray.get(getattr(self.actor, name).remote(*args), timeout=timeout)
        except ray.exceptions.RayTaskError as e:
            # the remote model refused the call (e.g. an id outside its vocabulary): its own error, not Ray's wrapper
            cause = getattr(e, "cause", None)
            if isinstance(cause, Exception):
                raise cause from e
            raise
        except ray.exceptions.GetTimeoutError as e:
            if starting:
                raise RefModelUnavailable(
                    f"the reference model's actor did not start and load the model within {timeout:g} s "
                    "(start_timeout); give a larger start_timeout for a model that loads slowly"
                ) from e
            raise RefModelUnavailable(
                f"the reference model did not answer within {timeout:g} s (timeout, per call)"
            ) from e
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise RefModelUnavailable(
                "the reference model's Ray actor died or is unreachable; create a new RayRefModel (or pass "
                "max_restarts=... to let Ray restart it)"
            ) from e

    def log_probs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, ``(T,)`` float32 log-probs from the actor (position 0 is NaN).

        Raises:
            TypeError: For non-integer ids or sequences that are not 1-D (checked here, before any remote call).
            ValueError: For an empty sequence; errors of the remote model (e.g. ids outside its vocabulary) are
                raised here with their own type and message.
            RefModelUnavailable: If the actor is dead, closed or too slow.
        """
        from wrappers.kl.reference import check_scored, check_sequences

        seqs = check_sequences(sequences)
        if not seqs:
            return []
        return check_scored(self._call("log_probs", seqs), seqs, "the Ray reference model")

    def close(self) -> None:
        """Stop the actor (idempotent)."""
        ray = _import_ray()
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None
