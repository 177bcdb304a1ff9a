"""Credit per turn: returns-to-go, per-turn advantages, and per-token advantages aligned with the assistant mask.

All functions take an episode view (:func:`chatenv.episodes`: ``turn_reward``, ``turn_start``, ``turn_length``,
``tokens``, and ``group`` when episodes were grouped or branched).

The return-to-go of turn ``t`` of episode ``e`` is ``G[e, t] = sum_{u >= t} gamma**(u - t) * r[e, u]``. Turn ``t``
of episode ``e`` is compared with turn ``t`` of the other episodes of its group (the same reset, or the branches of
one point: their turns are aligned). Two estimators:

- ``baseline="loo"`` (default): the baseline of ``G[e, t]`` is the mean of ``G[e', t]`` over the *other* episodes
  ``e'`` of the group, where an episode that ended before turn ``t`` counts with ``G = 0`` (it sits in an absorbing
  state that pays nothing). The baseline then depends neither on ``e``'s own actions nor on which episodes the
  model chose to keep going, so ``(G - b) * grad log pi`` is an unbiased policy-gradient estimate, also when the
  model decides when to stop.
- ``baseline="survivors"``: the group mean (own episode included) over the episodes still running at turn ``t``,
  as per-turn group normalisation is often done; simple, but biased when stopping is the model's choice (the
  surviving set depends on the actions).

With ``scale=True`` advantages are divided by the standard deviation of the compared returns (+ ``eps``).

Branch credit (:func:`branch_values`, :func:`value_advantages`) estimates the value of each state between turns
from continuations sampled there (:func:`~chatenv.rollout.branch_rollout` on forks kept during the rollout) and
gives turn ``t`` the advantage ``r[e, t] + gamma * V[e, t + 1] - V[e, t]``: what the reply changed in the expected
return, Monte-Carlo style (as VinePPO does). ``V[e, 0]`` is the leave-one-out mean return of the other episodes of
the group (they start from the same reset), and the state after the last turn is worth 0. A lone episode (a group
of one) has no other episode to value its opening with, so its first turn gets 0, as :func:`group_advantages`
gives a group of one; its later turns are credited from the values sampled at their states (0 where none were).
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "BASELINES",
    "branch_values",
    "group_advantages",
    "token_advantages",
    "turn_advantages",
    "turn_returns",
    "value_advantages",
]

BASELINES = ("loo", "survivors")


def group_advantages(
    rewards: Any, groups: Any = None, *, scale: bool = True, eps: float = 1e-4, clamp: bool = False
) -> torch.Tensor:
    """Episode advantages: each reward minus its group's mean, over the group's standard deviation.

    Args:
        rewards: ``(E,)`` episode rewards (finite).
        groups: ``(E,)`` group of each episode (default: one group for all).
        scale: Divide by the group's (unbiased) standard deviation; ``False`` only centres (as Dr. GRPO).
        eps: ``std + eps`` is the divisor, or with ``clamp`` ``max(std, eps)`` (TorchRL's ``MCAdvantage``).
        clamp: See ``eps``.

    Returns:
        ``(E,)`` float32 advantages; 0 for a group of one, and for a group whose rewards are all equal.

    Raises:
        ValueError: For rewards that are not finite, or groups of another length.

    Example:
        >>> [round(a, 3) for a in group_advantages([1.0, 0.0, 0.0, 0.0, 2.0, 2.0], [0, 0, 0, 0, 1, 1]).tolist()]
        [1.5, -0.5, -0.5, -0.5, 0.0, 0.0]
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).reshape(-1)
    if not torch.isfinite(r).all():
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    g = torch.zeros(len(r), dtype=torch.long) if groups is None else torch.as_tensor(groups).reshape(-1)
    if len(g) != len(r):
        raise ValueError(f"{len(r)} rewards but {len(g)} group ids; give one of each per episode")
    out = torch.zeros_like(r)
    for group in torch.unique(g):
        rows = g == group
        if int(rows.sum()) < 2:
            continue
        centred = r[rows] - r[rows].mean()
        if scale:
            std = r[rows].std()
            centred = centred / (std.clamp_min(eps) if clamp else std + eps)
        out[rows] = centred
    return out


def _rows(value: torch.Tensor) -> list[torch.Tensor]:
    """Per episode, the values of its turns (NaN/-1 padding removed, nested rows unbound)."""
    if value.is_nested:
        return list(value.unbind())
    if value.dtype.is_floating_point:
        return [row[~torch.isnan(row)] for row in value]
    return [row[row >= 0] for row in value]


def turn_returns(view: Any, gamma: float = 1.0) -> list[torch.Tensor]:
    """Per episode, the return-to-go of each of its turns (``(turns,)`` float32).

    Raises:
        ValueError: For ``gamma`` outside [0, 1] or a non-finite turn reward.
    """
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")
    out = []
    for e, rewards in enumerate(_rows(view["turn_reward"])):
        rewards = rewards.float()
        if not torch.isfinite(rewards).all():
            raise ValueError(f"episode {e} has a non-finite turn reward: {rewards.tolist()}")
        g = torch.zeros_like(rewards)
        running = 0.0
        for t in range(len(rewards) - 1, -1, -1):
            running = float(rewards[t]) + gamma * running
            g[t] = running
        out.append(g)
    return out


def turn_advantages(
    view: Any, *, gamma: float = 1.0, baseline: str = "loo", scale: bool = True, eps: float = 1e-4
) -> list[torch.Tensor]:
    """Per episode, the advantage of each of its turns (``(turns,)`` float32); see the module's description.

    A turn compared with no other episode (a group of one) gets 0.

    Raises:
        ValueError: For an unknown ``baseline`` or a bad ``gamma``.
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    returns = turn_returns(view, gamma)
    groups = view["group"].tolist() if "group" in view.keys() else [0] * len(returns)
    members: dict[int, list[int]] = {}
    for e, g in enumerate(groups):
        members.setdefault(int(g), []).append(e)
    out = [torch.zeros_like(r) for r in returns]
    for episodes in members.values():
        horizon = max(len(returns[e]) for e in episodes)
        table = torch.zeros(len(episodes), horizon)  # ended episodes: return-to-go 0 (absorbing)
        alive = torch.zeros(len(episodes), horizon, dtype=torch.bool)
        for k, e in enumerate(episodes):
            table[k, : len(returns[e])] = returns[e]
            alive[k, : len(returns[e])] = True
        for k, e in enumerate(episodes):
            for t in range(len(returns[e])):
                pool = torch.ones(len(episodes), dtype=torch.bool) if baseline == "loo" else alive[:, t].clone()
                if baseline == "loo":
                    pool[k] = False
                if not pool.any() or (baseline == "survivors" and int(pool.sum()) < 2):
                    continue
                compared = table[pool, t]
                advantage = float(returns[e][t]) - float(compared.mean())
                if scale:
                    spread = table[:, t] if baseline == "loo" else compared
                    advantage /= float(spread.std(unbiased=False)) + eps
                out[e][t] = advantage
    return out


def token_advantages(view: Any, per_turn: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per episode, a ``(full length,)`` float32 tensor: each turn's advantage on that reply's tokens, 0 elsewhere.

    It lines up with ``view["masks"].unpadded()`` and ``view["tokens"].unpadded("full")`` (the prompt, the env's
    tokens and padding get 0).

    Raises:
        ValueError: If ``per_turn`` does not hold one value per turn of each episode.
    """
    prompts = view["tokens"].unpadded("prompt")
    fulls = view["tokens"].unpadded("full")
    starts, lengths = _rows(view["turn_start"]), _rows(view["turn_length"])
    if len(per_turn) != len(prompts):
        raise ValueError(f"per_turn has {len(per_turn)} episodes, the view {len(prompts)}")
    out = []
    for e, (values, start, length) in enumerate(zip(per_turn, starts, lengths)):
        if len(values) != len(start):
            raise ValueError(f"episode {e} has {len(start)} turns but {len(values)} advantages")
        dense = torch.zeros(len(fulls[e]))
        offset = len(prompts[e])
        for value, s, n in zip(values.tolist(), start.tolist(), length.tolist()):
            if not math.isfinite(value):
                raise ValueError(f"episode {e} has a non-finite advantage {value}")
            dense[offset + s : offset + s + n] = value
        out.append(dense)
    return out


def branch_values(view: Any, points: list[tuple[int, int]], branches: Any, *, gamma: float = 1.0) -> list[torch.Tensor]:
    """Per episode of ``view``, a ``(turns,)`` tensor of Monte-Carlo state values (NaN where none was sampled).

    Args:
        view: The episodes (:func:`chatenv.episodes`); their ``episode`` column names them.
        points: Per branch point, ``(episode, turn)``: the state of that episode before its reply ``turn``.
        branches: :func:`chatenv.episodes` of ``branch_rollout(forks_of_the_points, policy, n)`` (its ``group``
            is the point's index in ``points``), or None without points.
        gamma: Discount (as in :func:`turn_returns`).

    Returns:
        ``V[e][t]``: the mean discounted return of the branches from point ``(episode e, turn t)``; entry 0 and
        turns without a point are NaN.

    Raises:
        ValueError: For a point naming an episode or turn the view does not hold.
    """
    ids = view["episode"].tolist()
    turns = [len(r) for r in _rows(view["turn_reward"])]
    values = [torch.full((n,), math.nan) for n in turns]
    returns = [] if branches is None else [float(r[0]) if len(r) else 0.0 for r in turn_returns(branches, gamma)]
    groups = branches["group"].tolist() if returns else []
    sums: dict[int, list[float]] = {}
    for g, value in zip(groups, returns):
        sums.setdefault(int(g), []).append(value)
    for p, (episode, turn) in enumerate(points):
        if episode not in ids:
            raise ValueError(f"branch point {p} names episode {episode}, which the view does not hold")
        e = ids.index(episode)
        if not 0 < turn < turns[e]:
            raise ValueError(f"branch point {p}: episode {episode} has no turn {turn} after its first")
        if p in sums:
            values[e][turn] = sum(sums[p]) / len(sums[p])
    return values


def value_advantages(
    view: Any, values: list[torch.Tensor], *, gamma: float = 1.0, scale: bool = True, eps: float = 1e-4
) -> list[torch.Tensor]:
    """Per episode, ``r[t] + gamma * V[t + 1] - V[t]`` for each turn (see the module's description).

    ``V[0]`` is the leave-one-out mean return of the other episodes of the group; a turn whose value was not sampled
    (NaN in ``values``) uses the episode's own return-to-go there, so without sampled values a turn's advantage is
    that of its whole episode against the rest of the group, on its first turn. A lone episode (a group of one) has
    no estimate of ``V[0]``: its first turn gets 0 (as :func:`group_advantages` gives a group of one), and so does
    every later turn whose state was not branched from.

    With ``scale``, a group's advantages are divided by their root mean square over every turn of the group
    (+ ``eps``): their spread around 0, which is what a baseline makes their mean (with ``gamma=1`` they sum to 0
    over a group of two or more, and this is their standard deviation). Branch values can make the advantages of a
    group whose returns are all equal nonzero, so the returns' spread (0 there) cannot be the scale; dividing by
    the root mean square keeps every scaled advantage within ``sqrt(turns of the group)`` in size, and a group
    whose advantages are all 0 keeps 0.

    Raises:
        ValueError: If ``values`` does not hold one entry per turn of each episode.

    Example:
        >>> from tensordict import TensorDict
        >>> lone = TensorDict({"turn_reward": torch.tensor([[0.75]]), "group": torch.tensor([0])}, [1])
        >>> value_advantages(lone, [torch.tensor([math.nan])])[0].tolist()
        [0.0]
    """
    returns = turn_returns(view, gamma)
    rewards = _rows(view["turn_reward"])
    if len(values) != len(returns) or any(len(v) != len(g) for v, g in zip(values, returns)):
        raise ValueError("values must hold one (turns,) tensor per episode of the view (branch_values gives it)")
    groups = view["group"].tolist() if "group" in view.keys() else list(range(len(returns)))
    members: dict[int, list[int]] = {}
    for e, g in enumerate(groups):
        members.setdefault(int(g), []).append(e)
    out = []
    for e, (g_e, r_e, v_e) in enumerate(zip(returns, rewards, values)):
        others = [float(returns[f][0]) if len(returns[f]) else 0.0 for f in members[int(groups[e])] if f != e]
        v = torch.where(torch.isnan(v_e), g_e, v_e.float())
        after = torch.cat([v[1:], torch.zeros(1)]) if len(v) else v
        if len(v):  # a lone episode: V[0] is its first turn's own outcome, so that turn's advantage is 0
            v[0] = sum(others) / len(others) if others else float(r_e[0]) + gamma * float(after[0])
        out.append(r_e.float() + gamma * after - v)
    if scale:  # by the root mean square of the group's advantages: bounded, also when their spread is 0
        for episodes in members.values():
            both = torch.cat([out[e] for e in episodes])
            rms = float(both.square().mean().sqrt()) if len(both) else 0.0
            for e in episodes:
                out[e] = out[e] / (rms + eps)
    return out
