"""The base of tool-calling tasks: :class:`ToolTask` (tools, final-reply scoring with the episode's tool use).

A :class:`ToolTask` ships its ``tools`` and scores only the final reply, the first without tool calls (the env
answers calls with ``tool`` messages). Its reward function gets a :class:`~chatenv.rewards.ToolReply`, the text
carrying the episode's tool use, for :func:`~chatenv.rewards.used_tool`, :func:`~chatenv.rewards.tool_errors`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from chatenv.rewards import ToolReply, combine, extract_answer, numeric_match, used_tool
from chatenv.tasks.base import RewardError, Task, TaskResponse, TaskStart, last_reply
from chatenv.tools.runner import Toolbox, ToolStats

__all__ = ["ANSWER_FORMAT", "ToolTask", "exact_number"]

ANSWER_FORMAT = "Give the final answer in <answer></answer> tags."


def exact_number(reply: str, reference: Any) -> float:
    """1.0 when the reply's answer is the reference number exactly (big integers included), else 0.0."""
    return numeric_match(reply, reference, rel_tol=0.0)  # no tolerance: big integers must be exact


class ToolTask(Task):
    """A task solved with tools: the final reply (the first without tool calls) is scored and ends the episode.

    Subclasses implement :meth:`problem`, set ``tools`` (functions, :class:`~chatenv.tools.Tool` and
    :class:`~chatenv.tools.PerEpisode` objects, or a :class:`~chatenv.tools.Toolbox`) and ``match``.

    Args:
        reward_fn: ``fn(reply, answer) -> float`` or ``-> (total, components)`` (as :func:`~chatenv.rewards.combine`
            returns). ``reply`` is a :class:`~chatenv.rewards.ToolReply`. Default: ``correct`` (weight 1) and
            ``used_tool`` (weight 0, reported only).
        system_prompt: The system message (default: the task's, which tells the model to use its tools).
        max_turns: Replies per episode, tool-calling ones included (default: the task's ``default_max_turns``).
    """

    tools: Sequence[Any] | Toolbox = ()
    uses_tool_stats = True
    default_max_turns: int | None = 5
    system_prompt = "Use your tools to find the answer. " + ANSWER_FORMAT
    match: Callable[[str, Any], float] = staticmethod(exact_number)

    def __init__(
        self,
        reward_fn: Callable[[str, Any], Any] | None = None,
        system_prompt: str | None = None,
        max_turns: int | None = None,
    ):
        if reward_fn is not None and not callable(reward_fn):
            raise TypeError(f"reward_fn must be a function fn(reply, answer), got {type(reward_fn).__name__}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise TypeError(f"system_prompt must be a str, got {type(system_prompt).__name__}")
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.reward_fn = reward_fn or combine({"correct": (type(self).match, 1.0), "used_tool": (used_tool, 0.0)})
        if system_prompt is not None:
            self.system_prompt = system_prompt
        if max_turns is not None:
            self.default_max_turns = max_turns

    @abc.abstractmethod
    def problem(self, rng: np.random.Generator) -> tuple[str, Any, dict[str, Any]]:
        """Draw a problem: ``(question, answer, extra state)``."""

    def reset(self, rng: np.random.Generator) -> TaskStart:
        """A system message, the question, and ``{"answer": ..., **extra}`` as the state."""
        question, answer, extra = self.problem(rng)
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]
        return TaskStart(messages, {**extra, "answer": answer})

    def state_for(self, messages: list[dict[str, Any]], options: Mapping[str, Any]) -> Any:
        """For a given chat: ``options["answer"]`` is the reference."""
        return {"answer": options.get("answer")}

    def respond(self, messages: list[dict[str, Any]], state: Any, tool_stats: ToolStats | None = None) -> TaskResponse:
        """Score the final reply (it made no tool calls) against ``state["answer"]``; the episode ends.

        Raises:
            RewardError: If the reward function raises or returns something that is not a reward.
        """
        text = last_reply(messages)
        stats = tool_stats if tool_stats is not None else ToolStats()
        total, parts = self._score(ToolReply(text, stats), state.get("answer"))
        return TaskResponse(total, True, [], parts, {"answer": state.get("answer"), "extracted": extract_answer(text)})

    def _score(self, reply: ToolReply, answer: Any) -> tuple[float, dict[str, float]]:
        name = type(self).__name__
        try:
            value = self.reward_fn(reply, answer)
        except Exception as e:
            raise RewardError(f"{name} reward_fn raised {type(e).__name__}: {e} (reply {str(reply)[:200]!r})") from e
        try:
            if isinstance(value, tuple):
                total, parts = value
                return float(total), {str(k): float(v) for k, v in dict(parts).items()}
            return float(value), {"reward": float(value)}
        except (TypeError, ValueError) as e:
            raise RewardError(
                f"{name} reward_fn must return a float or (total, {{name: value}}), got {value!r:.80}"
            ) from e
