"""Reference-model log-probs and KL penalties for the turn-level chat env.

- :class:`ReferenceModel`: a frozen transformers model that scores token ids (fp32, no autograd).
- :class:`ScoredAction`: generated ids with the policy's log-probs (and optionally reference log-probs computed
  elsewhere, e.g. in one batch for many envs); the wrappers below unpack it and pass the ids to the env.
- :class:`RefLogProbs`: after each step, ``info["ref_log_probs"]`` holds the reference log-probs of the turn's
  generated tokens.
- :class:`KLPenalty`: per-token KL between the policy and the reference on those tokens (estimators k1, k2,
  k3), ``info["kl"]`` and ``info["token_rewards"]`` (``-coef * kl_t``, the task reward added on the last token),
  and the step reward ``task_reward - coef * sum_t kl_t``. The coefficient comes from a constant or a
  :mod:`~wrappers.kl_controllers` controller, which is fed the turn's KL.

The policy's own generation-time log-probs are reused: a KL needs one reference forward, not a second policy
pass.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch

from chatenv.actions import ScoredAction
from wrappers.kl_controllers import ConstantKLController, KLController

__all__ = ["KLPenalty", "RefLogProbs", "ReferenceModel", "ScoredAction", "kl_estimate"]


def kl_estimate(log_p: torch.Tensor, log_q: torch.Tensor, estimator: str = "k1") -> torch.Tensor:
    """Per-token KL(p || q) estimates from the log-probs of the sampled tokens (Schulman's k1, k2, k3).

    k1 = log p - log q; k2 = (log p - log q)^2 / 2; k3 = exp(log q - log p) - 1 - (log q - log p).
    """
    log_ratio = log_p - log_q
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    raise ValueError(f"estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


class ReferenceModel:
    """A frozen transformers causal LM that returns log p(x_t | x_<t) of given ids.

    Args:
        model: A ``PreTrainedModel``, a path, or ``"default"`` (the embedded SmolLM2).
        tokenizer: Its tokenizer (loaded with a path or ``"default"``).
        batch_size: Sequences per forward pass (default: all at once).
        temperature: Temperature of the reference distribution. Set it to the policy's sampling temperature:
            the policy reports log-probs of the tempered distribution it sampled from, and a KL compares
            distributions at the same temperature (a model against its own copy then gives 0). Alternatively
            keep 1.0 and create the policy with ``raw_log_probs=True``.
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, batch_size: int | None = None, temperature: float = 1.0):
        from wrappers.policies import TransformersWrapper

        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self._scorer = TransformersWrapper(
            model,
            tokenizer=tokenizer,
            generate=False,
            input_mode="tokens",
            raw_log_probs=temperature == 1.0,
            generate_kwargs={"temperature": temperature},
            score_batch_size=batch_size,
        )
        self.temperature = temperature
        self.model = self._scorer.model
        self.tokenizer = self._scorer.tokenizer

    def log_probs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Per sequence, ``(T,)`` float32 log-probs; position 0 (no context) is NaN."""
        if not sequences:
            return []
        return self._scorer._score_ids([list(map(int, s)) for s in sequences], [len(s) for s in sequences])


def _from_policy_output(td: Any) -> ScoredAction:
    """A :class:`ScoredAction` from one row of a policy wrapper's output (``tokens`` and ``log_probs``)."""
    tokens, lps = td.get("tokens"), td.get("log_probs", None)
    if tokens is None or tokens.batch_dims != 1 or tokens.batch_size[0] != 1:
        raise ValueError("expected a policy output with one row (batch size (1,))")
    ids = tokens.unpadded("response")[0]
    lp = lps.unpadded("response")[0] if lps is not None else None
    return ScoredAction(ids.numpy(), None if lp is None else lp.numpy())


def _unpack(action: Any) -> tuple[Any, ScoredAction | None]:
    from tensordict import TensorDictBase

    if isinstance(action, TensorDictBase):
        action = _from_policy_output(action)
    if isinstance(action, ScoredAction):
        return np.asarray(action.ids, dtype=np.int64), action
    return action, None


def _as_tensor(values: Any, n: int, what: str) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(values, dtype=np.float32)).reshape(-1)
    if t.shape[0] != n:
        raise ValueError(f"{what} has {t.shape[0]} values for {n} generated tokens")
    return t


class RefLogProbs(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Adds the reference model's log-probs of each step's generated tokens to ``info["ref_log_probs"]``.

    Turn-level env (:class:`~chatenv.envs.ChatEnv`): the turn's tokens; token-level env
    (:class:`~chatenv.envs.TokenEnv`): the one token of the step.

    Args:
        env: A :class:`~chatenv.envs.ChatEnv` (possibly wrapped).
        ref_model: A :class:`ReferenceModel` (or anything with ``log_probs(sequences)``), or None when the
            reference log-probs always come with the action (``ScoredAction.ref_log_probs``, as
            ``chatenv.rollout(..., ref_model=...)`` provides them, e.g. for envs in other processes).
    """

    def __init__(self, env: gym.Env, ref_model: Any = None):
        gym.utils.RecordConstructorArgs.__init__(self, ref_model=ref_model)
        gym.Wrapper.__init__(self, env)
        from chatenv.envs import ChatEnv, TokenEnv

        if not isinstance(env.unwrapped, (ChatEnv, TokenEnv)):
            raise TypeError(f"RefLogProbs wraps a chatenv ChatEnv or TokenEnv, got {type(env.unwrapped).__name__}")
        self.ref_model = ref_model
        self._token_level = isinstance(env.unwrapped, TokenEnv)

    def step(self, action: Any):  # noqa: D102
        ids, scored = _unpack(action)
        if scored is not None and scored.placeholder:
            return self.env.step(ids)
        precomputed = scored is not None and scored.ref_log_probs is not None
        if not precomputed and self.ref_model is None:
            raise ValueError(
                "RefLogProbs has no reference model and the action carries no ref_log_probs; pass ref_model=... "
                "to RefLogProbs, or ref_model=... to chatenv.rollout"
            )
        start = len(self.env.unwrapped.token_ids)
        obs, reward, terminated, truncated, info = self.env.step(ids if scored is not None else action)
        n = 1 if self._token_level else int(info["response_tokens"])
        if precomputed:
            ref = _as_tensor(scored.ref_log_probs, n, "ref_log_probs")
        else:
            seq = self.env.unwrapped.token_ids[: start + n].tolist()
            ref = self.ref_model.log_probs([seq])[0][start : start + n]
        # per-token values are lists: vector envs stack ndarray infos only when every env's has the same shape
        info["ref_log_probs"] = ref.tolist()
        if scored is not None and scored.log_probs is not None:
            info["log_probs"] = _as_tensor(scored.log_probs, n, "log_probs").tolist()
        return obs, reward, terminated, truncated, info


class KLPenalty(gym.Wrapper, gym.utils.RecordConstructorArgs):
    """Subtracts ``coef * sum_t kl_t`` over each turn's generated tokens from the task reward.

    Step it with a :class:`ScoredAction` (or a policy output row): the policy's generation log-probs come with
    the action. The reference log-probs come from a :class:`RefLogProbs` below this wrapper, or from
    ``ref_model`` (then one is added).

    Args:
        env: The env (with :class:`RefLogProbs` applied, or give ``ref_model``).
        coef: Constant KL coefficient (default 0.1 when no controller is given).
        controller: A KL controller; it is updated after every step with the turn's summed KL.
        estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"``.
        assistant_only: Penalise only assistant tokens (in a turn-level env every generated token is one).
        ref_model: Reference model, when ``env`` has no :class:`RefLogProbs`.

    ``info`` gains ``kl`` (per token, a list of floats), ``token_rewards`` (``-coef * kl_t``, plus the task reward
    on the last token), ``task_reward``, ``kl_coef`` (the coefficient used for this step). With a token-level env
    each step is one token: the reward is ``-coef * kl_t``, plus the task's reward at the step that ends a reply; the
    controller then sees one token's KL per step.
    """

    def __init__(
        self,
        env: gym.Env,
        coef: float | None = None,
        *,
        controller: KLController | None = None,
        estimator: str = "k1",
        assistant_only: bool = True,
        ref_model: Any = None,
    ):
        gym.utils.RecordConstructorArgs.__init__(
            self, coef=coef, controller=controller, estimator=estimator, assistant_only=assistant_only
        )
        if coef is not None and controller is not None:
            raise ValueError("give coef=... or controller=..., not both")
        kl_estimate(torch.zeros(1), torch.zeros(1), estimator)  # validates the name
        if ref_model is not None:
            env = RefLogProbs(env, ref_model)
        elif not _has_wrapper(env, RefLogProbs):
            raise ValueError("KLPenalty needs reference log-probs: wrap the env with RefLogProbs or pass ref_model=...")
        gym.Wrapper.__init__(self, env)
        self.controller = controller if controller is not None else ConstantKLController(0.1 if coef is None else coef)
        self.estimator = estimator
        self.assistant_only = assistant_only

    def step(self, action: Any):  # noqa: D102
        ids, scored = _unpack(action)
        if scored is not None and scored.placeholder:
            return self.env.step(scored)
        if scored is None or scored.log_probs is None:
            raise ValueError(
                "KLPenalty needs the policy's generation log-probs with the action: step with "
                "ScoredAction(ids, log_probs) or the policy's output row"
            )
        obs, task_reward, terminated, truncated, info = self.env.step(scored)
        log_p = torch.as_tensor(info["log_probs"])
        log_q = torch.as_tensor(info["ref_log_probs"])
        if torch.isnan(log_p).any() or torch.isnan(log_q).any():
            raise ValueError("undefined (NaN) log-probs among the generated tokens; cannot compute the KL")
        kl = kl_estimate(log_p, log_q, self.estimator)
        coef = float(self.controller.coef)
        token_rewards = -coef * kl
        if len(token_rewards):
            token_rewards[-1] += float(task_reward)
        reward = float(task_reward) - coef * float(kl.sum())
        self.controller.update([float(kl.sum())])
        info.update(kl=kl.tolist(), token_rewards=token_rewards.tolist(), task_reward=float(task_reward), kl_coef=coef)
        return obs, reward, terminated, truncated, info


def _has_wrapper(env: gym.Env, cls: type) -> bool:
    while isinstance(env, gym.Wrapper):
        if isinstance(env, cls):
            return True
        env = env.env
    return False
