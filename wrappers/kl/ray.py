"""A reference model hosted in a Ray actor, shared by many envs and workers.

The actor builds its model from a *factory* (a picklable callable returning a :class:`~wrappers.kl.ReferenceModel`,
or a model path), so no model is ever pickled. :class:`RayRefModel` has the ``log_probs(sequences)`` method that
:class:`~wrappers.kl.RefLogProbs` and :class:`~wrappers.kl.KLPenalty` use, so it drops in for a local reference.

If the actor dies, calls raise :class:`RefModelUnavailable` (after ``max_restarts`` restarts by Ray, if set);
a call that takes longer than ``timeout`` seconds raises too. Nothing hangs and no zeros are returned.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

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


class _RefActor:
    def __init__(self, factory: Callable[[], Any]):
        torch.set_num_threads(max(1, torch.get_num_threads()))
        self.model = factory()
        if not hasattr(self.model, "log_probs"):
            from wrappers.kl.reference import ReferenceModel

            self.model = ReferenceModel(self.model)

    def log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        return [t.tolist() for t in self.model.log_probs(sequences)]

    def ping(self) -> bool:
        return True


class RayRefModel:
    """A reference model in a Ray actor.

    Args:
        factory: A picklable callable that returns a :class:`~wrappers.kl.ReferenceModel` (or a transformers model
            with its tokenizer loadable from its config), or a model path / ``"default"``.
        num_cpus: CPUs reserved for the actor.
        num_gpus: GPUs reserved for the actor.
        max_restarts: How many times Ray restarts a dead actor (0: none; then calls raise).
        timeout: Seconds to wait for one call.
        name: Optional actor name (a named actor can be looked up by other processes with ``ray.get_actor``).

    Ray must be initialised (``ray.init(...)``) before; the constructor waits until the model is loaded.
    """

    def __init__(
        self,
        factory: Callable[[], Any] | str,
        *,
        num_cpus: float = 1,
        num_gpus: float = 0,
        max_restarts: int = 0,
        timeout: float = 600.0,
        name: str | None = None,
    ):
        ray = _import_ray()
        if not ray.is_initialized():
            raise RefModelUnavailable("Ray is not initialised: call ray.init(...) before creating a RayRefModel")
        if isinstance(factory, str):
            factory = functools.partial(_from_path, factory)
        if not callable(factory):
            raise TypeError(f"factory must be a callable or a model path, got {type(factory).__name__}")
        options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "max_restarts": max_restarts}
        if max_restarts:
            options["max_task_retries"] = max_restarts
        if name is not None:
            options["name"] = name
        self.timeout = timeout
        self.actor: Any = ray.remote(_RefActor).options(**options).remote(factory)
        self._call("ping")

    def _call(self, name: str, *args: Any) -> Any:
        ray = _import_ray()
        if self.actor is None:
            raise RefModelUnavailable("this RayRefModel was closed; create a new one")
        try:
            return ray.get(getattr(self.actor, name).remote(*args), timeout=self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise RefModelUnavailable(f"the reference model did not answer within {self.timeout} s") from e
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise RefModelUnavailable(
                "the reference model's Ray actor died or is unreachable; create a new RayRefModel (or pass "
                "max_restarts=... to let Ray restart it)"
            ) from e

    def log_probs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, ``(T,)`` float32 log-probs from the actor (position 0 is NaN)."""
        if not sequences:
            return []
        rows = self._call("log_probs", [[int(x) for x in s] for s in sequences])
        return [torch.tensor(r, dtype=torch.float32) for r in rows]

    def close(self) -> None:
        """Stop the actor (idempotent)."""
        ray = _import_ray()
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None
