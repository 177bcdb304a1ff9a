"""Which envs each worker builds (which episodes each runs is :meth:`chatenv.rollout.plan.EpisodePlan.split`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from chatenv.distributed.common import check_count

__all__ = ["env_factories"]


def _make(env_id: str, kwargs: dict[str, Any]) -> Any:
    import gymnasium as gym

    import chatenv  # noqa: F401  (registers the envs in the worker's process)

    return gym.make(env_id, **kwargs)


def env_factories(
    envs: Any, env_kwargs: Mapping[str, Any] | None, workers: int, envs_per_worker: int | None
) -> list[list[Callable[[], Any]]]:
    """Per worker, the env factories it calls.

    Args:
        envs: A registered env id, one env factory (each worker calls it ``envs_per_worker`` times; a factory may
            return a Gymnasium vector env, then one per worker), or a list of env factories (split into
            ``workers`` contiguous parts, so env ``i`` of the list is ``env_index`` ``i``).
        env_kwargs: Keyword arguments of ``gymnasium.make`` (env ids only).
        workers: Number of workers.
        envs_per_worker: Envs per worker (env ids and single factories; default 1).

    Raises:
        TypeError: For envs of another kind, factories that are not callable, or env_kwargs with factories.
        ValueError: For bad counts, or fewer factories than workers.
    """
    check_count("num_env_workers", workers)
    if envs_per_worker is not None:
        check_count("envs_per_worker", envs_per_worker)
    if env_kwargs is not None and not isinstance(envs, str):
        raise TypeError("env_kwargs= goes with an env id; put the arguments into your env factories instead")
    if env_kwargs is not None and not isinstance(env_kwargs, Mapping):
        raise TypeError(f"env_kwargs must be a dict, got {type(env_kwargs).__name__}")
    if isinstance(envs, str):
        factory = functools.partial(_make, envs, dict(env_kwargs or {}))
        return [[factory] * (envs_per_worker or 1) for _ in range(workers)]
    if callable(envs):
        return [[envs] * (envs_per_worker or 1) for _ in range(workers)]
    if not isinstance(envs, Sequence) or isinstance(envs, bytes):
        raise TypeError(
            f"envs must be a registered env id, an env factory or a list of env factories, got {type(envs).__name__}"
        )
    bad = [i for i, f in enumerate(envs) if not callable(f)]
    if bad:
        raise TypeError(
            f"envs[{bad[0]}] is a {type(envs[bad[0]]).__name__}, not a factory: give callables that build the envs "
            "in the workers (e.g. functools.partial(ChatEnv, 'arithmetic')), never env objects"
        )
    if envs_per_worker is not None:
        raise ValueError("envs_per_worker= goes with an env id or one factory; a list of factories sets it itself")
    if len(envs) < workers:
        raise ValueError(f"{len(envs)} env factories cannot fill num_env_workers={workers}; give at least one each")
    base, extra = divmod(len(envs), workers)
    sizes = [base + (w < extra) for w in range(workers)]
    starts = [sum(sizes[:w]) for w in range(workers)]
    return [list(envs[s : s + n]) for s, n in zip(starts, sizes)]
