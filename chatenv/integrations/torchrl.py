"""TorchRL over chatenv: envs as TorchRL envs, rollouts as GRPO batches, policies as trainable actors.

Three calls cover what TorchRL needs (extra ``torchrl``: ``pip install 'chatenv-gym[torchrl]'``):

- :func:`gym_env` (or :func:`register` then TorchRL's own ``GymEnv`` / ``GymWrapper``): a chatenv env as a TorchRL
  env. Token observations and actions are ``Categorical`` specs of variable length (int64 ids, shape ``(-1,)``)
  instead of a 49152-wide one-hot per token; chats and text are ``NonTensor`` specs; the token-level env's
  ``Discrete`` action is a categorical id.
- :func:`grpo_batch`: a :func:`chatenv.rollout` collected with ``group_size=G`` (or its :func:`chatenv.episodes`
  view) as one row per episode in the shapes TorchRL's ``GRPOLoss`` and ``MCAdvantage`` read: padded ``tokens`` /
  ``masks`` / ``log_probs`` containers, ``("next", "reward")`` of shape ``(E, 1, 1)``, ``("next", "done")`` of
  shape ``(E, 1)``, the ``group`` id per episode and the group-normalised ``advantage`` ``(E, 1, 1)``.
- :func:`grpo_actor`: a scoring copy of a policy wrapper that keeps the autograd graph, to pass as
  ``GRPOLoss(actor_network=...)``.

The advantages are :func:`chatenv.rollout.credit.group_advantages` with TorchRL's numerics (``clamp=True``:
``(r - mean_g) / max(std_g, eps)``, as ``MCAdvantage``):

    >>> from chatenv.rollout.credit import group_advantages
    >>> group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), torch.tensor([0, 0, 1, 1]), eps=1e-6, clamp=True).tolist()
    [0.7071067690849304, -0.7071067690849304, 0.0, 0.0]
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from chatenv.errors import MissingDependencyError
from chatenv.rollout import episodes
from chatenv.rollout.credit import group_advantages
from chatenv.spaces import ChatText, MessagesSpace, TokenIds

__all__ = ["grpo_actor", "grpo_batch", "gym_env", "register"]

_EXTRA = "pip install 'chatenv-gym[torchrl]'"
_state = {"registered": False}


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(f"the TorchRL integration needs {module}: {_EXTRA}") from e


# ------------------------------------------------------------------------------------------------ specs


def _token_ids_spec(space: TokenIds, device: Any = None, **_: Any) -> Any:
    """Variable-length int64 ids in ``[0, vocab_size)``: one id per position, not a one-hot row per id."""
    data = _require("torchrl.data")
    return data.Categorical(space.vocab_size, shape=(-1,), dtype=torch.int64, device=device)


def _messages_spec(space: MessagesSpace, device: Any = None, **_: Any) -> Any:
    """A chat (a list of message dicts) per env: a non-tensor entry."""
    data = _require("torchrl.data")
    return data.NonTensor((), device=device, example_data=[{"role": "user", "content": "Hi"}])


def _text_spec(space: ChatText, device: Any = None, **_: Any) -> Any:
    """Rendered chat text per env: a non-tensor entry."""
    data = _require("torchrl.data")
    return data.NonTensor((), device=device, example_data="text")


def register() -> None:
    """Teach TorchRL's Gymnasium spec conversion chatenv's spaces; calling it again does nothing.

    Registers, through TorchRL's public ``torchrl.envs.register_gym_spec_conversion``: :class:`TokenIds` as a
    variable-length ``Categorical`` of int64 ids (shape ``(-1,)``), :class:`MessagesSpace` and :class:`ChatText` as
    ``NonTensor``. Without it TorchRL reads :class:`TokenIds` as a Gymnasium ``Sequence`` of ``Discrete`` ids: a
    one-hot ``(-1, vocab_size)`` spec, and it cannot convert :class:`MessagesSpace` at all.

    Raises:
        MissingDependencyError: If TorchRL is not installed (naming the extra).
    """
    if _state["registered"]:
        return
    envs = _require("torchrl.envs")
    for space, convert in ((TokenIds, _token_ids_spec), (MessagesSpace, _messages_spec), (ChatText, _text_spec)):
        envs.register_gym_spec_conversion(space)(convert)
    _state["registered"] = True


def gym_env(env: Any, *, categorical_action_encoding: bool = True, **kwargs: Any) -> Any:
    """A chatenv env as a TorchRL env (specs registered first, see :func:`register`).

    Args:
        env: A registered env id (``"chatenv/Arithmetic-v0"``: built by TorchRL's ``GymEnv``, with ``kwargs`` going
            to ``gymnasium.make`` or TorchRL) or an env object (wrapped by TorchRL's ``GymWrapper``).
        categorical_action_encoding: ``Discrete`` actions (the token-level env's) as categorical ids rather than
            one-hot rows of ``vocab_size``.
        **kwargs: More arguments of ``GymEnv`` (env arguments such as ``input_mode``, ``max_turns``) or
            ``GymWrapper``.

    Returns:
        The TorchRL env. Observations sit at ``"observation"`` (int64 ids, a chat or text), the action at
        ``"action"`` (ids, text or a message dict, as the env takes them).

    Example:
        ``env = gym_env("chatenv/Arithmetic-v0", input_mode="tokens"); td = env.reset()``, then
        ``td["action"] = reply_ids; env.step(td)["next", "reward"]``.

    Raises:
        MissingDependencyError: If TorchRL is not installed.
        TypeError: If ``env`` is neither an env id nor a Gymnasium env.
    """
    register()
    libs = _require("torchrl.envs")
    if isinstance(env, str):
        return libs.GymEnv(env, categorical_action_encoding=categorical_action_encoding, **kwargs)
    if not hasattr(env, "step") or not hasattr(env, "observation_space"):
        raise TypeError(f"gym_env takes an env id (str) or a Gymnasium env, got {type(env).__name__}")
    return libs.GymWrapper(env, categorical_action_encoding=categorical_action_encoding, **kwargs)


# ------------------------------------------------------------------------------------------------ GRPO


def _check_groups(groups: torch.Tensor) -> None:
    """TorchRL's group-relative losses need at least two episodes per group."""
    for g in torch.unique(groups).tolist():
        n = int((groups == g).sum())
        if n < 2:
            raise ValueError(
                f"group {g} has {n} episode; group-normalised advantages need at least 2 per group "
                "(rollout(..., group_size=G) with G >= 2 and episodes a multiple of G)"
            )


def _episode_view(td: Any) -> TensorDictBase:
    """``td`` as one row per episode: an episode view as is, a turn-level rollout through :func:`episodes`."""
    if not isinstance(td, TensorDictBase):
        raise TypeError(f"expected the TensorDict of chatenv.rollout or chatenv.episodes, got {type(td).__name__}")
    keys = set(td.keys())
    if "turn_start" in keys:
        return td
    if {"episode", "turn", "tokens"} <= keys:
        return episodes(td)
    raise ValueError(
        "expected the TensorDict of chatenv.rollout (with 'episode', 'turn', 'tokens') or of chatenv.episodes; got "
        f"keys {sorted(str(k) for k in keys)}"
    )


def _check_episodes(view: TensorDictBase, group_key: str, reward_key: str) -> None:
    keys = set(view.keys())
    if group_key not in keys:
        raise ValueError(
            f"the rollout has no {group_key!r} column: collect it with chatenv.rollout(..., group_size=G) so the G "
            "episodes started from the same reset share a group id (or name the column with group_key=)"
        )
    if reward_key not in keys:
        raise ValueError(f"no {reward_key!r} column in the episode view; choose reward_key among {sorted(keys)}")
    unfinished = (~(view["terminated"] | view["truncated"])).nonzero().flatten().tolist()
    if unfinished:
        raise ValueError(
            f"episodes at rows {unfinished} did not finish; GRPO scores whole episodes: collect with "
            "chatenv.rollout(..., episodes=N) rather than steps="
        )


def grpo_batch(
    td: TensorDictBase,
    *,
    group_key: str = "group",
    reward_key: str = "reward",
    advantage: bool = True,
    eps: float = 1e-6,
) -> TensorDict:
    """One row per episode, in the shapes TorchRL's ``GRPOLoss`` and ``MCAdvantage`` read.

    Args:
        td: What :func:`chatenv.rollout` returned (collected with ``group_size=G``), or its
            :func:`chatenv.episodes` view.
        group_key: The column holding each episode's group id (episodes from the same reset).
        reward_key: The episode view's column to learn from: ``"reward"`` (the env's reward summed over turns,
            KL-shaped if the envs were) or ``"task_reward"``.
        advantage: Write ``"advantage"`` (:func:`~chatenv.rollout.credit.group_advantages`, ``clamp=True``).
            ``False`` leaves it to TorchRL's ``MCAdvantage(grpo_size=G, prompt_key=group_key)``, which computes the
            same values.
        eps: Floor of each group's reward standard deviation.

    Returns:
        The episode view (see :func:`chatenv.episodes`) with padded ``tokens`` / ``masks`` / ``log_probs`` (what
        ``GRPOLoss`` reads at ``("tokens", "full")`` and ``("log_probs", "full")``; NaN log-probs on tokens that
        were not sampled keep them out of the loss), ``("next", "reward")`` ``(E, 1, 1)``, ``("next", "done" |
        "terminated" | "truncated")`` ``(E, 1)``, ``("next", "ref_log_probs")`` if recorded, and ``advantage``
        ``(E, 1, 1)``.

    Raises:
        TypeError: If ``td`` is not a TensorDict.
        ValueError: For a TensorDict that is no rollout, no group column, unfinished episodes, or a group of fewer
            than 2 episodes.
    """
    view = _episode_view(td)
    _check_episodes(view, group_key, reward_key)
    out = view.clone(recurse=False)
    for key in ("tokens", "masks", "log_probs", "ref_log_probs"):
        if key in view.keys() and not view[key].padded:
            out.set(key, view[key].to_padded())
    n = view.batch_size[0]
    reward = view[reward_key].to(torch.float32).reshape(n, 1, 1)
    out.set(("next", "reward"), reward)
    out.set(("next", "done"), torch.ones(n, 1, dtype=torch.bool))
    out.set(("next", "terminated"), view["terminated"].reshape(n, 1).clone())
    out.set(("next", "truncated"), view["truncated"].reshape(n, 1).clone())
    if "ref_log_probs" in out.keys():
        out.set(("next", "ref_log_probs"), out["ref_log_probs"])
    if advantage:
        _check_groups(torch.as_tensor(view[group_key]).reshape(-1))
        advantages = group_advantages(reward.reshape(n), view[group_key], eps=eps, clamp=True)
        out.set("advantage", advantages.reshape(n, 1, 1))
    return out


def grpo_actor(policy: Any) -> Any:
    """A copy of a policy wrapper to train through TorchRL's ``GRPOLoss(actor_network=...)``.

    It scores (``generate=False``) the batch's token ids verbatim (``input_mode="tokens"``: nothing re-tokenized)
    and keeps the autograd graph (``requires_grad=True``); it shares the model with ``policy``.

    Raises:
        TypeError: If ``policy`` is not a chatenv policy wrapper.
        ValueError: If its backend cannot keep a graph (vLLM).
    """
    if not callable(getattr(policy, "get_new_version", None)):
        raise TypeError(f"expected a chatenv policy wrapper (e.g. TransformersWrapper), got {type(policy).__name__}")
    return policy.get_new_version(generate=False, input_mode="tokens", requires_grad=True, pad_output=True)
