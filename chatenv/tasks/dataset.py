"""Chats from a dataset: :class:`DatasetTask` (a list of records or a JSONL file, each with a reference answer)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from chatenv.messages import check_messages
from chatenv.rewards import exact_match, numeric_match, parse_number
from chatenv.tasks.base import RewardError, Task, TaskResponse, TaskStart, last_reply, positive_int

__all__ = ["DatasetTask"]

#: what a dataset can be: records, or the path of a JSONL file of records
Data = str | os.PathLike[str] | Sequence[Mapping[str, Any]]


def _load_records(data: Data) -> list[tuple[str, Any]]:
    """``(where, record)`` pairs: each record as given, with where it came from for error messages."""
    if isinstance(data, (str, os.PathLike)):
        records: list[tuple[str, Any]] = []
        with open(data, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append((f"{data}, line {n}", json.loads(line)))
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{data}, line {n}: not valid JSON ({e.msg})") from e
        return records
    if isinstance(data, (Mapping, str, bytes)) or not isinstance(data, Sequence):
        raise TypeError(f"data must be a list of records or a JSONL path, got {type(data).__name__}")
    return [(f"record {i}", r) for i, r in enumerate(data)]


_PROMPT_KEYS = ("prompt", "question")


def _check_record(where: str, record: Any) -> dict[str, Any]:
    """One dataset record, checked: ``messages`` (a chat) or ``prompt``/``question`` (a str), optional ``system``."""
    if not isinstance(record, Mapping):
        raise TypeError(f"{where}: a record must be a JSON object (dict), got {type(record).__name__}: {record!r:.60}")
    record = {str(k): v for k, v in record.items()}
    key = next((k for k in _PROMPT_KEYS if k in record), None)
    if "messages" in record:
        record["messages"] = check_messages(record["messages"], f"{where}: 'messages'")
    elif key is not None:
        if not isinstance(record[key], str):
            raise TypeError(f"{where}: '{key}' must be a str, got {record[key]!r:.60}")
    else:
        raise ValueError(f"{where}: a record needs 'messages', 'prompt' or 'question', got keys {sorted(record)}")
    if record.get("system") is not None and not isinstance(record["system"], str):
        raise TypeError(f"{where}: 'system' must be a str, got {record['system']!r:.60}")
    return dict(record)


class DatasetTask(Task):
    """Chats from a dataset (a list of dicts or a JSONL file), each with a reference answer.

    Each record has ``messages`` (a list of message dicts) or ``prompt`` / ``question`` (a user message's text),
    and optionally ``answer`` (the reference given to the reward function), ``system``, and anything else (e.g.
    ``metadata``; the whole record can go to the reward function).

    Args:
        data: Records, or a path to a JSONL file of records (default: a small built-in set of general-knowledge
            questions with short answers).
        reward_fn: ``fn(reply, answer) -> float`` or ``-> (float, components)`` (default: exact match of the
            extracted answer, numeric when both parse as numbers); ``fn(reply, record)`` with ``pass_record``.
        pass_record: Give ``reward_fn`` the whole record (a dict) instead of its ``answer``.
        instruction: Text added to the first user message (e.g. the answer format).
        max_attempts: Replies allowed; a reply with reward below ``success_threshold`` gets ``retry_message``.
        success_threshold: Reward at which the task ends successfully.
        retry_message: The user's reply after an unsuccessful attempt.
        on_reward_error: When ``reward_fn`` raises: ``"raise"`` (default; a :class:`RewardError` naming the reply,
            and the env is left as it was) or ``"record"`` (reward 0, the episode ends, ``info["reward_error"]``
            says why, and rollouts flag the transition in ``("next", "reward_failed")``).
    """

    description = "Generic chat env over a dataset of prompts with reference answers (list or JSONL)."

    def __init__(
        self,
        data: Data | None = None,
        reward_fn: Callable[[str, Any], Any] | None = None,
        max_attempts: int = 1,
        success_threshold: float = 1.0,
        retry_message: str = "That is not correct. Please try again.",
        on_reward_error: str = "raise",
        pass_record: bool = False,
        instruction: str | None = None,
    ):
        if data is None:
            data = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "qa.jsonl")
        self.records = [_check_record(where, r) for where, r in _load_records(data)]
        if not self.records:
            raise ValueError("DatasetTask needs at least one record: pass data=[...] or a JSONL path")
        if on_reward_error not in ("raise", "record"):
            raise ValueError(f"on_reward_error must be 'raise' or 'record', got {on_reward_error!r}")
        positive_int("max_attempts", max_attempts)
        if pass_record and reward_fn is None:
            raise ValueError("pass_record=True hands the record to reward_fn: give reward_fn=fn(reply, record)")
        if instruction is not None and not isinstance(instruction, str):
            raise TypeError(f"instruction must be a str, got {type(instruction).__name__}")
        self.reward_fn = reward_fn or _default_match
        self.pass_record = bool(pass_record)
        self.instruction = instruction
        self.on_reward_error = on_reward_error
        self.max_attempts = max_attempts
        self.success_threshold = success_threshold
        self.retry_message = retry_message
        self.default_max_turns = max_attempts

    def reset(self, rng: np.random.Generator) -> TaskStart:  # noqa: D102
        index = int(rng.integers(len(self.records)))
        return self._start(index)

    def _start(self, index: int) -> TaskStart:
        r = self.records[index]
        if "messages" in r:
            messages = [dict(m) for m in r["messages"]]
        else:
            messages = [{"role": "user", "content": r[next(k for k in _PROMPT_KEYS if k in r)]}]
        if self.instruction:
            first = next((m for m in messages if m["role"] == "user"), None)
            if first is not None:
                first["content"] = f"{first['content']}\n\n{self.instruction}"
        if r.get("system") is not None:
            messages.insert(0, {"role": "system", "content": r["system"]})
        return TaskStart(messages, {"answer": r.get("answer"), "index": index, "attempts": 0})

    def state_for(self, messages: list[dict[str, Any]], options: Mapping[str, Any]) -> Any:  # noqa: D102
        index = options.get("index")
        if index is not None and not (isinstance(index, int) and 0 <= index < len(self.records)):
            raise ValueError(f"options['index'] must be a record index in [0, {len(self.records)}), got {index!r}")
        answer = options.get("answer", None if index is None else self.records[index].get("answer"))
        return {"answer": answer, "index": index, "attempts": 0}

    def record(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The record an episode is about (for a chat given by options: ``options["index"]``, else its answer)."""
        if state.get("index") is not None:
            return self.records[int(state["index"])]
        return {"answer": state.get("answer")}

    def _reward_failed(self, what: str, reply: str, error: Exception) -> TaskResponse:
        if self.on_reward_error == "raise":
            raise RewardError(
                f"DatasetTask reward_fn {what} (reply {reply[:200]!r}); fix the reward function, or pass "
                "on_reward_error='record' to score such replies 0 and flag them"
            ) from error
        return TaskResponse(0.0, True, [], {}, {"reward_error": what})

    def respond(self, messages: list[dict[str, Any]], state: Any) -> TaskResponse:  # noqa: D102
        reply = last_reply(messages)
        state["attempts"] += 1
        try:
            value = self.reward_fn(reply, self.record(state) if self.pass_record else state["answer"])
        except Exception as e:
            return self._reward_failed(f"raised {type(e).__name__}: {e}", reply, e)
        try:
            total, parts = value if isinstance(value, tuple) else (float(value), {"reward": float(value)})
            if not isinstance(parts, Mapping):
                raise TypeError(f"the components must be a dict of name -> number, got {type(parts).__name__}")
            total, parts = float(total), {str(k): float(v) for k, v in parts.items()}
        except (TypeError, ValueError) as e:
            what = f"returned {value!r:.80}, not a float or (total, {{name: value}}) ({e})"
            return self._reward_failed(what, reply, e)
        done = total >= self.success_threshold or state["attempts"] >= self.max_attempts
        more = [] if done else [{"role": "user", "content": self.retry_message}]
        return TaskResponse(float(total), done, more, parts, {"index": state["index"]})


def _default_match(reply: str, answer: Any) -> float:
    if answer is None:
        return 0.0
    if parse_number(answer) is not None:
        return numeric_match(reply, answer)
    return exact_match(reply, answer)
