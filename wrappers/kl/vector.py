"""One batched reference forward per step of a vector env.

:class:`VectorRefLogProbs` scores every sub-env's reply with one reference forward in the main process and
passes the values on with the actions (``ScoredAction.ref_log_probs``), so sub-envs wrapped as
``KLPenalty(RefLogProbs(env), kl)`` need no model of their own (they may live in other processes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from tensordict import TensorDictBase

from chatenv.actions import ScoredAction, attach_ref_log_probs, scored_action_from_output
from wrappers.kl.env import REFERENCE_METHOD
from wrappers.kl.estimators import check_log_probs

__all__ = ["VectorRefLogProbs"]


def _as_scored(action: Any) -> Any:
    """A fresh :class:`ScoredAction` for ``action`` (the caller's object is never changed); text stays text."""
    if isinstance(action, ScoredAction):
        return dataclasses.replace(action)
    if isinstance(action, TensorDictBase):
        return scored_action_from_output(action)
    if isinstance(action, (str, Mapping)):
        return action  # the sub-env tokenizes it: its own RefLogProbs (with a model) scores it
    return ScoredAction(np.asarray(action).reshape(-1))


class VectorRefLogProbs(gym.vector.VectorWrapper):
    """Computes the reference log-probs of all sub-envs' replies in one forward per vector step.

    Each step, the replies of all sub-envs (:class:`~chatenv.actions.ScoredAction`, policy output rows or token
    ids) are scored together by ``ref_model`` with :func:`chatenv.actions.attach_ref_log_probs`, checked (lengths,
    NaN or infinite values, in the policy's log-probs too) and passed on in ``ScoredAction.ref_log_probs``; a
    failing check raises before any sub-env is stepped. Placeholder actions and actions that already carry
    reference log-probs are not scored again.

    The ids a reply follows are ``ScoredAction.prompt_ids`` or, when an action has none, the sub-env's current
    ``token_ids`` (read with ``get_attr``, which Gymnasium's sync and async vector envs provide).

    Args:
        env: A vector env of chatenv envs wrapped as ``RefLogProbs(env)`` (or ``KLPenalty(RefLogProbs(env), kl)``).
        ref_model: The reference (:class:`~wrappers.kl.ReferenceModel`, :class:`~wrappers.kl.RayRefModel`, anything
            with ``log_probs(sequences)``); the attribute ``ref_model`` (``chatenv.protocols.REF_MODEL_ATTR``).

    Raises:
        TypeError: If ``ref_model`` has no ``log_probs`` method.
        ValueError: If some sub-envs have no :class:`~wrappers.kl.RefLogProbs` (they would drop the values).
    """

    def __init__(self, env: gym.vector.VectorEnv, ref_model: Any):
        super().__init__(env)
        if not callable(getattr(ref_model, "log_probs", None)):
            raise TypeError(f"ref_model must have a log_probs(sequences) method, got {type(ref_model).__name__}")
        self._check_sub_envs()
        self.ref_model = ref_model

    def _check_sub_envs(self) -> None:
        """Refuse sub-envs without :class:`~wrappers.kl.RefLogProbs`: they would drop the reference log-probs."""
        call = getattr(self.env.unwrapped, "call", None)
        if call is None:  # a vector env without ``call`` cannot be asked; its sub-envs' infos will tell
            return
        missing = [i for i, ok in enumerate(call("has_wrapper_attr", REFERENCE_METHOD)) if not ok]
        if missing:
            raise ValueError(
                f"VectorRefLogProbs passes reference log-probs on to sub-envs wrapped with RefLogProbs, but sub-envs "
                f"{missing} of {self.num_envs} have none: build each as RefLogProbs(env) or "
                "KLPenalty(RefLogProbs(env), kl), e.g. gym.make_vec(..., wrappers=[RefLogProbs])"
            )

    def step(self, actions: Any):  # noqa: D102
        actions = [_as_scored(a) for a in actions]
        if len(actions) != self.num_envs:
            raise ValueError(f"expected {self.num_envs} actions (one per sub-env), got {len(actions)}")
        todo = [
            (i, a)
            for i, a in enumerate(actions)
            if isinstance(a, ScoredAction) and not a.placeholder and a.ref_log_probs is None
        ]
        self._fill_prompt_ids(todo)
        attach_ref_log_probs(self.ref_model, [a for _, a in todo])
        source = f"the reference model's log-probs ({type(self.ref_model).__name__})"
        for i, a in enumerate(actions):
            if isinstance(a, ScoredAction) and not a.placeholder:
                n = len(np.asarray(a.ids).reshape(-1))
                check_log_probs(a.ref_log_probs, n, f"sub-env {i}: {source}")
                if a.log_probs is not None:
                    check_log_probs(a.log_probs, n, f"sub-env {i}: the policy's log-probs (ScoredAction.log_probs)")
        return self.env.step(tuple(actions))

    def _fill_prompt_ids(self, todo: list[tuple[int, ScoredAction]]) -> None:
        missing = [(i, a) for i, a in todo if a.prompt_ids is None]
        if not missing:
            return
        get_attr = getattr(self.env.unwrapped, "get_attr", None)
        if get_attr is None:
            raise ValueError(
                f"sub-envs {[i for i, _ in missing]} sent actions without prompt_ids and the vector env "
                f"{type(self.env.unwrapped).__name__} has no get_attr to read them; set ScoredAction.prompt_ids"
            )
        contexts = get_attr("token_ids")
        for i, a in missing:
            a.prompt_ids = np.asarray(contexts[i], dtype=np.int64)
