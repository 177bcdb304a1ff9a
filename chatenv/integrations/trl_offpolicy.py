"""Off-policy correction in TRL's ``GRPOTrainer`` for chatenv's episodes (:mod:`chatenv.rollout.offpolicy`).

:class:`OffPolicyGRPOTrainer` is ``GRPOTrainer`` plus the correction :class:`~wrappers.grpo.GRPOLearner` makes:
after each generation it scores the completions under the trainer's current weights without grad (the proximal
log-probs, which also become TRL's ``old_per_token_logps``, so the clipping ratio is ``pi_theta / pi_old``),
compares them with the log-probs the policy sampled with, and weighs each sampled token by ``pi_old /
pi_rollout`` (token-level, truncated at 2 by default; per segment of turns from one policy version; or masked out
of range). Tokens sampled more than ``max_staleness`` versions behind the rollout policy's version now (a policy
you keep in sync with ``update_weights``) are dropped from the loss, as are masked ones::

    from chatenv.integrations.trl import grpo_kwargs
    from chatenv.integrations.trl_offpolicy import OffPolicyGRPOTrainer
    from chatenv.rollout.offpolicy import OffPolicyConfig

    trainer = OffPolicyGRPOTrainer(model, args=config, train_dataset=data, off_policy=OffPolicyConfig(cap=2.0),
                                   **grpo_kwargs(env_id, max_turns=2))

The weights multiply the per-token advantages (a ``(B, T)`` tensor, which TRL 1.16's loss takes): for every loss
type whose per-token loss is linear in the advantage (all of TRL's but ``vespo``, refused) this is the weighted
loss; the KL term is not weighted. TRL's own vLLM correction (``vllm_importance_sampling_correction``, a weight
``exp(sum)`` over the completion in its sequence modes) is turned off so tokens are not weighed twice. Metrics are
logged as ``off_policy/<name>`` (:class:`~chatenv.rollout.offpolicy.OffPolicyStats`; this process's tokens).
This reaches into TRL's ``_generate_and_score_completions`` and ``_get_per_token_logps_and_entropies`` (TRL 1.16).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from chatenv.integrations.trl import lazy_classes
from chatenv.rollout.offpolicy import OffPolicyConfig, OffPolicyStats, correct, token_versions

__all__ = ["OffPolicyGRPOTrainer", "completion_weights"]  # noqa: F822 - the trainer is made lazily


def _completion_versions(view: Any, width: int) -> list[torch.Tensor] | None:
    """Per completion of ``view``, the version that sampled each of its ``width`` tokens (-2 off the replies)."""
    if view is None or "turn_version" not in view.keys():
        return None
    completions = view["tokens"].unpadded("response")
    columns = [view[key] for key in ("turn_start", "turn_length", "turn_version")]
    rows = [list(c.unbind()) if c.is_nested else list(c) for c in columns]
    out = []
    for e, (c, n) in enumerate(zip(completions, view["num_turns"].tolist())):
        versions = token_versions(len(c), rows[0][e][:n], rows[1][e][:n], rows[2][e][:n])
        out.append(torch.cat([versions, torch.full((max(width - len(c), 0),), -2, dtype=torch.long)])[:width])
    return out


def completion_weights(
    sampling: torch.Tensor,
    old: torch.Tensor,
    mask: torch.Tensor,
    config: OffPolicyConfig,
    *,
    view: Any = None,
    current: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, OffPolicyStats]:
    """Importance weights of TRL's ``(B, T)`` completions.

    Args:
        sampling: ``(B, T)`` log-probs the policy sampled with (NaN on the env's tokens).
        old: ``(B, T)`` log-probs under the trainer's current weights.
        mask: ``(B, T)`` the tokens TRL trains on (completion mask times env mask).
        config: How to weigh.
        view: The episodes of the rows (:func:`chatenv.episodes`, same order), for the replies' versions.
        current: The rollout policy's version now.

    Returns:
        ``(weight, keep, stats)``: float32 weights (0 where not trained), the tokens kept, the step's statistics.
    """
    stats = OffPolicyStats()
    weight = torch.zeros(sampling.shape, dtype=torch.float32)
    keep = torch.zeros(sampling.shape, dtype=torch.bool)
    versions = _completion_versions(view, sampling.shape[1])
    if versions is not None and len(versions) != len(sampling):
        raise ValueError(f"{len(versions)} episodes for {len(sampling)} completions: they must match row by row")
    sampling, old, mask = sampling.detach().cpu(), old.detach().cpu(), mask.detach().cpu()
    for b in range(len(sampling)):
        at = (mask[b].bool() & torch.isfinite(sampling[b])).nonzero().squeeze(-1)
        fix = correct(
            sampling[b][at], old[b][at], config, versions=None if versions is None else versions[b][at], current=current
        )
        stats.add(fix)
        weight[b, at] = fix.weight.float()
        keep[b, at] = fix.keep
    return weight, keep, stats


def _correct_output(trainer: Any, out: dict[str, Any], advantages: torch.Tensor) -> OffPolicyStats | None:
    """Weigh ``out``'s advantages (``(B, T)`` then) and mask the dropped tokens out, given ``old_per_token_logps``."""
    from chatenv.integrations.trl import ChatEnvRollout

    sampling = out.get("sampling_per_token_logps")
    if sampling is None:  # a policy that reports no log-probs: nothing to compare
        out["advantages"] = advantages
        return None
    completion_mask = out["completion_mask"]
    mask = completion_mask * out["tool_mask"] if "tool_mask" in out else completion_mask
    rollout = trainer.rollout_func if isinstance(trainer.rollout_func, ChatEnvRollout) else None
    weight, keep, stats = completion_weights(
        sampling,
        out["old_per_token_logps"],
        mask,
        trainer.off_policy,
        view=None if rollout is None else rollout.last_episodes,
        current=None if rollout is None else rollout.last_version,
    )
    device = completion_mask.device
    per_token = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(weight.shape)
    out["advantages"] = per_token * weight.to(device)
    out["tool_mask"] = mask * keep.to(device, mask.dtype)  # dropped tokens leave the loss and the per-row means
    if "num_items_in_batch" in out:
        # the token-sum losses (dapo, cispo) divide by this count, which TRL took before the tokens were dropped:
        # count again as TRL does (the loss mask's sum over every process), so the kept tokens are the denominator
        loss_mask = completion_mask * out["tool_mask"]
        out["num_items_in_batch"] = trainer.accelerator.gather(loss_mask.sum()).sum()
    return stats


def _trainer_class() -> type:
    from trl.trainer.grpo_trainer import GRPOTrainer  # its defining module (trl's __init__ re-exports it lazily)

    class OffPolicyGRPOTrainer(GRPOTrainer):
        """``GRPOTrainer`` with chatenv's off-policy correction (see :mod:`chatenv.integrations.trl_offpolicy`).

        Args:
            *args: ``GRPOTrainer``'s.
            off_policy: The correction (default :class:`~chatenv.rollout.offpolicy.OffPolicyConfig`: token-level,
                truncated at 2); ``OffPolicyConfig(level="none")`` keeps TRL's loss as it is (staleness still
                applies).
            **kwargs: ``GRPOTrainer``'s.

        Raises:
            TypeError: For ``off_policy`` other than an ``OffPolicyConfig``.
            ValueError: For ``loss_type="vespo"`` with a correction (it weighs sequences itself).
        """

        def __init__(self, *args: Any, off_policy: OffPolicyConfig | None = None, **kwargs: Any):
            config = OffPolicyConfig() if off_policy is None else off_policy
            if not isinstance(config, OffPolicyConfig):
                raise TypeError(f"off_policy must be an OffPolicyConfig, got {type(config).__name__}")
            super().__init__(*args, **kwargs)
            if config.level != "none" and self.loss_type == "vespo":
                raise ValueError("loss_type='vespo' weighs sequences itself: use off_policy=OffPolicyConfig('none')")
            self.off_policy = config
            self.vllm_importance_sampling_correction = False  # the weights below replace TRL's

        def _chatenv_advantages(self, out: dict[str, Any]) -> torch.Tensor:
            """The advantages to weigh: TRL's (``(B,)``); subclasses give ``(B, T)`` ones."""
            advantages: torch.Tensor = out["advantages"]
            return advantages

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            out: dict[str, Any] = super()._generate_and_score_completions(inputs)
            if out.get("sampling_per_token_logps") is not None and out.get("old_per_token_logps") is None:
                out["old_per_token_logps"] = self._proximal(out)
            stats = _correct_output(self, out, self._chatenv_advantages(out))
            mode = "train" if getattr(self.model, "training", False) else "eval"
            for name, value in (stats.metrics() if stats is not None else {}).items():
                if not math.isnan(value):
                    self._metrics[mode][f"off_policy/{name}"].append(value)
            return out

        def _proximal(self, out: dict[str, Any]) -> torch.Tensor:
            """The completions' log-probs under the trainer's current weights, without grad."""
            input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            attention_mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            args = self.args
            batch_size = (
                args.per_device_train_batch_size
                if getattr(self.model, "training", False)
                else args.per_device_eval_batch_size
            )
            with torch.no_grad():
                logps: torch.Tensor = self._get_per_token_logps_and_entropies(
                    self.model, input_ids, attention_mask, out["completion_ids"].size(1), batch_size=batch_size
                )[0]
            return logps

    return OffPolicyGRPOTrainer


__getattr__ = lazy_classes(__name__, {"OffPolicyGRPOTrainer": _trainer_class})
