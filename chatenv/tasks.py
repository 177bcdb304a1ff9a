"""Tasks: what a chat env talks about, and how replies are rewarded.

A :class:`Task` draws the opening messages and a hidden state (e.g. the answer) with the env's random
generator, then answers each assistant turn through :meth:`Task.respond`: the reward for the turn, whether the
task is over, and messages to add (feedback, a game move, a tool result). The env calls ``respond`` after every
turn, the last one included, so the final reply is always scored.

Built-ins: :class:`ArithmeticTask`, :class:`GuessNumberTask`, :class:`DatasetTask`. All offline and seeded.
"""

from __future__ import annotations

import abc
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chatenv.errors import ChatEnvError
from chatenv.messages import check_messages
from chatenv.rewards import combine, extract_answer, format_reward, numeric_match, parse_number

__all__ = [
    "ArithmeticTask",
    "RewardError",
    "DatasetTask",
    "GuessNumberTask",
    "Task",
    "TaskResponse",
    "TaskStart",
    "get_task",
    "register_task",
]


class RewardError(ChatEnvError, RuntimeError):
    """A reward function raised while scoring a reply (the step that asked for it changed nothing)."""


@dataclass
class TaskStart:
    """The opening of an episode: messages shown to the model and the task's hidden state."""

    messages: list[dict[str, Any]]
    state: Any = None


@dataclass
class TaskResponse:
    """The task's answer to one assistant turn.

    Attributes:
        reward: Reward for this turn.
        done: Whether the task is over (the env then reports ``terminated``).
        messages: Messages to add before the next assistant turn (user, tool, ...).
        components: Named parts of the reward (for logging).
        info: Anything else worth reporting.
    """

    reward: float
    done: bool
    messages: list[dict[str, Any]] = field(default_factory=list)
    components: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class Task(abc.ABC):
    """A chat task. Subclasses implement :meth:`reset` and :meth:`respond`; randomness only from ``rng``."""

    #: one line for ``chatenv envs``
    description: str = ""
    #: turns after which the env truncates by default (None: no limit)
    default_max_turns: int | None = None
    #: tools the env gives the assistant with this task (functions, Tool, PerEpisode, or a Toolbox); see
    #: chatenv.tools. A reply that calls tools is answered by the tools, not by respond().
    tools: Any = None
    #: when True, respond() is called as respond(messages, state, tool_stats=ToolStats) (tool-use rewards)
    uses_tool_stats: bool = False

    @abc.abstractmethod
    def reset(self, rng: np.random.Generator) -> TaskStart:
        """Draw a new episode."""

    @abc.abstractmethod
    def respond(self, messages: list[dict[str, Any]], state: Any) -> TaskResponse:
        """Answer the assistant's last message (``messages[-1]``); may update ``state`` in place."""

    def state_for(self, messages: list[dict[str, Any]], options: Mapping[str, Any]) -> Any:
        """Hidden state for a chat given as ``reset(options={"messages": ...})``; default: ``options["state"]``."""
        return options.get("state")


_TASKS: dict[str, Callable[..., Task] | str] = {}


def register_task(name: str, factory: Callable[..., Task] | str, *, overwrite: bool = False) -> None:
    """Make a task available by name (for ``ChatEnv(task="name")``).

    Args:
        name: The task's name.
        factory: Called with the ``task_kwargs`` to make the task (a :class:`Task` subclass or a function); or
            ``"module:attr"``, imported when the task is first made (registering costs no import).
        overwrite: Replace a task already registered under ``name`` by another factory.

    Raises:
        ValueError: For an empty name, a malformed ``"module:attr"``, or a name taken by another factory without
            ``overwrite=True``.
        TypeError: For a factory that is neither callable nor a string.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a task name must be a non-empty string, got {name!r}")
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        if not module or not attr:
            raise ValueError(f"a lazy task factory is 'module:attr', got {factory!r}")
    elif not callable(factory):
        raise TypeError(f"a task factory must be callable or 'module:attr', got {type(factory).__name__}")
    if name in _TASKS and not overwrite and _factory_id(_TASKS[name]) != _factory_id(factory):
        raise ValueError(
            f"task {name!r} is already registered (to {_TASKS[name]!r}); pick another name, or pass overwrite=True "
            "to replace it"
        )
    _TASKS[name] = factory


def _factory_id(factory: Callable[..., Task] | str) -> Any:
    """What makes two registrations the same: the object, or its module and name (a module imported again)."""
    if isinstance(factory, str):
        return factory
    return (
        (getattr(factory, "__module__", None), getattr(factory, "__qualname__", None))
        if hasattr(factory, "__qualname__")
        else id(factory)
    )


def _factory(name: str) -> Callable[..., Task]:
    """The factory registered under ``name``, importing a lazy ``"module:attr"`` one."""
    factory = _TASKS[name]
    if isinstance(factory, str):
        import importlib

        module, _, attr = factory.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"task {name!r} is registered as {_TASKS[name]!r}, which cannot be loaded: {e}") from e
    return factory


def get_task(task: str | Task, **kwargs: Any) -> Task:
    """A task object from a name or an instance."""
    if isinstance(task, Task):
        if kwargs:
            raise ValueError("task_kwargs apply to a task given by name, not to a Task instance")
        return task
    if task not in _TASKS:
        import difflib

        close = difflib.get_close_matches(str(task), list(_TASKS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown task {task!r}{hint} (known: {', '.join(sorted(_TASKS))})")
    return _factory(task)(**kwargs)


def _last_reply(messages: Sequence[Mapping[str, Any]]) -> str:
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("respond() expects the chat to end with the assistant's reply")
    return messages[-1].get("content") or ""


# ----------------------------------------------------------------------------------------------- arithmetic

_ANSWER_FORMAT = "Put the final answer in <answer></answer> tags."


class ArithmeticTask(Task):
    """Procedural arithmetic problems; a wrong answer gets "try again" feedback until the attempts run out.

    Args:
        max_attempts: Replies allowed per problem.
        max_operand: Operands are drawn from ``[0, max_operand]``.
        operations: Any of ``"+"``, ``"-"``, ``"*"``.
        format_weight: Weight of the ``<answer>`` tag format reward added to correctness.
        system_prompt: System message (None: no system message).

    Rewards per turn: ``correct`` (1 or 0) + ``format_weight`` x ``format`` (1 if the reply used the tags).
    """

    description = "Arithmetic problems; wrong answers get feedback and another try."

    def __init__(
        self,
        max_attempts: int = 3,
        max_operand: int = 99,
        operations: Sequence[str] = ("+", "-", "*"),
        format_weight: float = 0.1,
        system_prompt: str | None = None,
    ):
        _positive_int("max_attempts", max_attempts)
        _positive_int("max_operand", max_operand)
        bad = [op for op in operations if op not in ("+", "-", "*")]
        if bad or not operations:
            raise ValueError(f"operations must be a non-empty subset of '+', '-', '*', got {list(operations)}")
        self.max_attempts = max_attempts
        self.max_operand = max_operand
        self.operations = tuple(operations)
        self.system_prompt = system_prompt
        self.reward = combine({"correct": (numeric_match, 1.0), "format": (format_reward, format_weight)})
        self.default_max_turns = max_attempts

    def reset(self, rng: np.random.Generator) -> TaskStart:  # noqa: D102
        a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, size=2))
        op = self.operations[int(rng.integers(len(self.operations)))]
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        messages = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        messages.append({"role": "user", "content": f"What is {a} {op} {b}? {_ANSWER_FORMAT}"})
        return TaskStart(messages, {"answer": answer, "attempts": 0})

    def state_for(self, messages, options):  # noqa: D102
        return {"answer": options.get("answer"), "attempts": 0}

    def _reward_failed(self, what: str, reply: str, error: Exception) -> TaskResponse:
        return _reward_failure(self, what, reply, error)

    def respond(self, messages, state) -> TaskResponse:  # noqa: D102
        reply = _last_reply(messages)
        state["attempts"] += 1
        total, parts = self.reward(reply, state["answer"])
        info = {"answer": state["answer"], "extracted": extract_answer(reply)}
        if parts["correct"] == 1.0 or state["attempts"] >= self.max_attempts or state["answer"] is None:
            return TaskResponse(total, True, [], parts, info)
        left = self.max_attempts - state["attempts"]
        feedback = f"That is not correct. Try again ({left} {'try' if left == 1 else 'tries'} left). {_ANSWER_FORMAT}"
        return TaskResponse(total, False, [{"role": "user", "content": feedback}], parts, info)


# ----------------------------------------------------------------------------------------------- guess number


class GuessNumberTask(Task):
    """Higher/lower game: guess a hidden integer in ``[low, high]``; each wrong guess is told "higher"/"lower".

    Rewards per turn: 1.0 for the right guess (the game ends), 0.0 for a wrong one, ``invalid_reward`` for a
    reply with no number in range.
    """

    description = "Higher/lower number guessing over many turns."

    def __init__(self, low: int = 1, high: int = 100, max_guesses: int = 8, invalid_reward: float = -0.1):
        for name, value in (("low", low), ("high", high)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"GuessNumberTask: {name} must be an int, got {value!r}")
        _positive_int("max_guesses", max_guesses)
        if high <= low:
            raise ValueError(f"high must exceed low, got low={low}, high={high}")
        self.low, self.high = low, high
        self.invalid_reward = invalid_reward
        self.default_max_turns = max_guesses

    def reset(self, rng: np.random.Generator) -> TaskStart:  # noqa: D102
        secret = int(rng.integers(self.low, self.high + 1))
        prompt = (
            f"I am thinking of an integer between {self.low} and {self.high}. Guess it! After each guess I will say "
            "'higher' or 'lower'. Reply with just your guess."
        )
        return TaskStart([{"role": "user", "content": prompt}], {"secret": secret, "guesses": []})

    def state_for(self, messages, options):  # noqa: D102
        if "secret" not in options:
            raise ValueError("GuessNumber needs options['secret'] when the chat is given")
        secret = options["secret"]
        if isinstance(secret, bool) or not isinstance(secret, (int, np.integer)):
            raise TypeError(f"options['secret'] must be an int, got {secret!r:.60}")
        if not self.low <= int(secret) <= self.high:
            raise ValueError(f"options['secret'] must be in [{self.low}, {self.high}], got {secret}")
        return {"secret": int(secret), "guesses": []}

    def respond(self, messages, state) -> TaskResponse:  # noqa: D102
        guess = parse_number(extract_answer(_last_reply(messages)))
        if guess is None or not guess.is_integer() or not self.low <= guess <= self.high:
            msg = f"Please reply with a whole number between {self.low} and {self.high}."
            return TaskResponse(self.invalid_reward, False, [{"role": "user", "content": msg}], {"valid": 0.0})
        guess = int(guess)
        state["guesses"].append(guess)
        info = {"secret": state["secret"], "guess": guess}
        if guess == state["secret"]:
            return TaskResponse(1.0, True, [], {"valid": 1.0, "correct": 1.0}, info)
        hint = "Higher." if guess < state["secret"] else "Lower."
        return TaskResponse(0.0, False, [{"role": "user", "content": hint}], {"valid": 1.0, "correct": 0.0}, info)


# ----------------------------------------------------------------------------------------------- dataset


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _load_records(data: str | os.PathLike | Sequence[Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """``(where, record)`` pairs: each record as given, with where it came from for error messages."""
    if isinstance(data, (str, os.PathLike)):
        records = []
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
    record = dict(record)
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
    return record


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
        data: str | os.PathLike | Sequence[Mapping[str, Any]] | None = None,
        reward_fn: Callable[[str, Any], Any] | None = None,
        max_attempts: int = 1,
        success_threshold: float = 1.0,
        retry_message: str = "That is not correct. Please try again.",
        on_reward_error: str = "raise",
        pass_record: bool = False,
        instruction: str | None = None,
    ):
        if data is None:
            data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "qa.jsonl")
        self.records = [_check_record(where, r) for where, r in _load_records(data)]
        if not self.records:
            raise ValueError("DatasetTask needs at least one record: pass data=[...] or a JSONL path")
        if on_reward_error not in ("raise", "record"):
            raise ValueError(f"on_reward_error must be 'raise' or 'record', got {on_reward_error!r}")
        _positive_int("max_attempts", max_attempts)
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

    def state_for(self, messages, options):  # noqa: D102
        index = options.get("index")
        if index is not None and not (isinstance(index, int) and 0 <= index < len(self.records)):
            raise ValueError(f"options['index'] must be a record index in [0, {len(self.records)}), got {index!r}")
        answer = options.get("answer", None if index is None else self.records[index].get("answer"))
        return {"answer": answer, "index": index, "attempts": 0}

    def record(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The record an episode is about (for a chat given by options: ``options["index"]``, else its answer)."""
        if state.get("index") is not None:
            return self.records[state["index"]]
        return {"answer": state.get("answer")}

    def _reward_failed(self, what: str, reply: str, error: Exception) -> TaskResponse:
        return _reward_failure(self, what, reply, error)

    def respond(self, messages, state) -> TaskResponse:  # noqa: D102
        reply = _last_reply(messages)
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


def _reward_failure(task: DatasetTask, what: str, reply: str, error: Exception) -> TaskResponse:
    if task.on_reward_error == "raise":
        raise RewardError(
            f"DatasetTask reward_fn {what} (reply {reply[:200]!r}); fix the reward function, or pass "
            "on_reward_error='record' to score such replies 0 and flag them"
        ) from error
    return TaskResponse(0.0, True, [], {}, {"reward_error": what})


def _default_match(reply: str, answer: Any) -> float:
    if answer is None:
        return 0.0
    if parse_number(answer) is not None:
        return numeric_match(reply, answer)
    from chatenv.rewards import exact_match

    return exact_match(reply, answer)


register_task("arithmetic", ArithmeticTask)
register_task("guess_number", GuessNumberTask)
register_task("dataset", DatasetTask)


def _reasoning_gym(**kwargs: Any) -> Task:
    from chatenv.integrations.reasoning_gym import ReasoningGymTask

    return ReasoningGymTask(**kwargs)


register_task("reasoning_gym", _reasoning_gym)
