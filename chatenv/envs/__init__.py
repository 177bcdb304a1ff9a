"""Chat environments and their Gymnasium registrations.

``import chatenv`` registers:

============================  =====================================================================
``chatenv/Arithmetic-v0``     arithmetic problems; wrong answers get "try again" feedback (3 tries)
``chatenv/GuessNumber-v0``    higher/lower number guessing over up to 8 turns
``chatenv/Chat-v0``           a dataset of prompts with reference answers (list or JSONL; built-in
                              general-knowledge set by default)
============================  =====================================================================

Each takes the :class:`ChatEnv` arguments, e.g. ``gymnasium.make("chatenv/Arithmetic-v0", input_mode="tokens")``.
"""

from __future__ import annotations

import gymnasium as gym

from chatenv.envs.chat_env import ChatEnv, ScoredAction

__all__ = ["ENVS", "ChatEnv", "ScoredAction"]

#: env id -> (task name, one-line description)
ENVS: dict[str, tuple[str, str]] = {
    "chatenv/Arithmetic-v0": ("arithmetic", "Arithmetic problems; wrong answers get feedback and another try."),
    "chatenv/GuessNumber-v0": ("guess_number", "Higher/lower number guessing over many turns."),
    "chatenv/Chat-v0": (
        "dataset",
        "Prompts with reference answers from a list or JSONL file (task_kwargs={'data': ...}).",
    ),
}


def _register() -> None:
    for env_id, (task, _) in ENVS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point="chatenv.envs.chat_env:ChatEnv", kwargs={"task": task})


_register()
