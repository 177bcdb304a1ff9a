"""Chat environments and their Gymnasium registrations.

``import chatenv`` registers (through :func:`chatenv.register`, which also takes your own tasks and env ids):

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

The last three are tool-calling envs (:class:`chatenv.tasks.ToolTask`): a reply with tool calls is answered with
``tool`` messages, and the first reply without calls is scored and ends the episode.

Each takes the :class:`ChatEnv` arguments, e.g. ``gymnasium.make("chatenv/Arithmetic-v0", input_mode="tokens")``.
:data:`ENVS` is a read-only view of every env id registered through :func:`chatenv.register` (what ``chatenv
envs`` lists): env id -> (task name, description).
"""

from __future__ import annotations

import gymnasium as gym
from gymnasium.envs.registration import load_env_creator

from chatenv.actions import ScoredAction
from chatenv.envs.chat_env import ChatEnv
from chatenv.envs.token_env import TokenEnv
from chatenv.tasks.registry import ENVS, register

__all__ = ["ENVS", "ChatEnv", "ScoredAction", "TokenEnv", "is_token_level"]


def is_token_level(env_id: str) -> bool:
    """Whether the registered Gymnasium id ``env_id`` makes a :class:`TokenEnv` (or a subclass): one step per token.

    An id whose entry point is a factory function (not a class) cannot be told without making an env: False.

    Raises:
        KeyError: If ``env_id`` is not registered.
    """
    spec = gym.registry.get(env_id)
    if spec is None:
        raise KeyError(f"unknown env {env_id!r}; `chatenv envs` lists them")
    entry = spec.entry_point
    try:
        creator = load_env_creator(entry) if isinstance(entry, str) else entry
    except (ImportError, AttributeError, ValueError):
        return False  # an entry that cannot be loaded fails when the env is made, with gymnasium's error
    return isinstance(creator, type) and issubclass(creator, TokenEnv)


register(
    "arithmetic",
    env_id="chatenv/Arithmetic-v0",
    description="Arithmetic problems; wrong answers get feedback and another try.",
)
register("guess_number", env_id="chatenv/GuessNumber-v0", description="Higher/lower number guessing over many turns.")
register(
    "dataset",
    env_id="chatenv/Chat-v0",
    description="Prompts with reference answers from a list or JSONL file (task_kwargs={'data': ...}).",
)
register(
    "arithmetic",
    env_id="chatenv/TokenArithmetic-v0",
    token_level=True,
    description="Arithmetic with one step per generated token (TokenEnv).",
)
register(
    "calculator_arithmetic",
    env_id="chatenv/CalculatorArithmetic-v0",
    description="Multi-digit arithmetic with a calculator tool; exact answer in <answer> tags.",
)
register(
    "python_problems",
    env_id="chatenv/PythonTask-v0",
    description="Problems solved by running code with a sandboxed python tool.",
)
register(
    "retrieval",
    env_id="chatenv/Retrieval-v0",
    description="Questions about fictional countries, answered with a search tool.",
)
