"""Branching rollouts: from envs in the middle of their episodes, ``n`` continuations each, every one on a fork.

Steps are plan-then-commit on copies, so an episode can be forked (:func:`chatenv.fork`) at any turn boundary. A
branch point is an env (or a wrapper of one) whose episode is in progress; :func:`branch_rollout` forks it ``n``
times and runs every fork to the end of its episode with the policy, in batched rounds as :func:`chatenv.rollout`
does. The branches of one point share its token view verbatim (their first prompts are identical), so the mean of
their returns is a Monte-Carlo value of the point, and their returns minus that mean are the advantages of the
first replies that tell them apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from chatenv.envs.fork import fork
from chatenv.rollout.assemble import assemble
from chatenv.rollout.asynchronous import AsyncCollector
from chatenv.rollout.collect import Budget, Collector, Transition
from chatenv.rollout.pools import make_pool

__all__ = ["branch_rollout"]


def branch_rollout(
    points: Any,
    policy: Any,
    *,
    n: int,
    max_workers: int | None = None,
    ref_model: Any = None,
    step_timeout: float | str | None = "default",
    mode: str = "sync",
) -> TensorDict:
    """Continue each branch point ``n`` times, each continuation on a fork, to the end of its episode.

    The points themselves are not stepped (they stay where they are, e.g. to branch again later).

    Args:
        points: A turn-level env (:class:`~chatenv.ChatEnv` or a wrapper of one) mid-episode, or a list of them.
        policy: A generating policy whose ``input_mode`` matches the envs' (as for :func:`chatenv.rollout`).
        n: Continuations per point.
        max_workers: Threads stepping the forks (default: one per fork).
        ref_model: A reference scorer for the forks' KL wrappers (see :func:`chatenv.rollout`).
        step_timeout: Seconds a round of steps may take (see :func:`chatenv.rollout`).
        mode: ``"sync"`` (default): batched rounds; ``"async"``: every branch's next reply is requested as soon as
            its step returns (a policy with ``submit``, as for :func:`chatenv.rollout`), so short branches make
            room for the others in the engine's batch. Same result either way with greedy decoding.

    Returns:
        One row per transition in :func:`chatenv.rollout`'s layout; ``episode`` numbers the continuations
        (point ``p``'s are ``p * n`` to ``p * n + n - 1``), ``turn`` counts from the start of the episode (the first
        branched turn is the point's turn), ``group`` is the point and ``branch`` the continuation within it.

    Raises:
        ValueError: For ``n`` < 1, no points, or a point whose episode has not started or has ended.
        TypeError: For a token-level env (fork it between replies and step it yourself) or an episode that cannot be
            forked.
        BaseException: Whatever stops the collection, with the transitions so far in ``err.partial``.
    """
    from chatenv.envs import ChatEnv
    from chatenv.rollout import _attach_partial, _check_mode, _check_policy, _check_reference

    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    _check_mode(mode, policy, None, "flag")
    points = list(points) if isinstance(points, Sequence) else [points]
    if not points:
        raise ValueError("no branch points given")
    for k, point in enumerate(points):
        base = getattr(point, "unwrapped", None)
        if not isinstance(base, ChatEnv):
            raise TypeError(f"point {k} is not a turn-level chatenv env (got {type(base).__name__})")
        if base.episode is None or base.done:
            raise ValueError(f"point {k} has no episode in progress: reset it (and step it to the turn to branch at)")
    forks = [fork(point) for point in points for _ in range(n)]
    pool = make_pool(forks, max_workers, step_timeout)
    collector = None
    try:
        _check_policy(policy, pool)
        _check_reference(ref_model, pool)
        budget = Budget(episodes=len(forks), group_size=n)
        collector = (AsyncCollector if mode == "async" else Collector)(pool, policy, budget, ref_model)
        for i, env in enumerate(forks):
            base = env.unwrapped
            collector.begin(i, base.mode.observe(base.episode))
            collector.slots[i].turn = base.turn
        try:
            collector.drive()
        except BaseException as e:
            _attach_partial(e, collector.collected(), lambda ts: _finish(ts, policy, n))
            raise
    finally:
        pool.close()
        for env in forks:  # the forks are this function's own: their tool objects are released here
            env.close()
    return _finish(collector.collected(), policy, n)


def _finish(transitions: list[Transition], policy: Any, n: int) -> TensorDict:
    td = assemble(transitions, policy, groups=True)
    if td.batch_size[0]:
        td.set("branch", td.get("episode") % n)
    else:
        td.set("branch", torch.zeros(0, dtype=torch.long))
    return td
