"""Session trajectories as chatenv's rollout data: per-turn transitions, TensorDicts and episode JSONL.

A session snapshot (:meth:`~chatenv.serve.sessions.Session.snapshot`, or ``GET /v1/sessions/{id}``) becomes one
transition per reply, exactly as :func:`chatenv.rollout` records a turn: the prompt is the segment's ids before
the reply, the response the generated ids, the assistant mask marks every generated id so far, the log-probs are
NaN on the prompt. :func:`session_tensordict` assembles them with :func:`chatenv.rollout.assemble.assemble` (one
segment = one episode), so :func:`chatenv.episodes` applies; :func:`session_records` writes it as episode
records (:mod:`chatenv.rollout.records`, the one episode JSONL schema) and :func:`episodes_from_records` reads them
back into the same TensorDict.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from chatenv.modes import ViewRow
from chatenv.protocols import OutputLayout, layout_of
from chatenv.rollout.assemble import assemble
from chatenv.rollout.collect import PolicyRow, Transition
from chatenv.rollout.episode_view import turns
from chatenv.rollout.pools import StepResult
from chatenv.rollout.records import episode_records as rollout_records
from chatenv.rollout.records import records_view

__all__ = [
    "Outcome",
    "episode_records",
    "episodes_from_records",
    "session_records",
    "session_tensordict",
    "session_transitions",
]


@dataclass
class Outcome:
    """How a session's last segment ended: its reward (on the last reply), flags and info for that transition."""

    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)


def _floats(values: Iterable[Any]) -> torch.Tensor:
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)


def _row(seg: Mapping[str, Any], turn: Mapping[str, Any], decode: Any) -> PolicyRow:
    start, end = turn["start"], turn["start"] + turn["length"]
    ids = seg["ids"]
    prompt, response = torch.tensor(ids[:start], dtype=torch.long), torch.tensor(ids[start:end], dtype=torch.long)
    assistant = torch.tensor(seg["assistant_mask"][:end], dtype=torch.bool)
    log_probs = (torch.full((start,), math.nan), _floats(seg["log_probs"][start:end]))
    view = ViewRow(prompt_chat=[dict(m) for m in turn["prompt_messages"]], reply=[dict(turn["reply"])])
    if decode is not None:
        view.prompt_text, view.response_text = decode(ids[:start]), decode(ids[start:end])
    return PolicyRow(prompt, response, assistant, log_probs, view, turn.get("policy_version"))


def session_transitions(
    snapshot: Mapping[str, Any],
    outcome: Outcome | None = None,
    *,
    first_episode: int = 0,
    env_index: int = 0,
    group: int = 0,
    decode: Any = None,
) -> list[Transition]:
    """One transition per reply of a session, by segment then turn (segment ``j`` is episode ``first_episode + j``).

    Args:
        snapshot: The session's JSON data.
        outcome: How the last segment ended (default: the session's posted rewards, not done).
        first_episode: Episode number of the first segment.
        env_index: Recorded in every transition.
        group: Recorded in every transition.
        decode: Ids to text (fills the text views), or None.

    Earlier segments end where the agent rewrote its history: their last transition is ``truncated`` with
    reward 0 and their chat in ``info["chat"]``.
    """
    if outcome is None:
        rewards = dict(snapshot.get("rewards") or {})
        outcome = Outcome(float(sum(rewards.values())), info={"reward_components": rewards} if rewards else {})
    segments = [s for s in snapshot["segments"] if s["turns"]]
    out = []
    for j, seg in enumerate(segments):
        last_segment = j == len(segments) - 1
        for i, turn in enumerate(seg["turns"]):
            result = StepResult(None, 0.0, False, False, {})
            if i == len(seg["turns"]) - 1:
                if last_segment:
                    result = StepResult(None, outcome.reward, outcome.terminated, outcome.truncated, dict(outcome.info))
                else:
                    result = StepResult(None, 0.0, False, True, {"chat": seg["messages"]})
            out.append(Transition(first_episode + j, i, env_index, _row(seg, turn, decode), result, group))
    return out


def session_tensordict(
    snapshot: Mapping[str, Any], *, pad_token_id: int = 0, padded: bool = True, policy: Any = None
) -> TensorDict:
    """The per-turn TensorDict of a session (as :func:`chatenv.rollout` lays it out), one episode per segment.

    Args:
        snapshot: The session's JSON data.
        pad_token_id: Padding id of the token tensors (when no ``policy`` gives one).
        padded: Padded (True) or nested layout.
        policy: Take the keys, padding and views from this policy instead.
    """
    layout = layout_of(policy) if policy is not None else OutputLayout(pad_token_id=pad_token_id, pad_output=padded)
    return assemble(session_transitions(snapshot), layout)


def episode_records(view: TensorDict, **extra: Any) -> list[dict[str, Any]]:
    """The rows of an episode view (:func:`chatenv.episodes`) as JSON-ready episode records, ``extra`` added.

    The records are :mod:`chatenv.rollout.records`'s (the one episode JSONL schema).
    """
    return [{**r.to_json(), **extra} for r in rollout_records(turns(view))]


def episodes_from_records(
    records: Iterable[Mapping[str, Any] | str], *, padded: bool = True, pad_token_id: int = 0
) -> TensorDict:
    """The episode view TensorDict of episode records (dicts or JSON lines), as :func:`chatenv.episodes` gives it.

    Padded turn columns are filled as :func:`chatenv.episodes` fills them (-1 for offsets, NaN for rewards), so a
    padded view read back equals the one written.
    """
    return records_view(records, padded=padded, pad_token_id=pad_token_id)


def session_records(snapshot: Mapping[str, Any], *, pad_token_id: int = 0) -> list[dict[str, Any]]:
    """A session as episode records (one per segment with replies), with the session id, segment and its chat."""
    records = rollout_records(session_tensordict(snapshot, pad_token_id=pad_token_id))
    segments = [s for s in snapshot["segments"] if s["turns"]]
    for k, record in enumerate(records):
        record.session, record.segment = snapshot["id"], k
        record.messages = [dict(m) for m in segments[k]["messages"]]
    return [r.to_json() for r in records]
