"""The Ray collector: env-worker actors, inference actors and a router, driven from the trainer's process."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict

from chatenv.distributed.actors import Actors, check_env_workers, check_policies
from chatenv.distributed.common import DistributedError, PolicySpec, check_count, check_resource, import_ray, unwrap
from chatenv.distributed.episodes import Chunk, assemble_chunks, renumber
from chatenv.distributed.inference import InferenceActor
from chatenv.distributed.plan import env_factories
from chatenv.distributed.router import Router
from chatenv.distributed.worker import EnvWorker, Job
from chatenv.rollout.collect import Transition
from chatenv.rollout.plan import EpisodePlan

__all__ = ["LostEpisodes", "RayCollector"]


@dataclass
class LostEpisodes:
    """Episodes one env worker was given and did not hand back.

    Attributes:
        worker: The worker's index.
        episodes: How many of its episodes are missing (the ones in progress when it died, and those not started).
        reason: Why (``"died"``, or the error that stopped it).
    """

    worker: int
    episodes: int
    reason: str


@dataclass
class _Run:
    """One worker's part of a collection."""

    worker: int
    job: Job
    gen: Any = None
    received: int = 0


def _plan(episodes: Any, seed: int | None, group_size: Any, reset_options: Any) -> EpisodePlan:
    check_count("episodes", episodes)
    if group_size is not None:
        check_count("group_size", group_size)
    return EpisodePlan.make(episodes=episodes, seed=seed, group_size=group_size, reset_options=reset_options)


class RayCollector:
    """Collect episodes with env workers and inference actors on a Ray cluster.

    Each env worker (a Ray actor) holds several envs and runs :func:`chatenv.rollout` on them with a policy proxy;
    every round's policy input goes to a router actor, which sends it to the inference actor with the fewest
    requests in flight. Inference actors build their policy themselves from ``policy_factory`` (no model is
    pickled). Episodes are split between the live workers before a collection starts (contiguous shares; whole
    groups with ``group_size``) and each is handed back as soon as it ends.

    Faults: an inference actor that dies is dropped by the router and its requests go to the others (nothing is
    lost). An env worker that dies loses the episodes it had in progress and those it had not started: they are
    reported in :attr:`lost` (they are not run again), every episode it finished before is kept, and later
    collections use the remaining workers. With ``max_restarts``, Ray restarts dead actors: a restarted env worker
    builds fresh envs (the episodes in progress are still lost), a restarted inference actor builds its policy
    from the factory again (so its weights go back to the factory's until the collector re-sends the last
    broadcast, at the start of the next collection; replies are stamped with the version that made them).

    Args:
        envs: A registered env id (with ``env_kwargs``), an env factory (each worker calls it ``envs_per_worker``
            times; it may return a vector env), or a list of env factories split among the workers (env ``i`` of
            the list gets ``env_index`` ``i``). Factories are pickled to the workers and called there.
        policy_factory: A picklable callable returning a generating policy (e.g.
            ``wrappers.distributed.TransformersFactory(path, ...)``), called in each inference actor.
        env_kwargs: ``gymnasium.make`` keyword arguments (env ids only).
        num_env_workers: Env-worker actors.
        envs_per_worker: Envs per worker (env ids and single factories; default 1).
        num_inference_actors: Inference actors.
        worker_cpus: CPUs reserved by each env worker.
        inference_cpus: CPUs reserved by each inference actor.
        inference_gpus: GPUs reserved by each inference actor.
        load_weights: ``fn(policy, state_dict)`` loading broadcast weights in an inference actor (default:
            ``policy.model.load_state_dict``).
        ref_model: A reference scorer passed to each worker's ``rollout(ref_model=...)`` (e.g. a
            ``wrappers.kl.RayRefModel``, for vector envs of model-free KL wrappers). Envs that hold their own
            reference (``KLPenalty(env, ref_model=RayRefModel(...))`` in the factory) need nothing here.
        max_restarts: How many times Ray restarts a dead actor (0: never).
        request_timeout: Seconds one policy request may take.
        startup_timeout: Seconds the actors may take to start (models load in this time).

    Ray must be initialised (``ray.init(...)``). Use the collector as a context manager, or call :meth:`close`.

    Raises:
        TypeError, ValueError: For bad arguments (before any actor starts).
        DistributedError: If Ray is not initialised, actors do not start in time, a factory raises, or the envs'
            input mode is not the policy's. A failed constructor leaves no actor behind.
    """

    def __init__(
        self,
        envs: Any,
        policy_factory: Callable[[], Any],
        *,
        env_kwargs: Mapping[str, Any] | None = None,
        num_env_workers: int = 2,
        envs_per_worker: int | None = None,
        num_inference_actors: int = 1,
        worker_cpus: float = 1.0,
        inference_cpus: float = 1.0,
        inference_gpus: float = 0.0,
        load_weights: Callable[[Any, Any], None] | None = None,
        ref_model: Any = None,
        max_restarts: int = 0,
        request_timeout: float = 600.0,
        startup_timeout: float = 600.0,
    ):
        plan = env_factories(envs, env_kwargs, num_env_workers, envs_per_worker)
        if not callable(policy_factory):
            raise TypeError(
                f"policy_factory must be a callable returning a policy, got {type(policy_factory).__name__}"
            )
        if load_weights is not None and not callable(load_weights):
            raise TypeError(f"load_weights must be fn(policy, state_dict), got {type(load_weights).__name__}")
        check_count("num_inference_actors", num_inference_actors)
        check_count("max_restarts", max_restarts, minimum=-1)
        cpus = (check_resource("worker_cpus", worker_cpus), check_resource("inference_cpus", inference_cpus))
        self._gpus = check_resource("inference_gpus", inference_gpus)
        self._timeout = check_resource("request_timeout", request_timeout, positive=True)
        self._actors = Actors(check_resource("startup_timeout", startup_timeout, positive=True))
        self._restarts, self._ref_model = max_restarts, ref_model
        ray = import_ray()
        if not ray.is_initialized():
            raise DistributedError("Ray is not initialised: call ray.init(...) before creating a RayCollector")
        self.version = 0
        self.lost: list[LostEpisodes] = []
        self._weights: Any = None
        try:
            self._start(policy_factory, load_weights, num_inference_actors, plan, cpus)
        except BaseException:
            self._actors.kill()
            raise

    # ------------------------------------------------------------------------------------------------ start

    def _options(self, **options: Any) -> dict[str, Any]:
        return {"max_restarts": self._restarts, **options}

    def _start(
        self, factory: Any, load_weights: Any, n: int, plan: list[list[Callable[[], Any]]], cpus: tuple[float, float]
    ) -> None:
        """Start every actor at once (models and envs load in parallel), then wait for all of them."""
        ray = import_ray()
        remote = ray.remote(InferenceActor).options(
            **self._options(num_cpus=cpus[1], num_gpus=self._gpus, max_task_retries=self._restarts)
        )
        self.inference_actors = [remote.remote(factory, load_weights) for _ in range(n)]
        self._actors.all += self.inference_actors
        drop = 1 if self._restarts == 0 else 3
        self.router = ray.remote(Router).options(num_cpus=0).remote(self.inference_actors, drop)
        self._actors.all.append(self.router)
        remote = ray.remote(EnvWorker).options(**self._options(num_cpus=cpus[0], max_task_retries=0, max_concurrency=2))
        self.env_workers = [remote.remote(f, self.router, self._ref_model, self._timeout) for f in plan]
        self._actors.all += self.env_workers
        ready = self._actors.wait([a.ready.remote() for a in self.inference_actors], "inference actors")
        self.spec: PolicySpec = check_policies(ready)
        infos = self._actors.wait([w.info.remote() for w in self.env_workers], "env workers")
        #: env index of each worker's first env (env indices are unique across workers)
        self.env_offsets = check_env_workers(infos, self.spec.layout.input_mode)
        self._alive = [True] * len(self.env_workers)

    # ------------------------------------------------------------------------------------------------ state

    @property
    def workers_alive(self) -> list[int]:
        """Indices of the env workers that collections use."""
        return [w for w, alive in enumerate(self._alive) if alive]

    def stats(self) -> list[dict[str, Any]]:
        """Per inference actor: requests ``served``, ``inflight`` now, ``peak`` in flight, and ``alive``."""
        stats: list[dict[str, Any]] = import_ray().get(self.router.stats.remote(), timeout=self._timeout)
        return stats

    def _refresh(self) -> None:
        """Before a collection: take back restarted workers, and re-send the last weights to actors that lack them."""
        ray = import_ray()
        if self._restarts != 0:
            for w in range(len(self.env_workers)):
                if not self._alive[w]:
                    try:
                        self._alive[w] = ray.get(self.env_workers[w].info.remote(), timeout=10)["failure"] is None
                    except Exception:  # still dead (or restarting): skip it this time
                        self._alive[w] = False
        if self._weights is None:
            return
        for i, (actor, stats) in enumerate(zip(self.inference_actors, self.stats())):
            if not stats["alive"]:
                continue
            try:
                if ray.get(actor.get_version.remote(), timeout=self._timeout) != self.version:
                    ray.get(actor.load_weights.remote(self._weights, self.version), timeout=self._timeout)
            except ray.exceptions.RayActorError:
                ray.get(self.router.mark_dead.remote(i))

    # ------------------------------------------------------------------------------------------------ weights

    def broadcast(self, state_dict: Mapping[str, Any], version: int | None = None) -> int:
        """Send new weights to every live inference actor through Ray's object store (one copy, shared).

        Each actor loads them after the requests it is already serving, and stamps every later reply with the new
        version (the ``policy_version`` column of collected rows).

        Args:
            state_dict: The weights (``model.state_dict()``; tensors are copied to CPU memory).
            version: The weights' version (default: the last one + 1).

        Returns:
            The version now held by the actors.

        Raises:
            TypeError: For a state dict that is not a mapping of names to tensors.
            ValueError: For a version that is not an int >= 0.
            BaseException: The actor's own error when the weights do not fit its model.
        """
        import torch

        ray = import_ray()
        if not isinstance(state_dict, Mapping) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
            raise TypeError("state_dict must map parameter names to tensors (model.state_dict())")
        version = self.version + 1 if version is None else check_count("version", version, minimum=0)
        ref = ray.put({k: v.detach().to("cpu") for k, v in state_dict.items()})
        live = [(i, a) for i, (a, s) in enumerate(zip(self.inference_actors, self.stats())) if s["alive"]]
        calls = [(i, a.load_weights.remote(ref, version)) for i, a in live]
        for i, call in calls:
            try:
                ray.get(call, timeout=self._timeout)
            except ray.exceptions.RayActorError:
                ray.get(self.router.mark_dead.remote(i))
            except ray.exceptions.RayTaskError as e:
                raise unwrap(e) from None
        self._weights, self.version = ref, version
        return version

    # ------------------------------------------------------------------------------------------------ collection

    def _launch(self, plan: EpisodePlan, step_timeout: float | str | None) -> list[_Run]:
        """Split the episodes among the live workers and start their rollouts."""
        workers = self.workers_alive
        if not workers:
            raise DistributedError("every env worker of the collector died; create a new collector")
        shares = plan.split(len(workers), [self.env_offsets[w] for w in workers])
        self._refresh()
        self.lost = []
        runs = [_Run(w, Job(share, step_timeout)) for w, share in zip(workers, shares) if share.episodes]
        for run in runs:
            run.gen = self.env_workers[run.worker].run.remote(run.job, self.spec)
        return runs

    def _advance(self, run: _Run) -> list[Transition] | None:
        """The next finished episode of a run (globally numbered), or None when the run is over."""
        ray = import_ray()
        try:
            value = ray.get(next(run.gen))
        except StopIteration:
            self._close_run(run, "the worker's rollout ended early")
            return None
        except ray.exceptions.RayActorError:
            self._alive[run.worker] = False
            self._close_run(run, "died")
            return None
        except ray.exceptions.RayTaskError as e:
            error = unwrap(e)
            self._close_run(run, f"{type(error).__name__}: {error}")
            raise error from None
        run.received += 1
        return renumber(value, run.job.plan)

    def _close_run(self, run: _Run, reason: str) -> None:
        missing = (run.job.plan.episodes or 0) - run.received
        if missing > 0:
            self.lost.append(LostEpisodes(run.worker, missing, reason))

    def _episodes(self, runs: list[_Run]) -> Iterator[tuple[int, list[Transition]]]:
        """``(worker, transitions)`` of each episode as it ends, from every run; a failure is raised at the end.

        When a worker's rollout raises, the others are stopped, what they finished is still handed out, then the
        first error is raised. If the consumer stops early, the workers are stopped too.
        """
        ray = import_ray()
        pending = {run.gen: run for run in runs}
        failure: BaseException | None = None
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                run = pending[ready[0]]
                try:
                    transitions = self._advance(run)
                except Exception as e:  # one worker failed: stop the others, hand out what they finish
                    failure = failure or e
                    transitions = None
                    self._halt(r for r in pending.values() if r is not run)
                if transitions is None:
                    del pending[run.gen]
                    continue
                yield run.worker, transitions
        finally:
            if pending:  # the consumer went away (or Ctrl-C): stop the rollouts before anything else runs on them
                self._halt(pending.values())
                self._drain(list(pending.values()))
        if failure is not None:
            raise failure

    def _halt(self, runs: Any) -> None:
        for run in runs:
            self.env_workers[run.worker].halt.remote()

    def _drain(self, runs: list[_Run]) -> None:
        """Wait for halted runs to end (their late episodes are dropped)."""
        ray = import_ray()
        for run in runs:
            try:
                for ref in run.gen:
                    ray.get(ref, timeout=self._timeout)
            except Exception:  # a dead worker or a failed rollout: it has ended either way
                continue

    def collect(
        self,
        episodes: int,
        *,
        seed: int | None = None,
        group_size: int | None = None,
        reset_options: Any = None,
        step_timeout: float | str | None = "default",
    ) -> TensorDict:
        """Run ``episodes`` episodes on the workers and return them as one TensorDict.

        The layout is :func:`chatenv.rollout`'s (one row per transition, by episode then turn), numbered across the
        workers: episodes (and groups) by worker share, ``env_index`` unique across workers, plus a ``worker``
        column. With a fixed policy the episodes equal those of one local rollout over all the envs with the same
        ``seed``, ``group_size`` and ``reset_options`` (same seeds per env or group).

        Episodes lost to a dead worker are missing (their numbers are skipped) and listed in :attr:`lost`.

        Args:
            episodes: Episodes to run.
            seed: Seed of the first reset (as in :func:`chatenv.rollout`).
            group_size: Episodes per group sharing a reset (whole groups go to one worker).
            reset_options: A dict for every episode, or one per group (per episode without ``group_size``).
            step_timeout: Seconds a round of env steps may take in a worker.

        Raises:
            ValueError: For bad arguments.
            DistributedError: If no env worker is left.
            BaseException: What stopped a worker's rollout (a task's error, no inference actor left), once the other
                workers stopped; ``err.partial`` holds every episode finished before.
        """
        chunk = Chunk()
        groups = group_size is not None
        runs = self._launch(_plan(episodes, seed, group_size, reset_options), step_timeout)
        try:
            for worker, transitions in self._episodes(runs):
                chunk.add(transitions, worker)
        except BaseException as e:
            e.partial = assemble_chunks(chunk, self.spec.layout, groups=groups)  # type: ignore[attr-defined]
            raise
        return assemble_chunks(chunk, self.spec.layout, groups=groups)

    def stream(
        self,
        episodes: int,
        *,
        seed: int | None = None,
        group_size: int | None = None,
        reset_options: Any = None,
        step_timeout: float | str | None = "default",
    ) -> Iterator[TensorDict]:
        """Like :meth:`collect`, but yields each episode (its rows, the same layout) as soon as it ends.

        Episodes come in the order they end. The workers start at once; closing the iterator early stops them.
        After the iterator is exhausted, :attr:`lost` lists the episodes of workers that died.
        """
        groups = group_size is not None
        runs = self._launch(_plan(episodes, seed, group_size, reset_options), step_timeout)
        return self._stream(runs, groups)

    def _stream(self, runs: list[_Run], groups: bool) -> Iterator[TensorDict]:
        for worker, transitions in self._episodes(runs):
            chunk = Chunk()
            chunk.add(transitions, worker)
            yield assemble_chunks(chunk, self.spec.layout, groups=groups)

    # ------------------------------------------------------------------------------------------------ close

    def close(self) -> None:
        """Close the envs and stop every actor (idempotent)."""
        if not self._actors.all:
            return
        ray = import_ray()
        closing = [w.close.remote() for w, alive in zip(self.env_workers, self._alive) if alive]
        try:
            ray.wait(closing, num_returns=len(closing), timeout=30)
        finally:
            self._actors.kill()

    def __enter__(self) -> RayCollector:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
