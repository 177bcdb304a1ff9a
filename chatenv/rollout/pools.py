"""Env pools: one interface over a list of envs (stepped from a thread pool) and a Gymnasium vector env.

:func:`~chatenv.rollout.collect` drives either through :class:`EnvPool` and never asks which it has.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from chatenv.actions import ScoredAction
from chatenv.errors import StepTimeout, VectorEnvDied
from chatenv.protocols import REF_MODEL_ATTR
from chatenv.rollout.workers import Workers

__all__ = ["EnvPool", "ListPool", "StepResult", "VectorPool", "make_pool"]


@dataclass
class StepResult:
    """One env's step, as Gymnasium returns it (``info`` for that env alone)."""

    obs: Any
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        """Whether the episode ended."""
        return self.terminated or self.truncated


class EnvPool(abc.ABC):
    """``n`` envs stepped together.

    Attributes:
        n: Number of envs.
        input_mode: The envs' input mode (all the same).
    """

    n: int
    input_mode: str

    @abc.abstractmethod
    def reset(self, seed: int | None, count: int | None) -> dict[int, Any]:
        """Start episodes in (at least) the first ``count`` envs (all if None); their first observations."""

    @abc.abstractmethod
    def step(self, actions: dict[int, ScoredAction]) -> tuple[dict[int, StepResult], dict[int, Any]]:
        """Step the envs that have an action: their results, and first observations of episodes started anew."""

    @abc.abstractmethod
    def token_views(self, indices: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each env's current observation as ``(ids, assistant_mask)`` (the env's own, injection-safe ids)."""

    def restart(self, i: int, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        """Start a new episode in env ``i`` now; its observation, or None if it comes from a later :meth:`step`.

        Raises:
            ValueError: If the pool cannot reset one env with a given seed or options.
        """
        if seed is not None or options is not None:
            raise ValueError(
                "this pool resets its envs itself (a vector env's autoreset), so episodes cannot start from given "
                "seeds or options (group_size=, reset_options=); pass a list of envs"
            )
        return None

    def pending(self) -> bool:
        """Whether some env starts a new episode on the next :meth:`step` (that needs no action)."""
        return False

    @abc.abstractmethod
    def have_attr(self, name: str) -> list[bool]:
        """Per env, whether it (or a wrapper in its chain) has the attribute ``name``."""

    def origin(self, i: int) -> int:
        """The index, among the envs given, of env ``i`` (or of the env it was forked from)."""
        return i

    def env(self, i: int) -> Any:
        """Env ``i`` itself (only a pool whose envs live in this process has it).

        Raises:
            TypeError: For a pool whose envs live elsewhere (a vector env's sub-envs).
        """
        raise TypeError(f"{type(self).__name__} holds no env objects here: pass a list of envs")

    def reference_groups(self, indices: list[int]) -> list[tuple[Any, list[int]]]:
        """Reference scorers of the envs at ``indices``, with the envs sharing each (one batch per scorer)."""
        return []

    def close(self) -> None:  # noqa: B027 - most pools hold nothing to release
        """Release threads (the envs stay open: they belong to the caller)."""


class ListPool(EnvPool):
    """Envs in a list; steps run on worker threads, so a slow task does not hold up the others' steps.

    Args:
        envs: The envs.
        max_workers: Threads stepping them (default: one per env).
        step_timeout: Seconds one round of steps may take; past it :class:`~chatenv.errors.StepTimeout` names the
            envs still stepping (their threads are abandoned).
        size: Envs in the pool: beyond ``len(envs)``, forks of the envs given without their episodes (round robin,
            ``chatenv.fork(env, episode=False)``: nothing of an episode is shared or copied); the pool owns them and
            closes them in :meth:`close`.
    """

    def __init__(
        self,
        envs: list[Any],
        max_workers: int | None = None,
        step_timeout: float | None = None,
        size: int | None = None,
    ):
        modes = {_env_attr(e, "input_mode") for e in envs}
        if len(modes) != 1 or None in modes:
            raise ValueError(f"all envs must be chat envs with the same input_mode, got {modes}")
        self.input_mode = modes.pop()
        self.origins = list(range(len(envs)))
        self.forks: list[Any] = []
        if size is not None and size > len(envs):
            from chatenv.envs.fork import fork

            self.origins += [k % len(envs) for k in range(len(envs), size)]
            self.forks = [fork(envs[k], episode=False) for k in self.origins[len(envs) :]]
        self.envs = list(envs) + self.forks
        self.n = len(self.envs)
        self.step_timeout = step_timeout
        threaded = self.n > 1 or step_timeout is not None
        self.workers = Workers(max_workers or self.n) if threaded else None

    def reset(self, seed: int | None, count: int | None) -> dict[int, Any]:  # noqa: D102
        count = self.n if count is None else min(count, self.n)
        return {i: self.envs[i].reset(seed=None if seed is None else seed + i)[0] for i in range(count)}

    def restart(self, i: int, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:  # noqa: D102
        return self.envs[i].reset(seed=seed, options=options)[0]

    def token_views(self, indices: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:  # noqa: D102
        return [_env_attr(self.envs[i], "token_view")() for i in indices]

    def have_attr(self, name: str) -> list[bool]:  # noqa: D102
        return [e.has_wrapper_attr(name) if hasattr(e, "has_wrapper_attr") else hasattr(e, name) for e in self.envs]

    def step(self, actions: dict[int, ScoredAction]) -> tuple[dict[int, StepResult], dict[int, Any]]:
        """Step the envs; if one fails, the others' steps are still waited for and handed back with the error.

        Raises:
            BaseException: The first env's failure (with ``env_index``), carrying ``completed``: the results of the
                envs whose steps did finish (they are committed in those envs, so they must not be lost).
        """
        if self.workers is None:
            futures = {i: _run_now(self.envs[i].step, self.origins[i], a) for i, a in actions.items()}
        else:
            futures = {
                i: self.workers.submit(_tagged, self.envs[i].step, self.origins[i], a) for i, a in actions.items()
            }
        outs, error = self._results(futures)
        results = {i: StepResult(o[0], float(o[1]), bool(o[2]), bool(o[3]), dict(o[4])) for i, o in outs.items()}
        if error is not None:
            error.completed = results  # type: ignore[attr-defined]
            raise error
        return results, {}

    def _results(self, futures: dict[int, Future[Any]]) -> tuple[dict[int, tuple[Any, ...]], BaseException | None]:
        """Every step that finishes by the deadline, and the first failure (a raised error or a timeout)."""
        deadline = None if self.step_timeout is None else time.monotonic() + self.step_timeout
        outs: dict[int, tuple[Any, ...]] = {}
        error: BaseException | None = None
        for i, f in futures.items():
            try:
                outs[i] = f.result(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                error = error or self._timeout(futures)
            except KeyboardInterrupt:  # the user stops the rollout: do not wait for the other steps
                raise
            except BaseException as e:  # handed back once every other step is in
                error = error or e
        return outs, error

    def submit(self, i: int, action: ScoredAction) -> Future[StepResult]:
        """Step env ``i`` alone, on a worker thread (in this thread without workers); the future of its result.

        The future's exception carries ``env_index``, as :meth:`step`'s does.
        """
        if self.workers is None:
            future = _run_now(self.envs[i].step, self.origins[i], action)
        else:
            future = self.workers.submit(_tagged, self.envs[i].step, self.origins[i], action)
        result: Future[StepResult] = Future()

        def done(f: Future[Any]) -> None:
            try:
                o = f.result()
                result.set_result(StepResult(o[0], float(o[1]), bool(o[2]), bool(o[3]), dict(o[4])))
            except BaseException as e:  # handed on through the result's future
                result.set_exception(e)

        future.add_done_callback(done)
        return result

    def _timeout(self, futures: dict[int, Future[Any]]) -> StepTimeout:
        return self.timeout_error([j for j, g in futures.items() if not g.done()])

    def origin(self, i: int) -> int:  # noqa: D102
        return self.origins[i]

    def env(self, i: int) -> Any:  # noqa: D102
        return self.envs[i]

    def timeout_error(self, stuck: list[int]) -> StepTimeout:
        """The error of a step timeout: names the first stuck env and its task (``env_index`` set)."""
        stuck = sorted({self.origins[i] for i in stuck})
        task = type(_env_attr(self.envs[stuck[0]], "task")).__name__
        err = StepTimeout(
            f"env {stuck[0]} (task {task}) did not finish its step within step_timeout={self.step_timeout}s; envs "
            f"still stepping: {stuck}. Their threads are abandoned; make the reward faster or raise step_timeout"
        )
        err.env_index = stuck[0]  # type: ignore[attr-defined]
        return err

    def reference_groups(self, indices: list[int]) -> list[tuple[Any, list[int]]]:  # noqa: D102
        groups: dict[int, tuple[Any, list[int]]] = {}
        for i in indices:
            ref = _env_attr(self.envs[i], REF_MODEL_ATTR)
            if ref is not None:
                groups.setdefault(id(ref), (ref, []))[1].append(i)
        return list(groups.values())

    def close(self) -> None:  # noqa: D102
        if self.workers is not None:
            self.workers.shutdown()
        for env in self.forks:  # the pool's own: their episodes' tool objects are released here
            env.close()
        self.forks = []


class VectorPool(EnvPool):
    """A Gymnasium vector env (wrapped or not), in any autoreset mode it may have.

    Sub-envs without an action this step get a placeholder reply whose step is discarded.
    """

    def __init__(self, venv: gym.vector.VectorEnv):
        self.venv = venv
        self.n = venv.num_envs
        base: Any = venv.unwrapped
        self._base = base  # the vector env under its wrappers (get_attr/call)
        mode = venv.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        if mode not in (gym.vector.AutoresetMode.NEXT_STEP, gym.vector.AutoresetMode.SAME_STEP):
            raise ValueError(
                f"rollout supports vector envs with NEXT_STEP or SAME_STEP autoreset, got {mode}; make the vector env "
                "with autoreset_mode=AutoresetMode.NEXT_STEP"
            )
        self.same_step = mode == gym.vector.AutoresetMode.SAME_STEP
        with _worker_deaths():
            self.input_mode = base.get_attr("input_mode")[0]
            self.filler = int(base.get_attr("chat_tokenizer")[0].end_of_turn_ids[0])
        self.resetting = [False] * self.n

    def reset(self, seed: int | None, count: int | None) -> dict[int, Any]:  # noqa: D102
        with _worker_deaths():
            obs, _ = self.venv.reset(seed=seed)
        return dict(enumerate(obs))

    def pending(self) -> bool:  # noqa: D102
        return any(self.resetting)

    def token_views(self, indices: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:  # noqa: D102
        with _worker_deaths():
            views = self._base.call("token_view")
        return [views[i] for i in indices]

    def have_attr(self, name: str) -> list[bool]:  # noqa: D102
        with _worker_deaths():
            return [bool(x) for x in self._base.call("has_wrapper_attr", name)]

    def step(self, actions: dict[int, ScoredAction]) -> tuple[dict[int, StepResult], dict[int, Any]]:  # noqa: D102
        filler = ScoredAction(np.array([self.filler], dtype=np.int64), placeholder=True)
        with _worker_deaths():
            obs, reward, terminated, truncated, info = self.venv.step(
                tuple(actions.get(i, filler) for i in range(self.n))
            )
        results: dict[int, StepResult] = {}
        started: dict[int, Any] = {}
        for i in range(self.n):
            if self.resetting[i]:  # NEXT_STEP: this step was the reset
                started[i] = obs[i]
                self.resetting[i] = False
                continue
            result = StepResult(obs[i], float(reward[i]), bool(terminated[i]), bool(truncated[i]), info_row(info, i))
            if result.done and self.same_step:
                # the env already reset: obs/info are the new episode's, the final ones are in final_obs/final_info
                started[i] = obs[i]
                result.obs = info["final_obs"][i]
                result.info = info_row(info.get("final_info", {}), i)
            elif result.done:
                self.resetting[i] = True
            results[i] = result
        return results, started


@contextlib.contextmanager
def _worker_deaths() -> Iterator[None]:
    """Turn the pipe errors of a dead asynchronous worker into one clear error."""
    try:
        yield
    except (BrokenPipeError, EOFError, ConnectionResetError) as e:
        raise VectorEnvDied(
            f"a worker process of the vector env died ({type(e).__name__}); its sub-env's episode is lost, the "
            "transitions collected before are in err.partial. Close the vector env (close(terminate=True)) and make "
            "a new one"
        ) from e


def info_row(info: dict[str, Any], i: int) -> dict[str, Any]:
    """Env ``i``'s entries of a vector env's batched ``info`` (entries it did not set are left out)."""
    out: dict[str, Any] = {}
    for k, v in info.items():
        if k.startswith("_"):
            continue
        if isinstance(v, dict):
            out[k] = info_row(v, i)
        elif isinstance(v, np.ndarray) and v.ndim >= 1:
            mask = info.get(f"_{k}")
            if mask is None or bool(mask[i]):
                item = v[i]
                item = item.item() if isinstance(item, np.ndarray) and item.ndim == 0 else item
                out[k] = item.item() if isinstance(item, np.generic) else item
    return out


def _env_attr(env: Any, name: str) -> Any:
    """An attribute of ``env`` or any wrapper in its chain (Gymnasium's wrapper lookup), None if absent."""
    if hasattr(env, "has_wrapper_attr"):
        return env.get_wrapper_attr(name) if env.has_wrapper_attr(name) else None
    return getattr(env, name, None)


def _run_now(step: Any, i: int, action: Any) -> Future[Any]:
    """Run a step in this thread, as a finished future (the single-env path without worker threads)."""
    future: Future[Any] = Future()
    try:
        future.set_result(_tagged(step, i, action))
    except BaseException as e:  # handed to the caller through the future
        future.set_exception(e)
    return future


def _tagged(step: Any, i: int, action: Any) -> tuple[Any, ...]:
    """``step(action)``; an exception it raises is tagged with ``env_index`` (which env failed)."""
    try:
        return tuple(step(action))
    except BaseException as e:
        if getattr(e, "env_index", None) is None:
            try:
                e.env_index = i  # type: ignore[attr-defined]
            except AttributeError:  # an exception type that takes no attributes
                pass
        raise


#: Seconds a round of env steps may take unless ``step_timeout`` says otherwise (lists of envs): a reward or tool
#: that never returns ends the rollout with StepTimeout and what was collected, instead of blocking it forever.
DEFAULT_STEP_TIMEOUT = 600.0


def make_pool(
    env: Any, max_workers: int | None = None, step_timeout: float | str | None = "default", size: int | None = None
) -> EnvPool:
    """The pool for one env, a list of envs, or a (wrapped) Gymnasium vector env.

    ``step_timeout="default"`` is :data:`DEFAULT_STEP_TIMEOUT` for lists of envs and none for a vector env (it
    steps its sub-envs itself); ``None`` waits forever. ``size`` (lists of envs) adds forks of the envs up to that
    many (see :class:`ListPool`).

    Raises:
        ValueError: For an empty list, a bad ``step_timeout``, or ``step_timeout`` with a vector env.
    """
    if isinstance(step_timeout, str) and step_timeout == "default":
        step_timeout = None if isinstance(env, gym.vector.VectorEnv) else DEFAULT_STEP_TIMEOUT
    if step_timeout is not None and (
        isinstance(step_timeout, bool) or not isinstance(step_timeout, (int, float)) or not step_timeout > 0
    ):
        raise ValueError(
            f"step_timeout must be a positive number of seconds, None (wait forever) or 'default', got {step_timeout!r}"
        )
    if isinstance(env, gym.vector.VectorEnv):
        if step_timeout is not None:
            raise ValueError(
                "step_timeout applies to lists of envs (stepped on threads here); a vector env steps its sub-envs "
                "itself: pass a list of envs, or bound the reward's time inside the task"
            )
        return VectorPool(env)
    envs = list(env) if isinstance(env, (list, tuple)) else [env]
    if not envs:
        raise ValueError("no envs given")
    return ListPool(envs, max_workers, step_timeout, size)
