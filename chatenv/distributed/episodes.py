"""Episodes between processes: a worker's episode TensorDict back into transitions, and many into one TensorDict.

An env worker runs :func:`chatenv.rollout` and gets each finished episode as a TensorDict (``on_episode``). Episodes
of different workers cannot simply be concatenated (padded containers have per-episode widths), so the worker
sends the episode's *transitions* (:func:`episode_transitions`, the inverse of the rollout's assembly), and the
trainer's process renumbers them (:func:`renumber`) and assembles any number of them with the rollout's own
:func:`~chatenv.rollout.assemble.assemble`: the result has exactly the layout of a local rollout, plus a
``worker`` column.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from tensordict import TensorDict

from chatenv.rollout.assemble import assemble
from chatenv.rollout.collect import Transition, policy_rows
from chatenv.rollout.plan import EpisodePlan
from chatenv.rollout.pools import StepResult

__all__ = ["WORKER_KEY", "Chunk", "assemble_chunks", "episode_transitions", "renumber"]

#: the column naming the env worker that collected each row
WORKER_KEY = "worker"


@dataclass
class Chunk:
    """Transitions of finished episodes, globally numbered, and the worker of each."""

    transitions: list[Transition] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)

    def add(self, transitions: list[Transition], worker: int) -> None:
        """Append a worker's transitions."""
        self.transitions.extend(transitions)
        self.workers.extend([worker] * len(transitions))

    @property
    def episodes(self) -> int:
        """Number of distinct episodes held."""
        return len({t.episode for t in self.transitions})


def _column(td: TensorDict, key: Any) -> list[Any] | None:
    return td.get(key).reshape(-1).tolist() if key in td.keys(True) else None


def _per_token(td: TensorDict, key: str) -> list[Any] | None:
    if key not in td.keys():
        return None
    return [r.tolist() for r in td.get(key).unpadded("response")]  # lists: arrays from Ray are read-only


def _infos(td: TensorDict, n: int) -> list[dict[str, Any]]:
    """Per row, the ``info`` entries the assembly reads, from the columns it wrote."""
    infos: list[dict[str, Any]] = [{} for _ in range(n)]
    task = _column(td, ("next", "task_reward"))
    failed = _column(td, ("next", "reward_failed"))
    calls, errors = _column(td, ("next", "tool_calls")), _column(td, ("next", "tool_errors"))
    chats = list(td[("next", "chat")]) if ("next", "chat") in td.keys(True) else None
    components = td.get(("next", "reward_components"), None)
    names = list(components.keys()) if components is not None else []
    values = {name: components.get(name).reshape(-1).tolist() for name in names}
    ref, kl = _per_token(td, "ref_log_probs"), _per_token(td, "kl")
    for k, info in enumerate(infos):
        if task is not None:
            info["task_reward"] = task[k]
        if failed is not None and failed[k]:
            info["task_info"] = {"reward_error": True}
        if calls is not None and errors is not None:
            info["tool_turn"] = {"calls": calls[k], "errors": errors[k]}
        if chats is not None and chats[k]:
            info["chat"] = json.loads(chats[k])
        parts = {name: values[name][k] for name in names if not math.isnan(values[name][k])}
        if parts:
            info["reward_components"] = parts
        if ref is not None:
            info["ref_log_probs"] = ref[k]
        if kl is not None:
            info["kl"] = kl[k]
    return infos


def episode_transitions(td: TensorDict, policy: Any) -> list[Transition]:
    """The transitions a rollout TensorDict was assembled from (what assembling them again gives back).

    Args:
        td: Rows of a rollout (e.g. one episode, as ``rollout(..., on_episode=...)`` hands it over).
        policy: The policy (or a :class:`~chatenv.distributed.common.PolicySpec`) that wrote it.

    Returns:
        One :class:`~chatenv.rollout.collect.Transition` per row (observations are not kept: the rows hold the ids).
    """
    n = td.batch_size[0]
    if n == 0:
        return []
    rows = policy_rows(td, policy, n)
    infos = _infos(td, n)
    reward = td.get(("next", "reward")).reshape(-1).tolist()
    terminated = td.get(("next", "terminated")).reshape(-1).tolist()
    truncated = td.get(("next", "truncated")).reshape(-1).tolist()
    episode, turn, env = td.get("episode").tolist(), td.get("turn").tolist(), td.get("env_index").tolist()
    group = td.get("group").tolist() if "group" in td.keys() else [0] * n
    if "policy_version" not in td.keys():
        for row in rows:
            row.version = None
    return [
        Transition(
            episode[k],
            turn[k],
            env[k],
            rows[k],
            StepResult(None, reward[k], bool(terminated[k]), bool(truncated[k]), infos[k]),
            group[k],
        )
        for k in range(n)
    ]


def renumber(transitions: list[Transition], share: EpisodePlan) -> list[Transition]:
    """A worker's transitions with the collector's global episode, group and env numbers (its share's first ones)."""
    return [
        replace(
            t,
            episode=t.episode + share.first_episode,
            group=t.group + share.first_group,
            env_index=t.env_index + share.first_env,
        )
        for t in transitions
    ]


def assemble_chunks(chunk: Chunk, policy: Any, *, groups: bool) -> TensorDict:
    """One TensorDict (the layout of a local rollout, by episode then turn) with a ``worker`` column."""
    order = sorted(
        range(len(chunk.transitions)), key=lambda k: (chunk.transitions[k].episode, chunk.transitions[k].turn)
    )
    td = assemble([chunk.transitions[k] for k in order], policy, groups=groups)
    td.set(WORKER_KEY, torch.tensor([chunk.workers[k] for k in order], dtype=torch.long))
    return td
