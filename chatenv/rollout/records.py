"""Episodes as JSON lines: the one record every episode JSONL of the project is written in, and read back with.

``chatenv rollout`` and ``chatenv train`` write ``episodes.jsonl`` with it, and the capture endpoint's
``GET /v1/sessions/{id}?format=jsonl`` gives one per segment. A record is one JSON object:

============================  ===================  ==============================================================
key                           type                 value
============================  ===================  ==============================================================
``episode``                   int                  the episode's number (in the run, or the segment's in a session)
``group``                     int                  its group (rollouts with ``group_size``)                     [1]
``env_index``                 int                  the env that ran it                                          [1]
``session``, ``segment``      str, int             the capture session and the segment's index in it             [1]
``step``                      int                  the training step that collected it (``chatenv train``)      [1]
``prompt``                    list[int]            the first prompt's ids                                       [2]
``completion``                list[int]            every later id: replies and the env's messages               [2]
``assistant_mask``            list[bool]           over ``prompt + completion``: the ids the policy generated     [2]
``log_probs``                 list[float | None]   over ``completion``: generation log-probs (None off the replies)
``turn_start``                list[int]            per turn, where its reply starts in ``completion``            [2]
``response_tokens``           list[int]            per turn, its reply's length (the reply is
                                                   ``completion[turn_start[t] : turn_start[t] + response_tokens[t]]``)
``rewards``                   list[float]          per turn, the env's reward (KL-shaped with a KL penalty)
``task_rewards``              list[float | None]   per turn, the task's reward (``rewards`` without a KL penalty)
``kl``                        list[float | None]   per turn, the KL summed over its reply (None without KL)
``policy_version``            list[int | None]     per turn, the weights version that generated the reply         [1]
``reward``                    float                ``sum(rewards)``
``turns``                     int                  number of turns
``terminated``, ``truncated`` bool                 how the episode ended (both false: it did not end)
``messages``                  list[dict] | None    the env's own chat (None for an episode that did not end)
``success``                   bool                 a turn was answered correctly (``chatenv rollout``/``train``) [1]
``tool_calls``, ``tool_errors`` int                tool calls and failed calls (envs with tools)                  [1]
============================  ===================  ==============================================================

[1] absent when it does not apply (or is not known). [2] absent when the episode's turns do not form one token
chain (envs that re-render a context a template rewrote). Floats that are NaN are written as None. Keys a record
does not know are kept as they are (:attr:`EpisodeRecord.extra`), so reading a line and writing it again changes
nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch
from tensordict import TensorDict

from chatenv.containers import LogProbs, Masks, Tokens
from chatenv.padding import nested, pad_sequences
from chatenv.rollout.episode_view import episodes

__all__ = ["EpisodeRecord", "episode_records", "records_view"]

#: keys written only when they have a value
_OPTIONAL = (
    "env_index",
    "prompt",
    "completion",
    "assistant_mask",
    "log_probs",
    "turn_start",
    "group",
    "session",
    "segment",
    "step",
    "policy_version",
    "success",
    "tool_calls",
    "tool_errors",
)


@dataclass
class EpisodeRecord:
    """One episode as a JSON line (the module docstring lists the keys)."""

    episode: int
    rewards: list[float]
    task_rewards: list[float | None]
    kl: list[float | None]
    response_tokens: list[int]
    terminated: bool
    truncated: bool
    messages: list[dict[str, Any]] | None = None
    env_index: int | None = None
    prompt: list[int] | None = None
    completion: list[int] | None = None
    assistant_mask: list[bool] | None = None
    log_probs: list[float | None] | None = None
    turn_start: list[int] | None = None
    group: int | None = None
    session: str | None = None
    segment: int | None = None
    step: int | None = None
    policy_version: list[int | None] | None = None
    success: bool | None = None
    tool_calls: int | None = None
    tool_errors: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def turns(self) -> int:
        """Number of turns."""
        return len(self.rewards)

    @property
    def reward(self) -> float:
        """The episode's reward: the sum of its turns'."""
        return float(sum(self.rewards))

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON-ready dict (what one line of an episodes JSONL holds)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (f.name in _OPTIONAL and value is None):
                continue
            out[f.name] = value
        out["reward"], out["turns"] = self.reward, self.turns
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, row: Mapping[str, Any] | str) -> EpisodeRecord:
        """A record from one JSONL line (a dict, or its text).

        Raises:
            ValueError: If a required key is missing.
        """
        data = dict(json.loads(row) if isinstance(row, str) else row)
        known = {f.name for f in fields(cls)} - {"extra"}
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = [name for name in required if name not in data]
        if missing and {"turn_reward", "num_turns"} & set(data):
            raise ValueError(
                "this line is in the capture endpoint's earlier JSONL layout (turn_reward, num_turns, turn_length); "
                "episode records name them rewards, turns and response_tokens: fetch the session again with "
                "GET /v1/sessions/{id}?format=jsonl, or rename those keys"
            )
        if missing:
            raise ValueError(f"an episode record needs {missing}")
        derived = {k: data.pop(k) for k in ("reward", "turns") if k in data}
        values = {k: data.pop(k) for k in list(data) if k in known}
        record = cls(**values, extra=data)
        if derived.get("turns", record.turns) != record.turns:
            raise ValueError(f"turns={derived['turns']} but {record.turns} per-turn rewards")
        return record


def _float(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


def _column(td: TensorDict, key: Any) -> list[Any] | None:
    return td.get(key).reshape(-1).tolist() if key in td.keys(True, True) else None


def _turn_success(td: TensorDict, task: list[float], threshold: float) -> list[bool]:
    """Per row: the task's ``correct`` component is 1 where the turn reports one, else task reward >= threshold."""
    correct = _column(td, ("next", "reward_components", "correct")) or [math.nan] * len(task)
    return [t >= threshold if math.isnan(c) else c >= 1.0 for c, t in zip(correct, task)]


def _chains(td: TensorDict, by_episode: dict[int, list[int]]) -> dict[int, dict[str, Any]]:
    """Per episode number, its token chain (ids, mask, log-probs, reply offsets).

    An episode whose turns do not extend one chain (a re-rendered context) gets none; the others keep theirs.
    """
    try:
        return _view_chains(episodes(td))
    except ValueError:  # some episode does not chain: find which, one episode at a time
        out = {}
        for rows in by_episode.values():
            try:
                out.update(_view_chains(episodes(td[torch.tensor(rows)])))
            except ValueError:
                continue
        return out


def _view_chains(view: TensorDict) -> dict[int, dict[str, Any]]:
    tokens = view["tokens"]
    prompts, completions = tokens.unpadded("prompt"), tokens.unpadded("response")
    masks = view["masks"].unpadded() if "masks" in view.keys() else None
    lps = view["log_probs"].unpadded("response") if "log_probs" in view.keys() else None
    starts = view["turn_start"]
    out = {}
    for e, number in enumerate(view["episode"].tolist()):
        row = starts[e] if tokens.padded else starts.unbind()[e]
        out[number] = {
            "prompt": prompts[e].tolist(),
            "completion": completions[e].tolist(),
            "assistant_mask": None if masks is None else [bool(v) for v in masks[e].tolist()],
            "log_probs": None if lps is None else [_float(v) for v in lps[e].tolist()],
            "turn_start": [int(v) for v in row.tolist() if v >= 0],
        }
    return out


def _per_row(td: TensorDict, success_threshold: float | None) -> dict[str, list[Any] | None]:
    """The per-row values a record collects per turn."""
    rewards = td.get(("next", "reward")).reshape(-1).tolist()
    task = _column(td, ("next", "task_reward")) or rewards
    kl = td.get("kl").unpadded("response") if "kl" in td.keys() else None
    versions = _column(td, "policy_version")
    return {
        "rewards": [float(r) for r in rewards],
        "task_rewards": [_float(t) for t in task],
        "kl": None if kl is None else [float(sum(v for v in r.tolist() if not math.isnan(v))) for r in kl],
        "response_tokens": [len(r) for r in td.get("tokens").unpadded("response")],
        "policy_version": None if versions is None else [None if v < 0 else int(v) for v in versions],
        "success": None if success_threshold is None else _turn_success(td, task, success_threshold),
        "group": _column(td, "group"),
        "env_index": _column(td, "env_index"),
        "tool_calls": _column(td, ("next", "tool_calls")),
        "tool_errors": _column(td, ("next", "tool_errors")),
    }


def _record(td: TensorDict, rows: list[int], per_row: dict[str, list[Any] | None], chain: dict[str, Any]) -> Any:
    """One episode's record from its rows (by turn)."""

    def turns(key: str) -> list[Any] | None:
        values = per_row[key]
        return None if values is None else [values[k] for k in rows]

    last = rows[-1]
    chat = list(td["next", "chat"])[last] if ("next", "chat") in td.keys(True) else ""
    env_index = per_row["env_index"]
    success, calls, errors = turns("success"), turns("tool_calls"), turns("tool_errors")
    return EpisodeRecord(
        episode=int(td.get("episode")[last]),
        rewards=turns("rewards") or [],
        task_rewards=turns("task_rewards") or [],
        kl=turns("kl") or [None] * len(rows),
        response_tokens=turns("response_tokens") or [],
        terminated=bool(td.get(("next", "terminated"))[last, 0]),
        truncated=bool(td.get(("next", "truncated"))[last, 0]),
        messages=json.loads(chat) if chat else None,
        env_index=None if env_index is None else int(env_index[last]),
        group=None if per_row["group"] is None else int(per_row["group"][last]),
        policy_version=turns("policy_version"),
        success=None if success is None else any(success),
        tool_calls=None if calls is None else int(sum(calls)),
        tool_errors=None if errors is None else int(sum(errors)),
        **chain,
    )


def episode_records(
    td: TensorDict | None,
    *,
    first_episode: int | None = None,
    group_offset: int = 0,
    complete_only: bool = False,
    success_threshold: float | None = None,
) -> list[EpisodeRecord]:
    """One record per episode of a rollout TensorDict (:func:`chatenv.rollout`'s per-turn layout), by episode.

    Args:
        td: The rollout's rows (None gives no records).
        first_episode: Number the records from this (default: keep the rollout's episode numbers).
        group_offset: Added to the ``group`` column, so groups of several rollouts in one file keep distinct numbers.
        complete_only: Keep only episodes whose last turn ended them (for a partial rollout).
        success_threshold: Fill ``success``: a turn succeeds when the task's ``correct`` reward component is 1, or,
            for tasks without one, when its task reward is at least this.
    """
    if td is None or td.batch_size[0] == 0:
        return []
    by_episode: dict[int, list[tuple[int, int]]] = {}
    for k, (e, t) in enumerate(zip(td.get("episode").tolist(), td.get("turn").tolist())):
        by_episode.setdefault(e, []).append((t, k))
    done = td.get(("next", "done")).reshape(-1).tolist()
    per_row = _per_row(td, success_threshold)
    ordered = {e: [k for _, k in sorted(by_episode[e])] for e in sorted(by_episode)}
    chains = _chains(td, ordered)
    out: list[EpisodeRecord] = []
    for e, rows in ordered.items():
        if complete_only and not done[rows[-1]]:
            continue
        record = _record(td, rows, per_row, chains.get(e, {}))
        if record.group is not None:
            record.group += group_offset
        if first_episode is not None:
            record.episode = first_episode + len(out)
        out.append(record)
    return out


def _stack(values: list[torch.Tensor], padded: bool, fill: Any) -> torch.Tensor:
    return pad_sequences(values, "right", fill)[0] if padded else nested(values)


def _floats(values: Iterable[Any]) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)


def records_view(
    records: Iterable[EpisodeRecord | Mapping[str, Any] | str], *, padded: bool = True, pad_token_id: int = 0
) -> TensorDict:
    """The episode view (:func:`chatenv.episodes`'s layout) of records (records, dicts or JSON lines).

    Padded turn columns are filled as :func:`chatenv.episodes` fills them (-1 for offsets and versions, NaN for
    rewards); ``turn_version`` is set when every record has ``policy_version`` (None read as -1).

    Raises:
        ValueError: For a record without its token chain (``prompt`` is None).
    """
    rows = [r if isinstance(r, EpisodeRecord) else EpisodeRecord.from_json(r) for r in records]
    if any(r.prompt is None or r.completion is None or r.turn_start is None for r in rows):
        raise ValueError("a record without its token chain (prompt, completion, turn_start) has no episode view")
    out = TensorDict(batch_size=[len(rows)])
    prompts = [torch.tensor(r.prompt, dtype=torch.long) for r in rows]
    completions = [torch.tensor(r.completion, dtype=torch.long) for r in rows]
    tokens = Tokens.from_sequences(prompts, completions, padded=padded, pad_value=pad_token_id)
    out.set("tokens", tokens)
    if rows and all(r.assistant_mask is not None for r in rows):
        out.set("masks", Masks.from_tokens(tokens, [torch.tensor(r.assistant_mask, dtype=torch.bool) for r in rows]))
    if rows and all(r.log_probs is not None for r in rows):
        nan = [torch.full((len(p),), math.nan) for p in prompts]
        out.set("log_probs", LogProbs.from_sequences(nan, [_floats(r.log_probs or []) for r in rows], padded=padded))
    out.set("turn_start", _stack([torch.tensor(r.turn_start, dtype=torch.long) for r in rows], padded, -1))
    out.set("turn_length", _stack([torch.tensor(r.response_tokens, dtype=torch.long) for r in rows], padded, -1))
    out.set("turn_reward", _stack([_floats(r.rewards) for r in rows], padded, math.nan))
    if rows and all(r.policy_version is not None for r in rows):
        versions = [torch.tensor([-1 if v is None else v for v in r.policy_version or []]) for r in rows]
        out.set("turn_version", _stack([v.long() for v in versions], padded, -1))
    out.set("reward", torch.tensor([r.reward for r in rows], dtype=torch.float32))
    out.set("num_turns", torch.tensor([r.turns for r in rows], dtype=torch.long))
    out.set("terminated", torch.tensor([r.terminated for r in rows], dtype=torch.bool))
    out.set("truncated", torch.tensor([r.truncated for r in rows], dtype=torch.bool))
    out.set("episode", torch.tensor([r.episode for r in rows], dtype=torch.long))
    return out
