"""Procedural arithmetic problems: :class:`ArithmeticTask` (a wrong answer gets feedback and another try)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from chatenv.rewards import combine, extract_answer, format_reward, numeric_match
from chatenv.tasks.base import Task, TaskResponse, TaskStart, last_reply, positive_int

__all__ = ["ArithmeticTask"]

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
        positive_int("max_attempts", max_attempts)
        positive_int("max_operand", max_operand)
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

    def state_for(self, messages: list[dict[str, Any]], options: Mapping[str, Any]) -> Any:  # noqa: D102
        return {"answer": options.get("answer"), "attempts": 0}

    def respond(self, messages: list[dict[str, Any]], state: Any) -> TaskResponse:  # noqa: D102
        reply = last_reply(messages)
        state["attempts"] += 1
        total, parts = self.reward(reply, state["answer"])
        info = {"answer": state["answer"], "extracted": extract_answer(reply)}
        if parts["correct"] == 1.0 or state["attempts"] >= self.max_attempts or state["answer"] is None:
            return TaskResponse(total, True, [], parts, info)
        left = self.max_attempts - state["attempts"]
        feedback = f"That is not correct. Try again ({left} {'try' if left == 1 else 'tries'} left). {_ANSWER_FORMAT}"
        return TaskResponse(total, False, [{"role": "user", "content": feedback}], parts, info)
