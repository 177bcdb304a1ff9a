"""Forking an env in the middle of an episode: :func:`fork`.

Steps are planned on copies and committed last, so an episode in progress can be copied: a fork is an independent
env at the same point of the same episode (token view, assistant mask, messages, the task's state, the tools' state,
the random generator), sharing only what holds no episode state (tokenizer, template, task object, tool
definitions, a wrapper's reference model). Forks are the base of branching rollouts: from one point, several
continuations.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import gymnasium as gym
import numpy as np

from chatenv.envs.base import ChatEnvBase

__all__ = ["fork"]

# a wrapper's containers are copied (one level: episode bookkeeping such as returns and lengths); what they hold
# and every other attribute (a reference model, a KL controller, a tokenizer) is shared
_PER_EPISODE = (list, dict, set, collections.deque, np.ndarray)


def fork(env: Any, *, episode: bool = True) -> Any:
    """An independent copy of ``env`` at the same point of the same episode, through Gymnasium wrappers.

    Stepping the fork never changes ``env`` and the other way round; stepping both with the same actions gives
    the same observations, rewards and ids. Closing or resetting one leaves the other as it is.

    Args:
        env: A :class:`~chatenv.ChatEnv` or :class:`~chatenv.TokenEnv`, or a Gymnasium wrapper around one (the KL
            wrappers included), or an env with its own ``fork(episode=...)`` (``chatenv.envserver.EnvClient``).
        episode: Copy the episode in progress (default). ``False``: the fork has no episode (reset it before
            stepping): another env like ``env`` (same task, tokenizer, tools, wrappers), whatever ``env``'s episode
            holds.

    Raises:
        RuntimeError: For a closed env (or a wrapper of one): ``close()`` released its episode and tool objects, so
            there is nothing to copy; fork before closing. A reset reopens it.
        TypeError: For an env that is not a chatenv env (nor wraps one), or an episode whose task state or tool
            objects cannot be copied (the message says what to give them).
    """
    if isinstance(env, ChatEnvBase) or (not isinstance(env, gym.Wrapper) and callable(getattr(env, "fork", None))):
        return env.fork(episode=episode)  # a chat env, or an env that forks itself (an env server's client)
    if isinstance(env, gym.Wrapper):
        new = copy.copy(env)
        for name, value in vars(env).items():
            if name != "env" and isinstance(value, _PER_EPISODE):
                setattr(new, name, copy.copy(value))
        new.env = fork(env.env, episode=episode)
        return new
    raise TypeError(f"fork() takes a chatenv ChatEnv or TokenEnv (or a Gymnasium wrapper of one), got {type(env)}")
