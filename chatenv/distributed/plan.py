"""Which envs each worker builds, and which episodes each worker runs (with what seeds and reset options)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from chatenv.distributed.common import check_count
from chatenv.distributed.episodes import Numbering
from chatenv.distributed.worker import Job

__all__ = ["env_factories", "split_episodes"]


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


def _check_options(reset_options: Any, units: int, group_size: int | None) -> None:
    if reset_options is None or isinstance(reset_options, Mapping):
        return
    if isinstance(reset_options, (str, bytes)) or not isinstance(reset_options, Sequence):
        raise TypeError(f"reset_options must be a dict or a list of dicts, got {type(reset_options).__name__}")
    if len(reset_options) != units:
        what = "group" if group_size else "episode"
        raise ValueError(f"reset_options must hold one dict per {what} ({units}), got {len(reset_options)} items")


def split_episodes(
    episodes: Any,
    workers: list[int],
    env_offsets: dict[int, int],
    *,
    seed: int | None,
    group_size: int | None,
    reset_options: Any,
    step_timeout: float | str | None,
) -> list[tuple[Job, Numbering]]:
    """Contiguous shares of the episodes (whole groups with ``group_size``) for the live ``workers``.

    Worker ``w``'s share is numbered from the episodes (groups) of the workers before it, and seeded so that the
    whole equals one local :func:`chatenv.rollout` over all envs: env seeds ``seed + env_index`` for unplanned
    episodes, ``seed + group`` for planned ones (groups, per-episode reset options).

    Raises:
        ValueError: For a bad ``episodes`` or ``group_size``, episodes that do not make whole groups, or
            ``reset_options`` of another length than the episodes (groups).
    """
    check_count("episodes", episodes)
    if group_size is not None:
        check_count("group_size", group_size)
        if episodes % group_size:
            raise ValueError(f"episodes={episodes} is not a multiple of group_size={group_size}; every group needs all")
    per = group_size or 1
    units = episodes // per
    _check_options(reset_options, units, group_size)
    planned = group_size is not None or reset_options is not None
    base, extra = divmod(units, len(workers))
    out, start = [], 0
    for k, w in enumerate(workers):
        n = base + (k < extra)
        if n:
            offset = start if planned else env_offsets[w]
            options = reset_options[start : start + n] if isinstance(reset_options, Sequence) else reset_options
            job = Job(n * per, None if seed is None else seed + offset, group_size, options, step_timeout)
            out.append((job, Numbering(w, episodes=start * per, groups=start, envs=env_offsets[w])))
        start += n
    return out
