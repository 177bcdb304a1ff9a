"""Starting a collector's actors: waiting for them with clear errors, checking what they report, stopping them."""

from __future__ import annotations

from typing import Any, NoReturn

from chatenv.distributed.common import DistributedError, PolicySpec, import_ray

__all__ = ["Actors", "Failure", "check_env_workers", "check_policies", "raise_start_failure"]

#: how an actor reports a failed start: the error's type name, its message, and the error itself if it pickled
Failure = tuple[str, str, BaseException | None]


def raise_start_failure(what: str, failure: Failure) -> NoReturn:
    """Raise an actor's start failure (reported as ``(type name, message, the error if it pickled)``)."""
    type_name, message, error = failure
    raise DistributedError(f"{what} raised {type_name}: {message} (in its Ray actor, which was stopped)") from error


class Actors:
    """The actors of one collector and how to start them (waiting, with clear errors)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.all: list[Any] = []

    def wait(self, refs: list[Any], what: str) -> list[Any]:
        """What ``refs`` (the actors' ``ready``/``info`` calls) return, within the startup timeout.

        Raises:
            DistributedError: If they take longer, or an actor dies while starting.
        """
        ray = import_ray()
        try:
            values: list[Any] = ray.get(refs, timeout=self.timeout)
            return values
        except ray.exceptions.GetTimeoutError as e:
            raise DistributedError(
                f"the {what} did not start within startup_timeout={self.timeout} s; the cluster has "
                f"{ray.cluster_resources()}: lower worker_cpus/inference_cpus/inference_gpus or give Ray more"
            ) from e
        except ray.exceptions.RayActorError as e:
            raise DistributedError(f"an actor of the {what} died while starting: {e}") from e

    def kill(self) -> None:
        """Stop every actor (those already gone are skipped)."""
        ray = import_ray()
        for actor in self.all:
            try:
                ray.kill(actor)
            except Exception:  # already gone, or the cluster is: nothing left to stop
                continue
        self.all = []


def check_policies(ready: list[tuple[Failure | None, PolicySpec | None]]) -> PolicySpec:
    """The policy spec every inference actor reported (their ``ready()``).

    Raises:
        DistributedError: If a policy factory failed, or the actors' policies differ.
    """
    for i, (failure, _) in enumerate(ready):
        if failure is not None:
            raise_start_failure(f"the policy factory of inference actor {i}", failure)
    spec = ready[0][1]
    assert spec is not None  # a start without a failure has a spec
    for i, (_, other) in enumerate(ready[1:], 1):
        if other != spec:
            raise DistributedError(f"inference actor {i}'s policy differs from actor 0's: {other} vs {spec}")
    return spec


def check_env_workers(infos: list[dict[str, Any]], input_mode: str) -> dict[int, int]:
    """Per env worker (their ``info()``), the env index of its first env (env indices are unique across workers).

    Raises:
        DistributedError: If an env factory failed, or a worker's envs use another input mode than the policy.
    """
    for w, info in enumerate(infos):
        if info["failure"] is not None:
            raise_start_failure(f"an env factory of env worker {w}", info["failure"])
        if info["input_mode"] != input_mode:
            raise DistributedError(
                f"env worker {w}'s envs use input_mode={info['input_mode']!r} but the policy {input_mode!r}; make "
                "them match"
            )
    sizes = [info["size"] for info in infos]
    return {w: sum(sizes[:w]) for w in range(len(sizes))}
