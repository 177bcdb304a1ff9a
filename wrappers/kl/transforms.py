"""KL transforms for collected data: rollout TensorDicts (padded or nested) in, per-token rewards out.

- :class:`RetrieveLogProb`: reference log-probs of ``tokens.full`` (one batched forward), as a
  :class:`~chatenv.containers.LogProbs` container at ``ref_log_probs``.
- :class:`KLComputation`: per-token KL between ``log_probs`` and ``ref_log_probs`` (k1/k2/k3) on the positions
  that count, zero elsewhere, at ``kl_penalty``; with ``add_to_reward``, ``("next", "reward")`` becomes per token,
  shape ``(T, 1)`` per row (``(B, T, 1)`` padded like ``tokens.full``): ``-coef * kl_t``, plus the row's task
  reward on its last counted token (:func:`~wrappers.kl.estimators.shape_token_rewards`). The task reward is kept
  at ``("next", "task_reward")``.
- :class:`RetrieveKL`: both in one; :class:`KLRewardTransform`: the same under the name RL code often uses.

Positions that count: the assistant mask (``Masks.all_assistant_mask``; all real tokens with
``assistant_only=False``) where the generation log-probs are defined. A rollout's log-probs are defined on each
turn's generated tokens only, so earlier turns inside a prompt are not penalised twice.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from tensordict import TensorDictBase

from chatenv.containers import LogProbs, Masks, Tokens
from wrappers.kl.estimators import check_estimator, check_kl_coef, kl_estimate, shape_token_rewards

__all__ = ["KLComputation", "KLRewardTransform", "RetrieveKL", "RetrieveLogProb"]


def _rows(container: Any) -> list[torch.Tensor]:
    return container.full_sequences() if container.padded else list(container.full.unbind())


def _like(tokens: Tokens, rows: list[torch.Tensor], fill: float) -> Any:
    """Per-row full-length values in the layout of ``tokens`` (split into prompt/response like it)."""
    p_len = tokens.prompt_length.tolist()
    return LogProbs.from_sequences(
        [r[:p] for r, p in zip(rows, p_len)],
        [r[p:] for r, p in zip(rows, p_len)],
        padded=bool(tokens.padded),
        pad_value=fill,
    )


def _jagged_column(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([r.unsqueeze(-1) for r in rows], layout=torch.jagged)


class RetrieveLogProb:
    """Reference log-probs of the tokens in a TensorDict.

    Args:
        ref_model: Anything with ``log_probs(sequences) -> list[(T,) tensor]``
            (:class:`~wrappers.kl.ReferenceModel`, :class:`~wrappers.kl.RayRefModel`).
        tokens_key: Where the :class:`~chatenv.containers.Tokens` are.
        out_key: Where the reference :class:`~chatenv.containers.LogProbs` go.
    """

    def __init__(self, ref_model: Any, *, tokens_key: Any = "tokens", out_key: Any = "ref_log_probs"):
        self.ref_model = ref_model
        self.tokens_key = tokens_key
        self.out_key = out_key

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Write the reference log-probs into ``td`` (and return it)."""
        tokens = td.get(self.tokens_key, None)
        if not isinstance(tokens, Tokens):
            raise KeyError(f"expected chatenv Tokens at {self.tokens_key!r}")
        seqs = [s.tolist() for s in _rows(tokens)]
        with torch.inference_mode():
            ref = self.ref_model.log_probs(seqs)
        td.set(self.out_key, _like(tokens, [r.float() for r in ref], math.nan))
        return td


class KLComputation:
    """Per-token KL penalties and per-token rewards from generation and reference log-probs.

    Args:
        coef: KL coefficient (a finite number >= 0), or a controller (its ``coef`` is read at each call; call its
            ``update`` with the returned ``kl_penalty`` sums to adapt it).
        estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"``.
        assistant_only: Count only assistant tokens (``masks.all_assistant_mask``); otherwise every real token.
        add_to_reward: Turn ``("next", "reward")`` into per-token rewards.
        log_probs_key, ref_log_probs_key, masks_key, tokens_key, kl_key: Keys.

    Raises:
        ValueError: For a negative or non-finite coefficient, or an unknown estimator.
    """

    def __init__(
        self,
        coef: Any = 0.1,
        *,
        estimator: str = "k1",
        assistant_only: bool = True,
        add_to_reward: bool = True,
        log_probs_key: Any = "log_probs",
        ref_log_probs_key: Any = "ref_log_probs",
        masks_key: Any = "masks",
        tokens_key: Any = "tokens",
        kl_key: Any = "kl_penalty",
    ):
        self.estimator = check_estimator(estimator)
        self.coef = coef if hasattr(coef, "coef") else check_kl_coef(coef, "coef")
        self.assistant_only = assistant_only
        self.add_to_reward = add_to_reward
        self.log_probs_key, self.ref_log_probs_key = log_probs_key, ref_log_probs_key
        self.masks_key, self.tokens_key, self.kl_key = masks_key, tokens_key, kl_key

    def _coef(self) -> float:
        if hasattr(self.coef, "coef"):
            return check_kl_coef(self.coef.coef, f"{type(self.coef).__name__}.coef")
        return self.coef

    def _task_rewards(self, td: TensorDictBase) -> torch.Tensor | None:
        """The task reward of each row, ``(B,)`` (None when not needed and absent)."""
        task = td.get(("next", "task_reward"), None)
        if task is None and self.add_to_reward:
            task = td.get(("next", "reward"), None)
            if task is None:
                raise KeyError("add_to_reward needs ('next', 'reward') (the task reward per row)")
            if task.dim() > 2 or (task.dim() == 2 and task.shape[-1] != 1):
                raise ValueError(f"('next', 'reward') must hold one task reward per row, got shape {tuple(task.shape)}")
        return None if task is None else task.reshape(-1)

    def _row_kl(self, b: int, g: torch.Tensor, q: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``b``'s per-token KL (0 where not counted) and the positions that count."""
        if g.shape != q.shape or g.shape != a.shape:
            raise ValueError(f"row {b}: log-probs {tuple(g.shape)}, reference {tuple(q.shape)}, mask {tuple(a.shape)}")
        counted = (a if self.assistant_only else torch.ones_like(a)) & ~torch.isnan(g)
        if not torch.isfinite(g[counted]).all():
            raise ValueError(f"row {b}: generation log-probs are infinite on tokens that count for the KL")
        if not torch.isfinite(q[counted]).all():
            raise ValueError(f"row {b}: reference log-probs are undefined (NaN or inf) on tokens that count for the KL")
        kl = torch.zeros_like(g)
        kl[counted] = kl_estimate(g[counted], q[counted], self.estimator)
        return kl, counted

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Write ``kl_penalty`` (and per-token rewards) into ``td`` (and return it)."""
        tokens: Tokens = td.get(self.tokens_key)
        gen = _rows(td.get(self.log_probs_key))
        ref = _rows(td.get(self.ref_log_probs_key))
        masks: Masks = td.get(self.masks_key)
        nested = masks.to_nested() if masks.padded else masks
        assist = [m.bool() for m in nested.all_assistant_mask.unbind()]
        coef = self._coef()
        task = self._task_rewards(td)
        kls, rewards = [], []
        for b, (g, q, a) in enumerate(zip(gen, ref, assist)):
            kl, counted = self._row_kl(b, g, q, a)
            kls.append(kl)
            if self.add_to_reward:
                rewards.append(shape_token_rewards(kl, task[b], coef, mask=counted))
        td.set(self.kl_key, _like(tokens, kls, 0.0))
        if self.add_to_reward:
            td.set(("next", "task_reward"), task.reshape(-1, 1).clone())
            per_token = _like(tokens, rewards, 0.0)
            td.set(("next", "reward"), per_token.full.unsqueeze(-1) if tokens.padded else _jagged_column(rewards))
        return td


class RetrieveKL:
    """:class:`RetrieveLogProb` then :class:`KLComputation` (keyword arguments go to the latter)."""

    def __init__(self, ref_model: Any, coef: Any = 0.1, **kwargs: Any):
        self.compute = KLComputation(coef, **kwargs)
        self.retrieve = RetrieveLogProb(
            ref_model,
            tokens_key=kwargs.get("tokens_key", "tokens"),
            out_key=kwargs.get("ref_log_probs_key", "ref_log_probs"),
        )

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Reference log-probs, KL and per-token rewards for ``td``."""
        return self.compute(self.retrieve(td))


class KLRewardTransform(RetrieveKL):
    """Reference forward, KL penalty and per-token KL-penalised rewards in one call (see :class:`RetrieveKL`)."""
