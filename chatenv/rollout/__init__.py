"""Drive chat envs with a batched policy and collect the transitions as one TensorDict.

:func:`rollout` takes one env, a list of envs, or a Gymnasium vector env, and a policy wrapper (anything with
the :class:`wrappers.policies.LLMWrapperBase` interface). Each round calls the policy once for every env that
is mid-episode, then steps those envs; envs in a list are stepped from a thread pool, so a slow task (a reward
that calls a judge, a sleeping tool) does not hold up the others more than the turn barrier requires.

With ``mode="async"`` (a list of envs and an :class:`~chatenv.protocols.AsyncRolloutPolicy`) there are no rounds:
each episode's next request is submitted the moment its previous step returns, the backend batches what is waiting
(continuous batching on vLLM's async engine, a short batching window for transformers), env steps run while the
engine generates for the others, and reference models score replies in batches as they fill
(:mod:`chatenv.rollout.asynchronous`). The result has the same layout.

Every transition records the version of the policy's weights that generated it (``policy_version``). A policy may
be updated while a rollout runs (``policy.update_weights(...)`` from ``on_episode`` or another thread): episodes in
flight go on with the new weights and record the version per turn. ``max_staleness=N`` then handles transitions
more than ``N`` versions behind the policy's version at assembly time: flagged in a ``stale`` column (default,
``stale="flag"``) or dropped (``stale="drop"``).

The result has one row per transition, ordered by episode then turn, in TorchRL's layout:

- ``tokens`` / ``masks`` / ``log_probs``: the policy's containers for the turn (prompt = the observation,
  response = the generated ids), plus ``text`` or ``history`` in those input modes;
- ``("next", "reward")``, ``("next", "done")``, ``("next", "terminated")``, ``("next", "truncated")``: ``(N, 1)``;
- ``("next", "reward_components", name)``: ``(N, 1)``, NaN where a turn did not report that component;
- ``episode``, ``turn``, ``env_index``: ``(N,)`` int64 bookkeeping; ``policy_version`` (when the policy reports a
  version) and, with ``max_staleness`` and ``stale="flag"``, ``stale`` (bool);
- with KL env wrappers (``wrappers.kl``): ``ref_log_probs`` and ``kl`` (shaped like ``log_probs``, NaN on the
  prompt) and ``("next", "task_reward")``; ``("next", "reward")`` is then the penalised reward.

Actions are :class:`~chatenv.envs.ScoredAction` objects (ids + generation log-probs), so KL wrappers reuse the
policy's log-probs. When envs in a list share one reference model (``RefLogProbs(env, ref)`` with the same
``ref``), its log-probs are computed in one batched forward per round and handed to every env.

In tokens mode the policy's prompt is the env's observation verbatim and the assistant mask of earlier turns is
carried along, so masks mark every generated token of the episode.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import gymnasium as gym
from tensordict import TensorDict

from chatenv.protocols import REF_MODEL_ATTR, RolloutPolicy, layout_of
from chatenv.rollout.assemble import STALE_POLICIES, apply_staleness, assemble
from chatenv.rollout.asynchronous import AsyncCollector
from chatenv.rollout.batching import Batcher
from chatenv.rollout.branch import branch_rollout
from chatenv.rollout.collect import Budget, Collector, Transition
from chatenv.rollout.episode_view import episodes, turns
from chatenv.rollout.plan import EpisodePlan
from chatenv.rollout.pools import EnvPool, ListPool, StepResult, VectorPool, make_pool

__all__ = [
    "AsyncCollector",
    "Batcher",
    "Budget",
    "Collector",
    "EnvPool",
    "EpisodePlan",
    "ListPool",
    "StepResult",
    "Transition",
    "VectorPool",
    "branch_rollout",
    "episodes",
    "make_pool",
    "rollout",
    "turns",
]


def _check_reference(ref_model: Any, pool: EnvPool) -> None:
    if ref_model is None:
        return
    if not callable(getattr(ref_model, "log_probs", None)):
        raise TypeError(f"ref_model must have log_probs(sequences) (a ReferenceScorer), got {type(ref_model).__name__}")
    missing = sorted({pool.origin(i) for i, ok in enumerate(pool.have_attr(REF_MODEL_ATTR)) if not ok})
    if missing:
        raise ValueError(
            f"ref_model= scores replies for KL env wrappers, but envs {missing} have none (no RefLogProbs in their "
            "wrapper chain): wrap them as KLPenalty(RefLogProbs(env), kl), or drop ref_model"
        )


def _check_policy(policy: Any, pool: EnvPool) -> None:
    if not getattr(policy, "generate", False):
        raise ValueError("rollout needs a generating policy (generate=True)")
    if getattr(policy, "num_samples", None) is not None:
        raise ValueError("rollout samples one reply per observation; use a policy without num_samples")
    if pool.input_mode != getattr(policy, "input_mode", None):
        raise ValueError(
            f"the envs use input_mode={pool.input_mode!r} but the policy {getattr(policy, 'input_mode', None)!r}; "
            "make them match"
        )


#: what :func:`rollout` drives: one env (or a wrapper of one), a list of them, or a Gymnasium vector env
Envs: TypeAlias = gym.Env[Any, Any] | Sequence[gym.Env[Any, Any]] | gym.vector.VectorEnv[Any, Any, Any]


def rollout(
    env: Envs,
    policy: RolloutPolicy,
    *,
    episodes: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    max_workers: int | None = None,
    ref_model: Any = None,
    step_timeout: float | str | None = "default",
    group_size: int | None = None,
    reset_options: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    on_episode: Callable[[TensorDict], Any] | None = None,
    mode: str = "sync",
    max_staleness: int | None = None,
    stale: str = "flag",
    in_flight: int | str | None = "auto",
    on_turn: Callable[[Any, int, int], Any] | None = None,
) -> TensorDict:
    """Run episodes (or a number of transitions) and return every transition.

    Args:
        env: A :class:`~chatenv.envs.ChatEnv` (or a wrapper of one), a list of them, or a Gymnasium vector env
            (wrapped by Gymnasium vector wrappers or not).
        policy: A generating policy (:class:`~chatenv.protocols.RolloutPolicy`) whose ``input_mode`` matches
            the envs'.
        episodes: Complete this many episodes (no more are started).
        steps: Or collect this many transitions (episodes in progress at the end are left unfinished).
        seed: Seed of the first reset (env i of a list gets ``seed + i``; later resets continue each env's
            generator).
        max_workers: Threads stepping a list of envs (default: one per env).
        ref_model: A :class:`~chatenv.protocols.ReferenceScorer` whose log-probs of each turn's generated tokens
            are computed here, in one batch per round, and handed to the envs' KL wrappers with the actions. Use
            it with vector envs whose sub-envs are wrapped as ``KLPenalty(RefLogProbs(env), ...)`` (no model in
            the env processes). Without it, envs in a list that share a reference (found with
            ``env.get_wrapper_attr("ref_model")``) are batched the same way automatically.
        step_timeout: Seconds a round of env steps may take (lists of envs; with ``mode="async"``, each env's
            step); past it :class:`~chatenv.errors.StepTimeout` names the env, with what was collected in
            ``err.partial``. Default ``"default"``: 600 s for lists of envs (a reward or tool that never returns
            cannot block a rollout forever), none for a vector env; ``None`` waits forever.
        group_size: Run episodes in groups of this many that start from the same reset (same seed, same
            options): G samples of one problem, as GRPO needs. Episode ``k`` is in group ``k // group_size``,
            recorded in the ``group`` column; group ``g`` resets with ``seed + g``.
        reset_options: ``reset(options=...)`` for every episode (a dict), or one dict per group (per episode
            without ``group_size``), e.g. ``{"messages": [...], "answer": 42}`` to pin the problems.
        on_episode: Called with each episode's TensorDict (its turns, the same layout) as soon as it ends, e.g.
            to save it; episodes come in the order they end.
        mode: ``"sync"`` (default): rounds, one batched policy call per round for every env mid-episode.
            ``"async"``: every episode's next reply is requested as soon as its step returns (a list of envs and a
            policy with ``submit``, an :class:`~chatenv.protocols.AsyncRolloutPolicy`); same result layout.
        max_staleness: Transitions generated more than this many versions before ``policy.version`` (read when the
            result, or an ``on_episode`` episode, is assembled) are stale; needs a policy with ``version``.
        stale: What happens to stale transitions: ``"flag"`` (default) keeps them and adds a ``stale`` column;
            ``"drop"`` leaves them out.
        in_flight: With ``mode="async"``: episodes run at once. Beyond the envs given, they run on forks of them
            (``chatenv.fork(env, episode=False)``: same task, tokenizer, tools and reference model, no episode
            state; closed at the end), so new episodes start while others wait for replies and the engine's batch
            stays full. ``"auto"`` (default): twice the envs, at most the episodes (or steps) asked for; an int:
            that many (at least the number of envs); ``None``: the envs given only. Episodes on a fork report the
            env it was forked from in ``env_index``; Gymnasium wrappers' statistics on your envs count only the
            episodes they ran. Ignored with ``mode="sync"`` unless given as an int (an error).
        on_turn: Called as ``on_turn(env, episode, turn)`` each time an episode goes on to its next turn (after a
            step that did not end it, before the next reply is asked for), in the collecting thread, with the env
            that runs it: e.g. ``chatenv.fork(env)`` there keeps a branch point of turn ``turn`` (see
            :func:`~chatenv.rollout.branch_rollout`). Lists of envs only.

    Returns:
        A TensorDict of batch ``(N,)``, one row per transition.

    Raises:
        BaseException: Whatever stops the collection (a raising task, a dead reference actor, a timeout, Ctrl-C)
            is re-raised with what was collected before it attached: ``err.partial`` (the TensorDict of the
            transitions so far) and, when one env's step failed, ``err.env_index``.
    """
    plan = EpisodePlan.make(
        episodes=episodes, steps=steps, seed=seed, group_size=group_size, reset_options=reset_options
    ).drawn()
    budget = Budget.of(plan)
    _check_mode(mode, policy, max_staleness, stale)
    pool = make_pool(env, max_workers, step_timeout, _in_flight(in_flight, mode, env, budget))
    try:
        _check_policy(policy, pool)
        _check_reference(ref_model, pool)
        finish = _finisher(policy, budget.group_size is not None, max_staleness, stale)
        emit = None if on_episode is None else (lambda ts: on_episode(finish(ts)))
        kind = AsyncCollector if mode == "async" else Collector
        collector = kind(pool, policy, budget, ref_model, emit)
        if on_turn is not None and not isinstance(pool, ListPool):
            raise ValueError("on_turn hands over the envs themselves: pass a list of envs, not a vector env")
        collector.on_turn = on_turn
        try:
            collector.run(plan.seed)
        except BaseException as e:
            _attach_partial(e, collector.collected(), finish)
            raise
    finally:
        pool.close()
    return finish(collector.collected())


def _in_flight(in_flight: Any, mode: str, env: Any, budget: Budget) -> int | None:
    """How many envs the pool holds (forks beyond the envs given; None: the envs given)."""
    n = len(env) if isinstance(env, (list, tuple)) else 1
    if isinstance(in_flight, str) and in_flight == "auto":
        if mode != "async" or isinstance(env, gym.vector.VectorEnv):
            return None
        limit = budget.episodes if budget.episodes is not None else budget.steps or 0
        return max(n, min(2 * n, limit))
    if in_flight is None:
        return None
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight must be a positive int, 'auto' or None, got {in_flight!r}")
    if mode != "async":
        raise ValueError(
            "in_flight sets how many episodes run at once with mode='async'; mode='sync' runs one per env: pass "
            "more envs, or use mode='async'"
        )
    if in_flight < n:
        raise ValueError(f"in_flight={in_flight} is fewer than the {n} envs given: pass fewer envs")
    return in_flight


def _check_mode(mode: Any, policy: Any, max_staleness: Any, stale: Any) -> None:
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be 'sync' or 'async', got {mode!r}")
    if mode == "async" and not callable(getattr(policy, "submit", None)):
        raise TypeError(
            f"mode='async' needs a policy that takes requests one at a time (submit(), an AsyncRolloutPolicy such as "
            f"TransformersWrapper or VLLMWrapper); {type(policy).__name__} has none: use mode='sync'"
        )
    if stale not in STALE_POLICIES:
        raise ValueError(f"stale must be one of {STALE_POLICIES}, got {stale!r}")
    if max_staleness is None:
        return
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness must be an int >= 0 or None, got {max_staleness!r}")
    if not isinstance(getattr(policy, "version", None), int):
        raise ValueError(
            f"max_staleness compares policy versions, but {type(policy).__name__} has no int version attribute"
        )


def _finisher(
    policy: RolloutPolicy, groups: bool, max_staleness: int | None, stale: str
) -> Callable[[list[Transition]], TensorDict]:
    """Transitions into the result: :func:`assemble` (the policy's layout), then the staleness rule now."""
    layout = layout_of(policy)

    def finish(transitions: list[Transition]) -> TensorDict:
        td = assemble(transitions, layout, groups=groups)
        if max_staleness is not None:
            td = apply_staleness(td, policy.version, max_staleness, stale)  # type: ignore[attr-defined]
        return td

    return finish


def _attach_partial(
    error: BaseException, transitions: list[Transition], finish: Callable[[list[Transition]], TensorDict]
) -> None:
    """Hand the transitions collected before ``error`` to whoever catches it."""
    try:
        error.partial = finish(transitions)  # type: ignore[attr-defined]
    except Exception:  # never mask the original failure
        return
    index = getattr(error, "env_index", None)
    where = f" (env {index})" if index is not None else ""
    if hasattr(error, "add_note"):
        error.add_note(f"rollout failed{where}; the {len(transitions)} transitions collected before are in err.partial")
