"""The episode plan: how much a collection runs and how each of its episodes starts, checked once.

:func:`chatenv.rollout`, :class:`chatenv.distributed.RayCollector` and :func:`chatenv.serve.agent_rollout` all
take the same description of a collection: a number of episodes (or, for ``rollout``, of transitions), a seed,
groups of ``group_size`` episodes that start from the same reset, and reset options. :class:`EpisodePlan` is that
description, validated by :meth:`EpisodePlan.make`, with the rules every caller follows:

- episode ``k`` is in group ``k // group_size`` (each episode its own group without ``group_size``);
- planned episodes (groups, or reset options) reset with ``seed + group`` and their group's options;
- otherwise env ``i``'s first reset gets ``seed + i`` and later resets continue each env's generator
  (:meth:`EpisodePlan.seed_of`);
- :meth:`EpisodePlan.split` gives each worker a contiguous share of whole groups, numbered and seeded so that the
  shares together are the same episodes as one local collection over all envs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

__all__ = ["EpisodePlan"]


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _options(reset_options: Any, groups: int, grouped: bool) -> list[dict[str, Any]] | None:
    """Reset options per group (per episode without groups): a dict for all, or one dict each."""
    if reset_options is None:
        return None
    if isinstance(reset_options, Mapping):
        return [dict(reset_options) for _ in range(groups)]
    if isinstance(reset_options, (str, bytes)) or not isinstance(reset_options, Sequence):
        raise TypeError(f"reset_options must be a dict or a list of dicts, got {type(reset_options).__name__}")
    if len(reset_options) != groups or not all(isinstance(o, Mapping) for o in reset_options):
        what = "group" if grouped else "episode"
        raise ValueError(f"reset_options must hold one dict per {what} ({groups}), got {len(reset_options)} items")
    return [dict(o) for o in reset_options]


@dataclass
class EpisodePlan:
    """What to collect and how each episode starts (build it with :meth:`make`; treat it as a value).

    Attributes:
        episodes: Complete this many episodes.
        steps: Or collect this many transitions (no groups nor options then).
        group_size: Episodes per group: the episodes of a group start from the same reset (same seed and options).
        seed: Seed of group 0 for planned episodes (group ``g`` resets with ``seed + g``); of env 0's first reset
            otherwise (env ``i``'s first reset gets ``seed + i``).
        options: Reset options per group (per episode without ``group_size``), or None.
        first_episode: Number of this plan's first episode in a larger collection (a worker's share).
        first_group: Number of its first group there.
        first_env: Index of its first env there.
    """

    episodes: int | None = None
    steps: int | None = None
    group_size: int | None = None
    seed: int | None = None
    options: list[dict[str, Any]] | None = None
    first_episode: int = 0
    first_group: int = 0
    first_env: int = 0

    @classmethod
    def make(
        cls,
        *,
        episodes: int | None = None,
        steps: int | None = None,
        seed: int | None = None,
        group_size: int | None = None,
        reset_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    ) -> EpisodePlan:
        """A checked plan.

        Args:
            episodes: Complete this many episodes.
            steps: Or collect this many transitions (give exactly one of the two).
            seed: Seed of the first reset.
            group_size: Episodes per group sharing a reset (``episodes`` must be a multiple).
            reset_options: A dict for every episode, or one dict per group (per episode without ``group_size``).

        Raises:
            ValueError: For a bad count, episodes that do not make whole groups, groups or options with ``steps``,
                or a list of options of another length than the groups.
            TypeError: For options that are neither a dict nor a list of dicts.
        """
        if (episodes is None) == (steps is None):
            raise ValueError("give exactly one of episodes=... or steps=...")
        _positive("episodes" if episodes is not None else "steps", episodes if episodes is not None else steps)
        if group_size is None and reset_options is None:
            return cls(episodes, steps, seed=seed)
        if episodes is None:
            raise ValueError("group_size= and reset_options= plan episodes: use episodes=..., not steps=...")
        if group_size is not None:
            _positive("group_size", group_size)
            if episodes % group_size:
                raise ValueError(
                    f"episodes={episodes} is not a multiple of group_size={group_size}; every group needs "
                    f"{group_size} episodes"
                )
        options = _options(reset_options, episodes // (group_size or 1), group_size is not None)
        return cls(episodes, None, group_size, seed, options)

    @property
    def planned(self) -> bool:
        """Whether each episode's reset is set here (groups or per-episode options) rather than by the envs."""
        return self.group_size is not None or self.options is not None

    def group(self, episode: int) -> int:
        """The group of an episode (each episode is its own group without ``group_size``)."""
        return episode // (self.group_size or 1)

    def reset_of(self, episode: int) -> tuple[int | None, dict[str, Any] | None]:
        """``(seed, options)`` of a planned episode's reset."""
        g = self.group(episode)
        seed = None if self.seed is None else self.seed + g
        return seed, None if self.options is None else self.options[g]

    def seed_of(self, episode: int, env: int, first: bool) -> int | None:
        """The reset seed of ``episode`` run by env ``env`` (``first``: that env's first reset).

        Planned episodes reset with their group's seed; others as a list of envs resets: env ``i`` first with
        ``seed + i``, later with None (its generator goes on).
        """
        if self.seed is None:
            return None
        if self.planned:
            return self.seed + self.group(episode)
        return self.seed + env if first else None

    def drawn(self) -> EpisodePlan:
        """This plan, with a random seed for planned episodes without one (the episodes of a group share it)."""
        if not self.planned or self.seed is not None:
            return self
        return replace(self, seed=int(np.random.default_rng().integers(2**31)))

    def split(self, workers: int, env_offsets: Sequence[int] | None = None) -> list[EpisodePlan]:
        """Contiguous shares of the episodes (whole groups) for ``workers`` workers, in worker order.

        Share ``w`` is numbered from the episodes and groups of the shares before it (``first_episode``,
        ``first_group``; ``first_env`` is ``env_offsets[w]``, the global index of worker ``w``'s first env) and
        seeded so that running every share with :func:`chatenv.rollout` gives the episodes of one local rollout over
        all envs: ``seed + group`` for planned episodes, env seeds ``seed + env_index`` otherwise. A share may hold
        no episode (more workers than groups).

        Raises:
            ValueError: For a plan of steps rather than episodes.
        """
        if self.episodes is None:
            raise ValueError("only a plan of episodes is split between workers")
        offsets = list(env_offsets) if env_offsets is not None else [0] * workers
        per = self.group_size or 1
        base, extra = divmod(self.episodes // per, workers)
        out, start = [], 0
        for w in range(workers):
            n = base + (w < extra)
            offset = start if self.planned else offsets[w]
            options = None if self.options is None else self.options[start : start + n]
            seed = None if self.seed is None else self.seed + offset
            out.append(EpisodePlan(n * per, None, self.group_size, seed, options, start * per, start, offsets[w]))
            start += n
        return out

    def rollout_arguments(self) -> dict[str, Any]:
        """The plan as :func:`chatenv.rollout` keywords (``episodes``, ``seed``, ``group_size``, ``reset_options``)."""
        return {
            "episodes": self.episodes,
            "seed": self.seed,
            "group_size": self.group_size,
            "reset_options": self.options,
        }
