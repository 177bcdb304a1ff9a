"""GRPO on whole multi-turn episodes: the training step of ``chatenv train``, reusable in any loop.

:class:`GRPOLearner` takes the episode view of a grouped rollout (``chatenv.episodes(chatenv.rollout(envs, policy,
episodes=P * G, group_size=G))``: one row per episode, G episodes per problem) and makes one optimizer step:

1. **advantages**: each episode's reward relative to the other episodes of its group,
   ``(r - mean_g) / (std_g + eps)`` (:func:`group_advantages`; a group whose rewards are all equal teaches nothing);
2. **log-probs** of every assistant token of the episode (all its replies; the env's feedback in between is context,
   never trained on), with autograd, from the policy wrapper's own scorer, so the temperature the replies were
   sampled at is applied the same way;
3. **off-policy correction** (:mod:`chatenv.rollout.offpolicy`): before the update, the sampled tokens are scored
   again under the current weights without grad (the proximal log-probs ``old``); the rollout-vs-trainer mismatch
   is measured, and each token gets an importance weight ``pi_old / pi_rollout`` (token-level, truncated at 2 by
   default; or per segment of turns from one policy version, as a geometric mean; or masked out of range), and
   tokens sampled more than ``max_staleness`` versions ago are dropped;
4. **loss** per episode: the clipped policy-gradient surrogate ``pi_theta / pi_old``, times the (detached)
   importance weight, plus ``kl`` times a per-token KL estimate to the reference (k3 by default:
   ``exp(q - p) - 1 + p - q``, >= 0), averaged over the episode's trained tokens, then over episodes;
5. gradient clipping, an optimizer step (holding the policy's weights lock, so no batched generation runs on
   half-updated weights), the policy's ``version`` bumped, and the KL fed to the coefficient's controller.

The reference log-probs come with the view when the envs were wrapped by :class:`wrappers.kl.RefLogProbs` (one
batched reference forward per round of the rollout), or from ``ref_model``. For a KL penalty in the *reward*
instead, wrap the envs with :class:`wrappers.kl.KLPenalty` (the view's ``reward`` is then the task reward minus
``coef * sum(kl)``) and use ``kl=0`` here, so the KL is not counted twice.

Example:
    >>> [round(a, 3) for a in group_advantages([1.0, 0.0, 0.0, 0.0, 2.0, 2.0], groups=[0, 0, 0, 0, 1, 1]).tolist()]
    [1.5, -0.5, -0.5, -0.5, 0.0, 0.0]
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import InitVar, dataclass
from typing import Any

import torch

from chatenv.rollout.credit import BASELINES, group_advantages, token_advantages, turn_advantages, value_advantages
from chatenv.rollout.offpolicy import Correction, OffPolicyConfig, OffPolicyStats, correct, token_versions
from wrappers.kl.controllers import as_controller, current_coef, refuse_renamed
from wrappers.kl.estimators import check_estimator, kl_estimate

__all__ = ["CREDITS", "GRPOConfig", "GRPOLearner", "group_advantages"]

#: how advantages are spread over an episode's tokens (see :class:`GRPOConfig`)
CREDITS = ("episode", "turn", "branch")


@dataclass
class GRPOConfig:
    """Settings of :class:`GRPOLearner`.

    Attributes:
        lr: Learning rate of the default optimizer (AdamW, no weight decay).
        kl: KL coefficient: a number (>= 0; 0 turns the KL term off) or a controller from
            :mod:`wrappers.kl.controllers` (fed each episode's summed KL after every step).
        estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (default), for the loss term and the reported KL.
        clip_eps: PPO-style clipping of the probability ratio to ``[1 - clip_eps, 1 + clip_eps]``.
        max_grad_norm: Clip the gradient's global norm to this (None: no clipping).
        scale_advantages: Divide advantages by the group's std (see :func:`group_advantages`).
        micro_batch: Episodes per forward/backward pass (bounds memory; the step is the same).
        credit: ``"episode"`` (default): every token of an episode gets the episode's advantage. ``"turn"``: each
            reply's tokens get that turn's advantage, its return-to-go against the same turn of the other
            episodes of the group (:func:`chatenv.rollout.credit.turn_advantages`; with branch rollouts the group
            is the branch point). ``"branch"``: each reply's tokens get ``r + gamma * V(next) - V(before)`` with
            state values sampled by branching (:func:`chatenv.rollout.credit.value_advantages`; pass
            :func:`~chatenv.rollout.credit.branch_values` to :meth:`GRPOLearner.step`).
        turn_baseline: With ``credit="turn"``: ``"loo"`` (unbiased, ended episodes count with return 0) or
            ``"survivors"``; see :mod:`chatenv.rollout.credit`.
        gamma: With ``credit="turn"`` or ``"branch"``: discount of later turns' rewards in the return-to-go.
        is_level: Importance weights between the rollout's and the trainer's log-probs: ``"token"`` (default),
            ``"sequence"`` (per segment of turns from one version, length-normalised) or ``"none"`` (no weights;
            the clipping ratio is then taken against the rollout's log-probs). See :mod:`chatenv.rollout.offpolicy`.
        is_mode: ``"truncate"`` (default; weight ``min(ratio, is_cap)``) or ``"mask"`` (ratios outside
            ``[is_low, is_cap]`` are dropped from the loss).
        is_cap: Upper bound of the weights (2.0: a token may count at most twice, while engine noise, whose
            ratios sit near 1, passes unchanged; every token is still trained on).
        is_low: Lower bound of the kept ratios with ``is_mode="mask"`` (default ``1 / is_cap``).
        max_staleness: Tokens sampled more than this many policy versions behind the policy's current
            ``version`` are dropped (None: no limit).
    """

    lr: float = 3e-5
    kl: Any = 0.05
    estimator: str = "k3"
    clip_eps: float = 0.2
    max_grad_norm: float | None = 1.0
    scale_advantages: bool = True
    micro_batch: int = 4
    credit: str = "episode"
    turn_baseline: str = "loo"
    gamma: float = 1.0
    is_level: str = "token"
    is_mode: str = "truncate"
    is_cap: float = 2.0
    is_low: float | None = None
    max_staleness: int | None = None
    # the old spellings, refused with a message naming the new ones
    kl_coef: InitVar[Any] = None
    kl_estimator: InitVar[Any] = None

    def __post_init__(self, kl_coef: Any, kl_estimator: Any) -> None:
        old = {k: v for k, v in {"kl_coef": kl_coef, "kl_estimator": kl_estimator}.items() if v is not None}
        refuse_renamed("GRPOConfig", old)
        for name in ("lr", "clip_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"GRPOConfig.{name} must be a finite number > 0, got {value!r}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"GRPOConfig.max_grad_norm must be > 0 or None, got {self.max_grad_norm!r}")
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ValueError(f"GRPOConfig.micro_batch must be a positive int, got {self.micro_batch!r}")
        check_estimator(self.estimator)
        if self.credit not in CREDITS:
            raise ValueError(f"GRPOConfig.credit must be one of {CREDITS}, got {self.credit!r}")
        if self.turn_baseline not in BASELINES:
            raise ValueError(f"GRPOConfig.turn_baseline must be one of {BASELINES}, got {self.turn_baseline!r}")
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)) or not 0 <= self.gamma <= 1:
            raise ValueError(f"GRPOConfig.gamma must be a number in [0, 1], got {self.gamma!r}")
        as_controller(self.kl, "GRPOConfig.kl")  # a bad coefficient fails here, not at the first step
        try:
            _ = self.off_policy
        except ValueError as e:
            raise ValueError(f"GRPOConfig: {e}") from None

    @property
    def off_policy(self) -> OffPolicyConfig:
        """The off-policy correction these settings ask for."""
        return OffPolicyConfig(self.is_level, self.is_mode, self.is_cap, self.is_low, self.max_staleness)


# the InitVars' defaults would stay as class attributes (GRPOConfig().kl_coef reading None): the old names are gone
del GRPOConfig.kl_coef, GRPOConfig.kl_estimator


@dataclass
class _Batch:
    """What one step trains on, per episode: ids, sampled positions, rollout and reference log-probs, versions."""

    seqs: list[list[int]]
    positions: list[torch.Tensor]
    old: list[torch.Tensor]
    ref: list[torch.Tensor] | None
    versions: list[torch.Tensor] | None = None
    trained: int = 0

    @property
    def tokens(self) -> int:
        """Sampled tokens with log-probs (those the off-policy correction weighs)."""
        return int(sum(len(p) for p in self.positions))


class GRPOLearner:
    """One GRPO update per batch of grouped episodes (see the module's description).

    Args:
        policy: The policy wrapper that generated the episodes (e.g. :class:`wrappers.policies.TransformersWrapper`);
            its model is trained in place, so the policy samples from the updated weights at the next rollout.
        config: The settings (default :class:`GRPOConfig`).
        ref_model: A reference scorer (``log_probs(sequences)``, e.g. :class:`wrappers.kl.ReferenceModel` at the
            policy's temperature) for views without ``ref_log_probs``.
        optimizer: A torch optimizer over the model's parameters (default: AdamW with ``config.lr``).

    Raises:
        TypeError: For a policy without ``model`` and ``get_new_version`` (a transformers-backed wrapper).
    """

    def __init__(self, policy: Any, config: GRPOConfig | None = None, *, ref_model: Any = None, optimizer: Any = None):
        if not (hasattr(policy, "model") and hasattr(policy, "get_new_version")):
            raise TypeError(f"GRPOLearner trains a policy wrapper with a torch model, got {type(policy).__name__}")
        self.config = config or GRPOConfig()
        self.policy = policy
        self.model = policy.model
        # scores with autograd on, with the generator's own settings (temperature), micro-batch by micro-batch
        self.scorer = policy.get_new_version(generate=False, requires_grad=True)
        # the proximal log-probs: the same scorer without autograd, before the update
        self.proximal = policy.get_new_version(generate=False, requires_grad=False)
        self.off_policy = self.config.off_policy
        self.controller = as_controller(self.config.kl, "GRPOConfig.kl")
        self.ref_model = ref_model
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optimizer or torch.optim.AdamW(params, lr=self.config.lr, weight_decay=0.0)
        #: steps taken so far
        self.steps = 0
        #: the advantages of the last step's episodes (``(E,)``, in the view's order)
        self.advantages: torch.Tensor | None = None
        #: per episode of the last step, the off-policy correction of its sampled tokens (None: it had none)
        self.corrections: list[Correction | None] = []

    def batch(self, view: Any) -> _Batch:
        """The ids, trained positions (assistant tokens with generation log-probs) and log-probs of a view."""
        seqs = [s.tolist() for s in view["tokens"].unpadded("full")]
        masks = view["masks"].unpadded()
        old = view["log_probs"].unpadded("full")
        if "ref_log_probs" in view.keys():
            ref = [r.float() for r in view["ref_log_probs"].unpadded("full")]
        elif self.ref_model is not None:
            ref = [torch.as_tensor(r, dtype=torch.float32) for r in self.ref_model.log_probs(seqs)]
        else:
            ref = None
        positions = []
        for i, (m, lp) in enumerate(zip(masks, old)):
            keep = m.clone()
            keep[0] = False
            keep &= torch.isfinite(lp)
            if ref is not None:
                keep &= torch.isfinite(ref[i])
            positions.append(keep.nonzero().squeeze(-1))
        return _Batch(seqs, positions, [o.float() for o in old], ref, _versions(view))

    def step(self, view: Any, values: list[torch.Tensor] | None = None) -> dict[str, float]:
        """One optimizer step on a view of grouped episodes; returns the step's metrics.

        Args:
            view: :func:`chatenv.episodes` of a rollout with ``group_size`` (``reward``, ``group``, ``tokens``,
                ``masks``, ``log_probs``, and ``ref_log_probs`` unless ``ref_model`` was given).
            values: With ``credit="branch"``: the episodes' sampled state values
                (:func:`chatenv.rollout.credit.branch_values`).

        Returns:
            ``loss``, ``pg_loss``, ``kl`` (mean per assistant token, policy before the step vs reference),
            ``kl_coef``, ``reward`` / ``reward_std`` (what the advantages use), ``task_reward`` (when the view
            has one), ``groups_with_signal`` (fraction of groups whose rewards differ), ``tokens`` (assistant
            tokens trained on), ``grad_norm``, ``seconds``, the off-policy numbers of
            :class:`chatenv.rollout.offpolicy.OffPolicyStats` (``mismatch_kl``: mean per-token k3 estimate of
            KL(rollout || trainer) on the sampled tokens, ``is_ratio_mean`` / ``_max`` / ``_min``,
            ``is_weight_mean``, ``is_truncated_frac``, ``is_masked_frac``, ``stale_frac``, ``version_lag_max`` /
            ``_mean``) and ``policy_version`` (the policy's version after the step, when it has one).

        Raises:
            ValueError: Without reference log-probs while the KL coefficient is > 0, for non-finite rewards, or
                ``values`` missing with ``credit="branch"`` (given otherwise).
        """
        if (values is None) == (self.config.credit == "branch"):
            raise ValueError(
                "credit='branch' needs values=branch_values(...) (state values sampled by branching); the other "
                f"credits take none (credit={self.config.credit!r})"
            )
        start = time.perf_counter()
        batch = self.batch(view)
        coef = current_coef(self.controller)
        if batch.ref is None and coef > 0:
            raise ValueError(
                "a KL term needs reference log-probs: wrap the envs with wrappers.kl.RefLogProbs(env, ref) (or "
                "KLPenalty), or give GRPOLearner(ref_model=...), or use GRPOConfig(kl=0)"
            )
        groups = view["group"] if "group" in view.keys() else None
        adv = group_advantages(view["reward"], groups, scale=self.config.scale_advantages)
        self.advantages = adv
        per_token = None
        if self.config.credit == "turn":
            cfg = self.config
            per_turn = turn_advantages(view, gamma=cfg.gamma, baseline=cfg.turn_baseline, scale=cfg.scale_advantages)
            per_token = token_advantages(view, per_turn)
        elif self.config.credit == "branch":
            cfg = self.config
            per_token = token_advantages(
                view, value_advantages(view, values, gamma=cfg.gamma, scale=cfg.scale_advantages)
            )
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._accumulate(batch, adv, coef, per_token)
        params = [p for p in self.model.parameters() if p.grad is not None]
        limit = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, limit)) if params else 0.0
        updating = getattr(self.policy, "updating_weights", None)  # no generation on half-updated weights
        with updating() if updating is not None else contextlib.nullcontext():
            self.optimizer.step()
        self.model.eval()
        if sums["episode_kl"]:
            self.controller.update(sums["episode_kl"], n_steps=len(sums["episode_kl"]))
        self.steps += 1
        return self._metrics(view, batch, adv, groups, sums, coef, grad_norm, time.perf_counter() - start)

    def _accumulate(
        self, batch: _Batch, adv: torch.Tensor, coef: float, per_token: list[torch.Tensor] | None = None
    ) -> dict[str, Any]:
        """Forward and backward pass micro-batch by micro-batch; returns the summed loss parts and KL.

        ``per_token`` (per episode, over its full sequence) replaces the episode's advantage ``adv[i]``.
        """
        n = len(batch.seqs)
        eps = self.config.clip_eps
        stats = OffPolicyStats()
        current = getattr(self.policy, "version", None)
        self.corrections = [None] * n
        sums: dict[str, Any] = {"loss": 0.0, "pg": 0.0, "kl_tokens": 0.0, "episode_kl": [], "off_policy": stats}
        for first in range(0, n, self.config.micro_batch):
            rows = [i for i in range(first, min(first + self.config.micro_batch, n)) if len(batch.positions[i])]
            if not rows:
                continue
            self.model.eval()  # the proximal log-probs as the policy scores: no dropout, no graph
            proximal = self.proximal.score_sequences([batch.seqs[i] for i in rows])
            self.model.train()
            scored = self.scorer.score_sequences([batch.seqs[i] for i in rows])
            loss = torch.zeros(())
            for i, lp_full, old_full in zip(rows, scored, proximal):
                sampled = batch.positions[i]
                versions = batch.versions[i][sampled] if batch.versions is not None else None
                fix = correct(
                    batch.old[i][sampled], old_full[sampled], self.off_policy, versions=versions, current=current
                )
                stats.add(fix)
                self.corrections[i] = fix
                at = sampled[fix.keep]
                batch.trained += len(at)
                if not len(at):
                    continue
                lp = lp_full[at]
                base = batch.old[i][at] if self.off_policy.level == "none" else old_full[at].to(lp.dtype)
                ratio = torch.exp(lp - base)
                a = per_token[i][at] if per_token is not None else adv[i]
                surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
                pg = -(fix.weight[fix.keep].to(lp.dtype) * surrogate).mean()
                episode = pg
                if batch.ref is not None:
                    kl = kl_estimate(lp, batch.ref[i][at], self.config.estimator)
                    episode = pg + coef * kl.mean() if coef > 0 else pg
                    sums["kl_tokens"] += float(kl.detach().sum())
                    sums["episode_kl"].append(float(kl.detach().sum()))
                loss = loss + episode / n
                sums["pg"] += float(pg.detach()) / n
            if loss.requires_grad:  # not when every token of the micro-batch was dropped
                loss.backward()
            sums["loss"] += float(loss.detach())
        return sums

    def _metrics(
        self, view: Any, batch: _Batch, adv: torch.Tensor, groups: Any, sums: dict, coef: float, grad: float, s: float
    ) -> dict[str, float]:
        reward = view["reward"].float()
        out = {
            "loss": sums["loss"],
            "pg_loss": sums["pg"],
            "kl": sums["kl_tokens"] / batch.trained if batch.ref is not None and batch.trained else math.nan,
            "kl_coef": coef,
            "reward": float(reward.mean()),
            "reward_std": float(reward.std()) if len(reward) > 1 else 0.0,
            "groups_with_signal": _signal(adv, groups),
            "tokens": float(batch.trained),
            "grad_norm": grad,
            "seconds": s,
            **sums["off_policy"].metrics(),
        }
        version = getattr(self.policy, "version", None)
        if isinstance(version, int):
            out["policy_version"] = float(version)
        if "task_reward" in view.keys():
            out["task_reward"] = float(view["task_reward"].float().mean())
        return out


def _versions(view: Any) -> list[torch.Tensor] | None:
    """Per episode, over its full sequence: the policy version that sampled each token (-2 off the replies)."""
    if "turn_version" not in view.keys():
        return None
    prompts = view["tokens"].unpadded("prompt")
    completions = view["tokens"].unpadded("response")
    columns = [_rows(view[key]) for key in ("turn_start", "turn_length", "turn_version")]
    out = []
    for e, (p, c, n) in enumerate(zip(prompts, completions, view["num_turns"].tolist())):
        starts, lengths, versions = (col[e][:n] for col in columns)
        reply = token_versions(len(c), starts, lengths, versions)
        out.append(torch.cat([torch.full((len(p),), -2, dtype=torch.long), reply]))
    return out


def _rows(value: torch.Tensor) -> list[torch.Tensor]:
    return list(value.unbind()) if value.is_nested else list(value)


def _signal(adv: torch.Tensor, groups: Any) -> float:
    """Fraction of groups with a nonzero advantage somewhere (groups whose rewards differ)."""
    g = torch.zeros(len(adv), dtype=torch.long) if groups is None else torch.as_tensor(groups)
    ids = g.unique()
    return float(sum(bool((adv[g == k] != 0).any()) for k in ids) / max(len(ids), 1))
