"""Chat environments and their Gymnasium registrations.

``import chatenv`` registers:

===================================  ========================================================================
``chatenv/Arithmetic-v0``            arithmetic problems; wrong answers get "try again" feedback (3 tries)
``chatenv/GuessNumber-v0``           higher/lower number guessing over up to 8 turns
``chatenv/Chat-v0``                  a dataset of prompts with reference answers (list or JSONL; built-in
                                     general-knowledge set by default)
``chatenv/TokenArithmetic-v0``       the arithmetic task with one step per generated token (:class:`TokenEnv`;
                                     any task via ``task=...``)
``chatenv/CalculatorArithmetic-v0``  multi-digit arithmetic with a ``calculator`` tool
``chatenv/PythonTask-v0``            problems solved by running code with a sandboxed ``python`` tool
``chatenv/Retrieval-v0``             questions about fictional countries, with ``search``/``read`` tools over
                                     a document store generated for each episode
===================================  ========================================================================

The last three are tool-calling envs (:mod:`chatenv.tool_tasks`): a reply with tool calls is answered with
``tool`` messages, and the first reply without calls is scored and ends the episode.

Each takes the :class:`ChatEnv` arguments, e.g. ``gymnasium.make("chatenv/Arithmetic-v0", input_mode="tokens")``.
"""

from __future__ import annotations

import gymnasium as gym

import chatenv.tool_tasks  # noqa: F401  (registers the tool tasks' names)
from chatenv.actions import ScoredAction
from chatenv.envs.chat_env import ChatEnv
from chatenv.envs.token_env import TokenEnv

__all__ = ["ENVS", "ChatEnv", "ScoredAction", "TokenEnv"]

#: env id -> (task name, one-line description)
ENVS: dict[str, tuple[str, str]] = {
    "chatenv/Arithmetic-v0": ("arithmetic", "Arithmetic problems; wrong answers get feedback and another try."),
    "chatenv/GuessNumber-v0": ("guess_number", "Higher/lower number guessing over many turns."),
    "chatenv/Chat-v0": (
        "dataset",
        "Prompts with reference answers from a list or JSONL file (task_kwargs={'data': ...}).",
    ),
    "chatenv/TokenArithmetic-v0": ("arithmetic", "Arithmetic with one step per generated token (TokenEnv)."),
    "chatenv/CalculatorArithmetic-v0": (
        "calculator_arithmetic",
        "Multi-digit arithmetic with a calculator tool; exact answer in <answer> tags.",
    ),
    "chatenv/PythonTask-v0": ("python_problems", "Problems solved by running code with a sandboxed python tool."),
    "chatenv/Retrieval-v0": ("retrieval", "Questions about fictional countries, answered with a search tool."),
}


def _register() -> None:
    for env_id, (task, _) in ENVS.items():
        if env_id not in gym.registry:
            entry = "token_env:TokenEnv" if env_id.startswith("chatenv/Token") else "chat_env:ChatEnv"
            gym.register(id=env_id, entry_point=f"chatenv.envs.{entry}", kwargs={"task": task})


_register()
