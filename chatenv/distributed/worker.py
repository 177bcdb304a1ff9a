"""The env worker: a Ray actor holding several envs and running :func:`chatenv.rollout` on them.

Its policy is a :class:`PolicyProxy`: every round's policy input tensordict goes to the router (and from there to
the least loaded inference actor); the answer comes back as the policy's output. Each episode that finishes is
handed back at once: :meth:`EnvWorker.run` is a streaming generator, and Ray keeps what it yielded even if the
worker dies afterwards, so a dead worker loses only the episodes it had in progress.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from chatenv.distributed.common import DistributedError, InferenceUnavailable, PolicySpec, import_ray, picklable, unwrap
from chatenv.distributed.episodes import episode_transitions
from chatenv.protocols import RolloutPolicy
from chatenv.rollout.collect import Transition
from chatenv.rollout.plan import EpisodePlan

__all__ = ["EnvWorker", "Job", "PolicyProxy"]


class _Stopped(Exception):
    """The collector asked the worker to stop (its consumer went away, or another worker failed)."""


@dataclass
class Job:
    """What one worker runs: its share of the collection's episodes, and the time a round of env steps may take."""

    plan: EpisodePlan
    step_timeout: float | str | None = "default"


class PolicyProxy(PolicySpec):
    """A policy that answers through the router (it has the real policy's attributes, and no model).

    Args:
        spec: The inference actors' policy spec.
        router: The router actor's handle.
        stop: Set when the worker must stop; checked before each request.
        timeout: Seconds to wait for one request.
    """

    def __init__(self, spec: PolicySpec, router: Any, stop: threading.Event, timeout: float):
        super().__init__(spec.attributes)
        self.router, self.stop, self.timeout = router, stop, timeout

    def __call__(self, tensordict: Any) -> Any:
        """The policy output for ``tensordict`` (batch ``(B,)``), from an inference actor.

        Raises:
            InferenceUnavailable: If the router is gone or the request takes longer than the timeout.
        """
        if self.stop.is_set():
            raise _Stopped
        ray = import_ray()
        try:
            return ray.get(self.router.generate.remote(tensordict), timeout=self.timeout)
        except ray.exceptions.RayTaskError as e:
            raise unwrap(e) from None
        except ray.exceptions.GetTimeoutError as e:
            raise InferenceUnavailable(f"no inference actor answered within {self.timeout} s") from e
        except ray.exceptions.RayActorError as e:
            raise InferenceUnavailable("the collector's router actor died") from e


def _build(factories: list[Callable[[], Any]]) -> Any:
    """The worker's envs: a list, or the one vector env its single factory returns."""
    import gymnasium as gym

    envs = [factory() for factory in factories]
    vectors = [e for e in envs if isinstance(e, gym.vector.VectorEnv)]
    if vectors and len(envs) > 1:
        for env in envs:
            env.close()
        raise TypeError("a worker holds either one vector env or a list of single envs: do not mix them")
    return envs[0] if vectors else envs


class EnvWorker:
    """Holds envs and runs rollouts on them (as a Ray actor); failures to build them are reported by :meth:`info`.

    Args:
        factories: Callables, each returning an env (or a single one returning a Gymnasium vector env).
        router: The router actor.
        ref_model: A reference scorer for ``rollout(ref_model=...)`` (vector envs of model-free KL wrappers).
        timeout: Seconds one policy request may take.
    """

    def __init__(self, factories: list[Callable[[], Any]], router: Any, ref_model: Any, timeout: float):
        from chatenv.rollout import make_pool

        self.stop, self.idle = threading.Event(), threading.Event()
        self.idle.set()
        self.router, self.ref_model, self.timeout = router, ref_model, timeout
        self.envs: Any = None
        self.failure: tuple[str, str, BaseException | None] | None = None
        self.size, self.input_mode = 0, None
        try:
            self.envs = _build(factories)
            pool = make_pool(self.envs)
            self.size, self.input_mode = pool.n, pool.input_mode
            pool.close()
        except Exception as e:  # reported by info(), with its type and message
            self.failure = (type(e).__name__, str(e), picklable(e))

    def info(self) -> dict[str, Any]:
        """``failure`` (how building the envs failed, or None), ``size`` (number of envs) and ``input_mode``."""
        return {"failure": self.failure, "size": self.size, "input_mode": self.input_mode}

    def run(self, job: Job, spec: PolicySpec) -> Iterator[list[Transition]]:
        """Run the job's episodes; yields each finished episode's transitions (local numbers) as it ends.

        Args:
            job: The episodes to run and how.
            spec: The policy's spec (the inference actors').

        Raises:
            BaseException: Whatever stopped the rollout (a task, a reward, no inference actor left), after every
                episode finished before it was yielded.
        """
        if not self.idle.wait(timeout=60.0):
            raise DistributedError("this env worker is still running an earlier rollout that did not stop")
        self.stop.clear()
        self.idle.clear()
        out: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        proxy = PolicyProxy(spec, self.router, self.stop, self.timeout)
        thread = threading.Thread(target=self._rollout, args=(job, proxy, out), name="chatenv-env-worker", daemon=True)
        thread.start()
        while True:
            kind, value = out.get()
            if kind == "episode":
                yield value
            elif kind == "error":
                raise value
            else:
                return

    def _rollout(self, job: Job, proxy: PolicyProxy, out: queue.SimpleQueue[tuple[str, Any]]) -> None:
        from chatenv.rollout import rollout

        def on_episode(td: Any) -> None:
            out.put(("episode", episode_transitions(td, proxy)))
            if self.stop.is_set():
                raise _Stopped

        try:
            rollout(
                self.envs,
                cast(RolloutPolicy, proxy),  # it has the real policy's attributes (set from the spec)
                **job.plan.rollout_arguments(),
                step_timeout=job.step_timeout,
                ref_model=self.ref_model,
                on_episode=on_episode,
            )
            out.put(("done", None))
        except _Stopped:
            out.put(("done", None))
        except BaseException as e:  # handed to the collector through run()
            if hasattr(e, "partial"):  # the collector has the finished episodes; do not ship the rest
                e.partial = None
            out.put(("error", picklable(e) or DistributedError(f"{type(e).__name__}: {e}")))
        finally:
            self.idle.set()

    def halt(self) -> None:
        """Ask a running rollout to stop (at its next policy request or finished episode)."""
        self.stop.set()

    def close(self) -> None:
        """Close the envs."""
        envs = self.envs if isinstance(self.envs, list) else [self.envs] if self.envs is not None else []
        for env in envs:
            env.close()
        self.envs = None
