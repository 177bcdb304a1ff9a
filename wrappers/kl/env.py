"""Gymnasium wrappers that add reference log-probs and a KL penalty to each step of a chat env.

- :class:`RefLogProbs`: ``info["ref_log_probs"]`` holds the reference log-probs of the step's generated tokens.
  Its scorer is the attribute named by :data:`chatenv.protocols.REF_MODEL_ATTR`, which
  :func:`chatenv.rollout` finds with ``env.get_wrapper_attr`` to batch one reference forward for many envs.
- :class:`KLPenalty`: per-token KL between the policy and the reference on those tokens (k1, k2, k3),
  ``info["kl"]``, ``info["token_rewards"]`` (:func:`~wrappers.kl.estimators.shape_token_rewards`) and the step
  reward ``task_reward - coef * sum_t kl_t``. The coefficient comes from a constant or a controller
  (:mod:`wrappers.kl.controllers`), which is fed the step's KL.

The policy's own generation-time log-probs come with the action (:class:`~chatenv.actions.ScoredAction`): a KL
needs one reference forward, not a second policy pass.

Steps are transactions: the reference log-probs are computed and every value is checked (lengths, NaN or infinite
log-probs, the coefficient) before the inner env is stepped, so a step that raises leaves env, task and
controller as they were. A controller is updated once per successful env step; one shared by several envs (stepped
on threads by :func:`chatenv.rollout`) reads its coefficient and applies each update atomically
(:func:`~wrappers.kl.controllers.use_and_update`), as if the envs had been stepped one after another.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDictBase

from chatenv.actions import ScoredAction, action_ids, action_token, scored_action_from_output
from wrappers.kl.controllers import KLController, current_coef, kl_controller, use_and_update
from wrappers.kl.estimators import check_estimator, check_log_probs, kl_estimate, shape_token_rewards
from wrappers.kl.reference import score_with

__all__ = ["REFERENCE_METHOD", "KLPenalty", "RefLogProbs"]

#: The method of :class:`RefLogProbs` that :class:`KLPenalty` and :class:`~wrappers.kl.VectorRefLogProbs` find
#: with ``get_wrapper_attr`` / ``has_wrapper_attr``.
REFERENCE_METHOD = "reference_log_probs"
_POLICY_SOURCE = "the policy's log-probs (ScoredAction.log_probs)"
_PRECOMPUTED_SOURCE = "the precomputed reference log-probs (ScoredAction.ref_log_probs)"


def _scored(action: Any) -> ScoredAction | None:
    """The action as a :class:`ScoredAction` if it is one (or a policy output row), else None."""
    if isinstance(action, ScoredAction):
        return action
    if isinstance(action, TensorDictBase):
        return scored_action_from_output(action)
    return None


class RefLogProbs(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Adds the reference model's log-probs of each step's generated tokens to ``info["ref_log_probs"]``.

    Turn-level env (:class:`~chatenv.envs.ChatEnv`): the turn's tokens; token-level env
    (:class:`~chatenv.envs.TokenEnv`): the one token of the step. With a :class:`~chatenv.actions.ScoredAction`
    that carries the policy's log-probs, ``info["log_probs"]`` holds them too.

    Args:
        env: A :class:`~chatenv.envs.ChatEnv` or :class:`~chatenv.envs.TokenEnv` (possibly wrapped).
        ref_model: A :class:`~wrappers.kl.ReferenceModel` (anything with ``log_probs(sequences)``), or None when
            the reference log-probs always come with the action (``ScoredAction.ref_log_probs``, as
            ``chatenv.rollout(..., ref_model=...)`` and :class:`~wrappers.kl.VectorRefLogProbs` provide them, e.g.
            for envs in other processes).

    Raises:
        TypeError: If ``env`` is not a chatenv env, or ``ref_model`` has no ``log_probs`` method.

    Example:
        >>> from chatenv import ChatEnv, ScoredAction
        >>> env = RefLogProbs(ChatEnv("arithmetic", input_mode="tokens"))  # values come with the actions
        >>> _ = env.reset(seed=0)
        >>> _, _, _, _, info = env.step(ScoredAction([16, 2], ref_log_probs=[-2.0, -0.5]))
        >>> info["ref_log_probs"]
        [-2.0, -0.5]
    """

    def __init__(self, env: gym.Env, ref_model: Any = None):
        # the reference is shared on purpose (one model for many envs): recorded as it is, never deep-copied
        gym.utils.RecordConstructorArgs.__init__(self, ref_model=ref_model, _disable_deepcopy=True)
        gym.Wrapper.__init__(self, env)
        from chatenv.envs import ChatEnv, TokenEnv

        if not isinstance(env.unwrapped, (ChatEnv, TokenEnv)):
            raise TypeError(f"RefLogProbs wraps a chatenv ChatEnv or TokenEnv, got {type(env.unwrapped).__name__}")
        if ref_model is not None and not callable(getattr(ref_model, "log_probs", None)):
            raise TypeError(f"ref_model must have a log_probs(sequences) method, got {type(ref_model).__name__}")
        #: The reference scorer (``chatenv.protocols.REF_MODEL_ATTR``), or None.
        self.ref_model = ref_model
        self._token_level = isinstance(env.unwrapped, TokenEnv)

    def reference_log_probs(self, action: Any) -> torch.Tensor | None:
        """The reference log-probs of the tokens ``action`` would add, checked finite; changes nothing.

        Returns:
            A ``(n,)`` float32 tensor for the step's ``n`` generated tokens, or None for a placeholder action.

        Raises:
            ValueError: Without a reference model or precomputed values, or for values of the wrong length or
                not finite (the message names their source).
        """
        scored = _scored(action)
        if scored is not None and scored.placeholder:
            return None
        return self._reference(self._reply_ids(action, scored), scored)

    def step(self, action: Any):  # noqa: D102
        scored = _scored(action)
        if scored is not None and scored.placeholder:
            return self.env.step(action)
        ids = self._reply_ids(action, scored)
        ref = self._reference(ids, scored)
        lp = None
        if scored is not None and scored.log_probs is not None:
            lp = check_log_probs(scored.log_probs, len(ids), _POLICY_SOURCE)
        obs, reward, terminated, truncated, info = self.env.step(action)
        # per-token values are lists: vector envs stack ndarray infos only when every env's has the same shape
        info["ref_log_probs"] = ref.tolist()
        if lp is not None:
            info["log_probs"] = lp.tolist()
        return obs, reward, terminated, truncated, info

    def _reply_ids(self, action: Any, scored: ScoredAction | None) -> list[int]:
        """The ids the step will append (checked like the env checks them), before stepping."""
        env = self.env.unwrapped
        if self._token_level:
            return [action_token(scored if scored is not None else action, env.vocab_size)]
        if scored is None and isinstance(action, (str, Mapping)):
            episode = self.env.get_wrapper_attr("episode")
            if episode is None:
                raise RuntimeError("call reset() before step()")
            # the env's own tokenization of the reply (the env refuses text in tokens mode when stepped)
            return episode.reply_from_message(action)[1]
        return action_ids(scored if scored is not None else action, env.vocab_size)

    def _context(self) -> np.ndarray:
        ids = self.env.unwrapped.token_ids
        if len(ids) == 0:
            raise RuntimeError("call reset() before step()")
        return ids

    def _reference(self, ids: list[int], scored: ScoredAction | None) -> torch.Tensor:
        if scored is not None and scored.ref_log_probs is not None:
            return check_log_probs(scored.ref_log_probs, len(ids), _PRECOMPUTED_SOURCE)
        if self.ref_model is None:
            raise ValueError(
                "RefLogProbs has no reference model and the action carries no ref_log_probs; pass ref_model=... "
                "to RefLogProbs, wrap the vector env with VectorRefLogProbs, or pass ref_model=... to chatenv.rollout"
            )
        context = self._context()
        name = type(self.ref_model).__name__
        # one int64 array: checked in one vectorised pass, not id by id (the context grows with the episode)
        seq = np.concatenate([context, np.asarray(ids, dtype=np.int64)])
        values = score_with(self.ref_model, [seq], f"the reference model ({name})")[0][len(context) :]  # (n,)
        return check_log_probs(values, len(ids), f"the reference model's log-probs ({name})")


class KLPenalty(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Subtracts ``kl * sum_t kl_t`` over each step's generated tokens from the task reward (``kl``: the coefficient).

    Step it with a :class:`~chatenv.actions.ScoredAction` (or a policy output row): the policy's generation
    log-probs come with the action. The reference log-probs come from a :class:`RefLogProbs` below this wrapper,
    or from ``ref_model`` (then one is added).

    Args:
        env: The env (with :class:`RefLogProbs` applied, or give ``ref_model``).
        kl: The KL coefficient: a constant (finite, >= 0), or a KL controller, updated once after every successful
            step with the step's summed KL. A controller may be shared by several envs, also ones stepped on
            threads: each step reads the coefficient it uses and applies its update in one atomic section, so the
            coefficients are those of stepping the envs one after another, in the order their steps finish.
        estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"``.
        assistant_only: Penalise only assistant tokens (every generated token is one: kept for symmetry with
            :class:`~wrappers.kl.KLComputation`).
        ref_model: Reference model, when ``env`` has no :class:`RefLogProbs`.

    ``info`` gains ``kl`` (per token, a list of floats), ``token_rewards`` (``-coef * kl_t``, plus the task reward
    on the last token), ``task_reward``, ``kl_coef`` (the coefficient used for this step). With a token-level env
    each step is one token: the reward is ``-coef * kl_t``, plus the task's reward at the step that ends a reply;
    the controller then sees one token's KL per step.

    Raises:
        ValueError: For no ``kl``, a bad coefficient or estimator (with the closest name), or no source of
            reference log-probs.
        TypeError: For a coefficient that is not a number, a controller without ``coef`` and ``update``, or an old
            spelling (``coef=``, ``controller=``: the message names ``kl=``).

    Example:
        >>> from chatenv import ChatEnv, ScoredAction
        >>> env = KLPenalty(RefLogProbs(ChatEnv("arithmetic", input_mode="tokens")), kl=0.1)
        >>> _ = env.reset(seed=0)
        >>> action = ScoredAction([16, 2], log_probs=[-1.0, -1.0], ref_log_probs=[-1.5, -1.0])
        >>> _, reward, _, _, info = env.step(action)
        >>> info["kl"], info["kl_coef"], round(reward - info["task_reward"], 6)
        ([0.5, 0.0], 0.1, -0.05)
    """

    def __init__(
        self,
        env: gym.Env,
        kl: float | KLController | None = None,
        *,
        estimator: str = "k1",
        assistant_only: bool = True,
        ref_model: Any = None,
        **renamed: Any,
    ):
        controller = kl_controller(kl, "KLPenalty", renamed)
        gym.utils.RecordConstructorArgs.__init__(self, kl=kl, estimator=estimator, assistant_only=assistant_only)
        self.estimator = check_estimator(estimator)
        if ref_model is not None:
            env = RefLogProbs(env, ref_model)
        elif not env.has_wrapper_attr(REFERENCE_METHOD):
            raise ValueError("KLPenalty needs reference log-probs: wrap the env with RefLogProbs or pass ref_model=...")
        gym.Wrapper.__init__(self, env)
        self.controller = controller
        self.assistant_only = assistant_only

    def step(self, action: Any):  # noqa: D102
        scored = _scored(action)
        if scored is not None and scored.placeholder:
            return self.env.step(action)
        if scored is None or scored.log_probs is None:
            raise ValueError(
                "KLPenalty needs the policy's generation log-probs with the action: step with "
                "ScoredAction(ids, log_probs) or the policy's output row"
            )
        ref = self.env.get_wrapper_attr(REFERENCE_METHOD)(scored)  # (n,) checked, before any step
        log_p = check_log_probs(scored.log_probs, len(ref), _POLICY_SOURCE)
        kl = kl_estimate(log_p.double(), ref.double(), self.estimator)  # (n,)
        if not torch.isfinite(kl).all():
            raise ValueError(f"the {self.estimator} KL estimate overflows on these log-probs; use k1 or k2")
        current_coef(self.controller)  # a broken controller fails before the env moves
        inner = dataclasses.replace(scored, ref_log_probs=ref.numpy().astype(np.float32))
        obs, task_reward, terminated, truncated, info = self.env.step(inner)
        kl_sum = float(kl.sum())
        # read and update together, after the step: envs sharing the controller see its updates one at a time
        coef = use_and_update(self.controller, [kl_sum])
        token_rewards = shape_token_rewards(kl, float(task_reward), coef)
        info.update(kl=kl.tolist(), token_rewards=token_rewards.tolist(), task_reward=float(task_reward), kl_coef=coef)
        return obs, float(task_reward) - coef * kl_sum, terminated, truncated, info
