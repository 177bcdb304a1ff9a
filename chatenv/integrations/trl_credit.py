"""Per-turn credit in TRL's ``GRPOTrainer``: each reply's tokens carry the advantage of its own turn.

TRL gives every token of a completion the advantage of the whole completion. On chatenv's multi-turn episodes a
completion holds every reply of an episode, and :class:`TurnCreditGRPOTrainer` replaces that advantage with a
``(B, T)`` tensor (TRL 1.16 takes one from subclasses): the tokens of reply ``t`` get the advantage of turn ``t``
(:func:`chatenv.rollout.credit.turn_advantages` on the env's per-turn rewards: return-to-go from turn ``t``
against turn ``t`` of the other episodes of its group, ``gamma`` and ``turn_baseline`` as there); the env's tokens
between the replies get 0 (TRL also masks them out with ``env_mask``)::

    from chatenv.integrations.trl import grpo_kwargs
    from chatenv.integrations.trl_credit import TurnCreditGRPOTrainer

    trainer = TurnCreditGRPOTrainer(model, args=config, train_dataset=data, **grpo_kwargs(env_id, max_turns=2))

Groups are TRL's: ``num_generations`` consecutive completions of the batch gathered from every process. Advantages
are divided by the group's spread of returns unless ``GRPOConfig(scale_rewards="none")``. The rewards are the env's
(what :func:`~chatenv.integrations.trl.env_reward` reports, turn by turn): a trainer with other reward functions is
refused (put those rewards in the task, or train with episode credit).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from tensordict import TensorDict

from chatenv.integrations.trl import lazy_classes
from chatenv.rollout.credit import BASELINES, token_advantages, turn_advantages

__all__ = ["TurnCreditGRPOTrainer", "per_token_advantages", "turn_rewards"]  # noqa: F822 - the trainer is made lazily


def per_token_advantages(
    view: Any,
    all_turn_rewards: torch.Tensor,
    group_size: int,
    first: int,
    width: int,
    *,
    gamma: float = 1.0,
    baseline: str = "loo",
    scale: bool = True,
) -> torch.Tensor:
    """The ``(len(view), width)`` advantages of the completions of ``view`` (TRL's ``completion_ids`` layout).

    Args:
        view: This process's episodes (:func:`chatenv.episodes`, one row per completion, in order).
        all_turn_rewards: ``(B_all, turns)`` per-turn rewards of the whole batch (every process; NaN past an
            episode's end); groups are ``group_size`` consecutive rows.
        group_size: Completions per group (TRL's ``num_generations``).
        first: Index of ``view``'s first row in the whole batch.
        width: The padded completion length.
        gamma: Discount of returns-to-go.
        baseline: ``"loo"`` or ``"survivors"`` (see :mod:`chatenv.rollout.credit`).
        scale: Divide by the group's spread of returns.

    Raises:
        ValueError: If a completion is longer than ``width`` or the batch does not split into groups.
    """
    n_all = all_turn_rewards.shape[0]
    if n_all % group_size:
        raise ValueError(f"a batch of {n_all} completions does not split into groups of {group_size}")
    batch = TensorDict(
        {"turn_reward": all_turn_rewards.float().cpu(), "group": torch.arange(n_all) // group_size}, batch_size=[n_all]
    )
    per_turn = turn_advantages(batch, gamma=gamma, baseline=baseline, scale=scale)[first : first + len(view)]
    dense = token_advantages(view, per_turn)
    prompts = view["tokens"].unpadded("prompt")
    out = torch.zeros(len(view), width)
    for k, (row, prompt) in enumerate(zip(dense, prompts)):
        completion = row[len(prompt) :]
        if len(completion) > width:
            raise ValueError(f"completion {k} has {len(completion)} tokens, more than TRL's {width}")
        out[k, : len(completion)] = completion
    return out


def turn_rewards(view: Any) -> torch.Tensor:
    """``(B, turns)`` float32 per-turn rewards of a view, NaN past each episode's end."""
    value = view["turn_reward"]
    rows = list(value.unbind()) if value.is_nested else list(value)
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), math.nan)
    for k, r in enumerate(rows):
        out[k, : len(r)] = r.float()
    return out


def _check_arguments(gamma: Any, turn_baseline: Any, kwargs: dict[str, Any]) -> None:
    """Refuse what per-turn credit cannot train with (see :class:`TurnCreditGRPOTrainer`)."""
    from chatenv.integrations.trl import ChatEnvRollout, env_reward

    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")
    if turn_baseline not in BASELINES:
        raise ValueError(f"turn_baseline must be one of {BASELINES}, got {turn_baseline!r}")
    if not isinstance(kwargs.get("rollout_func"), ChatEnvRollout):
        raise TypeError(
            "TurnCreditGRPOTrainer reads the turns of chatenv's episodes: pass "
            "**chatenv.integrations.trl.grpo_kwargs(env, ...) (its rollout_func)"
        )
    funcs = kwargs.get("reward_funcs")
    others = [f for f in (funcs if isinstance(funcs, (list, tuple)) else [funcs]) if f is not env_reward]
    if others:
        raise ValueError(
            "per-turn credit uses the env's turn rewards; other reward functions "
            f"({[getattr(f, '__name__', f) for f in others]}) have no turns: put them in the task "
            "(reward_fn) or train with GRPOTrainer (episode credit)"
        )


def _batch_advantages(trainer: Any, completions: torch.Tensor) -> torch.Tensor:
    """The ``(B, T)`` advantages of this process's completions, groups taken over every process's batch."""
    view = trainer.rollout_func.last_episodes
    acc = trainer.accelerator
    padded = acc.pad_across_processes(turn_rewards(view).to(acc.device), dim=1, pad_index=math.nan)
    size = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
    advantages = per_token_advantages(
        view,
        acc.gather(padded),
        size,
        acc.process_index * len(view),
        completions.shape[1],
        gamma=trainer.gamma,
        baseline=trainer.turn_baseline,
        scale=trainer.scale_rewards != "none",
    )
    return advantages.to(completions.device)


def _trainer_class() -> type:
    from trl.trainer.grpo_trainer import GRPOTrainer  # its defining module (trl's __init__ re-exports it lazily)

    from chatenv.integrations.trl_offpolicy import OffPolicyGRPOTrainer

    class TurnCreditGRPOTrainer(OffPolicyGRPOTrainer):  # type: ignore[misc]
        """``GRPOTrainer`` whose advantages are per turn (see :mod:`chatenv.integrations.trl_credit`).

        It corrects for off-policy replies as :class:`~chatenv.integrations.trl_offpolicy.OffPolicyGRPOTrainer`
        does: the turn advantages are weighed per token.

        Args:
            *args: ``GRPOTrainer``'s.
            gamma: Discount of the returns-to-go over turns (1: undiscounted).
            turn_baseline: ``"loo"`` (default; unbiased when the model decides when to stop) or ``"survivors"``.
            off_policy: The off-policy correction (default: token-level, truncated at 2).
            **kwargs: ``GRPOTrainer``'s; ``rollout_func`` must be chatenv's
                (:func:`~chatenv.integrations.trl.grpo_kwargs`), ``reward_funcs`` only ``env_reward``.

        Raises:
            TypeError: Without chatenv's ``rollout_func``.
            ValueError: For other reward functions, a bad ``gamma`` or ``turn_baseline``.
        """

        def __init__(
            self, *args: Any, gamma: float = 1.0, turn_baseline: str = "loo", off_policy: Any = None, **kwargs: Any
        ):
            bound = inspect.signature(GRPOTrainer.__init__).bind_partial(self, *args, **kwargs).arguments
            _check_arguments(gamma, turn_baseline, bound)
            self.gamma, self.turn_baseline = float(gamma), turn_baseline
            super().__init__(*args, off_policy=off_policy, **kwargs)

        def _chatenv_advantages(self, out: dict[str, Any]) -> torch.Tensor:
            return _batch_advantages(self, out["completion_ids"])

    return TurnCreditGRPOTrainer


__getattr__ = lazy_classes(__name__, {"TurnCreditGRPOTrainer": _trainer_class})
