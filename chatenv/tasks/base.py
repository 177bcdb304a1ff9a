"""The task protocol: :class:`Task`, what it returns (:class:`TaskStart`, :class:`TaskResponse`), :class:`RewardError`.

A :class:`Task` draws the opening messages and a hidden state (e.g. the answer) with the env's random
generator, then answers each assistant turn through :meth:`Task.respond`: the reward for the turn, whether the
task is over, and messages to add (feedback, a game move, a tool result). The env calls ``respond`` after every
turn, the last one included, so the final reply is always scored.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chatenv.errors import ChatEnvError

__all__ = ["RewardError", "Task", "TaskResponse", "TaskStart", "last_reply", "positive_int"]


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


def last_reply(messages: Sequence[Mapping[str, Any]]) -> str:
    """The text of the assistant's reply that ends ``messages``.

    Raises:
        ValueError: If the chat does not end with an assistant message.
    """
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("respond() expects the chat to end with the assistant's reply")
    return str(messages[-1].get("content") or "")


def positive_int(name: str, value: Any) -> None:
    """Refuse a ``value`` that is not an int >= 1 (a bool is not an int here), naming the argument ``name``.

    Raises:
        TypeError: For a value that is not an int.
        ValueError: For an int below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
