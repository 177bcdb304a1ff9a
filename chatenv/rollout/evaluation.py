"""Evaluation metrics over episode records: pass@k from samples of a problem, success and reward by turn.

The records are the JSON dicts of :mod:`chatenv.rollout.records` (``group``, ``success``, ``task_rewards``, ...).
``chatenv rollout --group-size`` reports :func:`pass_at_k_by_group`; ``chatenv eval`` and ``chatenv train
--eval-every`` report :func:`summarize` of their held-out episodes. Held-out seeds never repeat a training seed, but
a small task space (one-digit additions: 100 problems) repeats its problems across seeds: :func:`problem_text`
tells problems apart by their opening chat, and :func:`seen_split` counts held-out problems a run trained on.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from tensordict import TensorDict

__all__ = [
    "first_success_turns",
    "k_values",
    "pass_at_k",
    "pass_at_k_by_group",
    "problem_text",
    "reward_by_turn",
    "seen_split",
    "success_by_turn",
    "summarize",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from ``n`` samples of which ``c`` succeeded: ``1 - C(n - c, k) / C(n, k)``.

    The probability that at least one of ``k`` samples drawn without replacement from the ``n`` succeeds.

    Example:
        >>> pass_at_k(4, 1, 1), pass_at_k(4, 1, 2), pass_at_k(4, 0, 4), pass_at_k(4, 3, 2)
        (0.25, 0.5, 0.0, 1.0)

    Raises:
        ValueError: Unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_by_group(episodes: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[int, float]:
    """Mean over groups of :func:`pass_at_k` (each group's episodes are samples of one problem).

    Args:
        episodes: Episode dicts with ``group`` and ``success`` (as the episode records write them).
        ks: The k values; a group counts for a k when it holds at least k episodes (an interrupted run may
            leave its last groups short).

    Returns:
        ``{k: pass@k}`` for each k that at least one group allows.

    Example:
        >>> eps = [{"group": 0, "success": s} for s in (True, False)] + [{"group": 1, "success": False}]
        >>> pass_at_k_by_group(eps, [1, 2])
        {1: 0.25, 2: 1.0}
    """
    groups: dict[int, list[bool]] = {}
    for e in episodes:
        if "group" in e:
            groups.setdefault(e["group"], []).append(bool(e.get("success")))
    out = {}
    for k in ks:
        values = [pass_at_k(len(s), sum(s), k) for s in groups.values() if len(s) >= k]
        if values:
            out[k] = statistics.mean(values)
    return out


def k_values(samples: int) -> list[int]:
    """1, 2, 4, ... below ``samples``, and ``samples`` itself: the k of the pass@k a report shows.

    Example:
        >>> k_values(1), k_values(6), k_values(8)
        ([1], [1, 2, 4, 6], [1, 2, 4, 8])
    """
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return [*ks, samples]


def first_success_turns(td: TensorDict, success_threshold: float = 1.0) -> dict[int, int | None]:
    """Per episode number of a rollout, the first turn (1-based) answered correctly, or None.

    A turn succeeds as the episode records count it (:func:`~chatenv.rollout.records.episode_records`): the task's
    ``correct`` component is 1, or, for tasks without one, the turn's task reward is at least ``success_threshold``.
    """
    from chatenv.rollout.records import episode_records

    out: dict[int, int | None] = {int(e): None for e in td.get("episode").tolist()}
    turn = td.get("turn")
    for t in sorted(set(turn.tolist())):
        for record in episode_records(td[turn == t], success_threshold=success_threshold):
            if record.success and out[record.episode] is None:
                out[record.episode] = t + 1
    return out


def success_by_turn(first_success: Sequence[int | None], turns: int) -> list[float]:
    """Fraction of episodes answered correctly by turn 1, 2, ..., ``turns`` (from their first successful turn).

    Example:
        >>> success_by_turn([1, 2, None, 1], 2)
        [0.5, 0.75]
    """
    n = len(first_success)
    return [sum(f is not None and f <= t for f in first_success) / n if n else math.nan for t in range(1, turns + 1)]


def reward_by_turn(task_rewards: Sequence[Sequence[float | None]], turns: int) -> list[float]:
    """Mean task reward collected by turn 1, 2, ..., ``turns`` (an episode that ended keeps its total).

    Example:
        >>> reward_by_turn([[1.0], [0.1, 1.1], [0.0, None]], 2)
        [0.3666666666666667, 0.7333333333333334]
    """
    n = len(task_rewards)
    return [sum(sum(r or 0.0 for r in e[:t]) for e in task_rewards) / n if n else math.nan for t in range(1, turns + 1)]


def problem_text(record: Mapping[str, Any]) -> str | None:
    """The problem an episode record was posed: its chat up to the first reply (the reset's messages), as JSON text.

    None for a record without a chat (an episode that did not end).

    Example:
        >>> chat = [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]
        >>> problem_text({"messages": chat})
        '[{"content": "2+3?", "role": "user"}]'
    """
    messages = record.get("messages")
    if not messages:
        return None
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return json.dumps(messages[:first], sort_keys=True, ensure_ascii=False)


def seen_split(episodes: Sequence[Mapping[str, Any]], seen: set[str]) -> dict[str, Any]:
    """How many problems (groups) of ``episodes`` are among the ``seen`` ones, and the success rate on the rest.

    Args:
        episodes: Episode dicts with ``group``, ``success`` and ``messages``.
        seen: :func:`problem_text` of the problems trained on.

    Returns:
        ``seen_in_training`` (problems whose text is in ``seen``) and ``success_unseen`` (mean success over the
        episodes of the other problems; None when every problem was seen).

    Example:
        >>> ep = lambda g, q, s: {"group": g, "success": s, "messages": [{"role": "user", "content": q}]}
        >>> trained = {problem_text(ep(0, "1+1?", False))}
        >>> seen_split([ep(0, "1+1?", True), ep(1, "2+2?", False), ep(2, "3+3?", True)], trained)
        {'seen_in_training': 1, 'success_unseen': 0.5}
    """
    known = {e["group"] for e in episodes if problem_text(e) in seen}
    unseen = [bool(e["success"]) for e in episodes if e["group"] not in known]
    return {
        "seen_in_training": len(known),
        "success_unseen": float(statistics.mean(unseen)) if unseen else None,
    }


def summarize(episodes: Sequence[Mapping[str, Any]], samples: int, turns: int) -> dict[str, Any]:
    """The numbers of an evaluation: success, pass@k, success and reward by turn, reply length.

    Args:
        episodes: Episode dicts with ``group`` (the problem), ``success``, ``first_success`` (turn or None),
            ``task_rewards`` and ``response_tokens``; ``samples`` of them per group.
        samples: Samples per problem (the largest k).
        turns: Turns an episode may take (the length of the by-turn lists).

    Returns:
        ``episodes``, ``problems`` (groups: one per reset seed), ``distinct_problems`` (different opening chats by
        :func:`problem_text`; None when an episode has no chat), ``samples``, ``success`` (the mean over episodes,
        pass@1), ``pass_at_k`` (``{k: value}`` for :func:`k_values`), ``success_by_turn``, ``reward_by_turn``,
        ``reward`` (mean total task reward), ``turns`` (mean turns taken) and ``response_tokens`` (mean generated
        tokens per episode).
    """
    n = len(episodes)
    texts = {problem_text(e) for e in episodes}
    return {
        "episodes": n,
        "problems": len({e["group"] for e in episodes}),
        "distinct_problems": None if None in texts else len(texts),
        "samples": samples,
        "success": float(statistics.mean(bool(e["success"]) for e in episodes)) if n else math.nan,
        "pass_at_k": pass_at_k_by_group(episodes, k_values(samples)),
        "success_by_turn": success_by_turn([e["first_success"] for e in episodes], turns),
        "reward_by_turn": reward_by_turn([e["task_rewards"] for e in episodes], turns),
        "reward": statistics.mean(sum(r or 0.0 for r in e["task_rewards"]) for e in episodes) if n else math.nan,
        "turns": float(statistics.mean(len(e["task_rewards"]) for e in episodes)) if n else math.nan,
        "response_tokens": float(statistics.mean(sum(e["response_tokens"]) for e in episodes)) if n else math.nan,
    }
