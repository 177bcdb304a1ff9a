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
from wrappers.kl.controllers import current_coef, kl_controller
from wrappers.kl.estimators import check_estimator, kl_estimate, shape_token_rewards
from wrappers.kl.reference import score_with

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


def _entry(td: TensorDictBase, key: Any, cls: type, what: str, owner: str) -> Any:
    """``td[key]`` if it is a ``cls``; a KeyError naming the key and the keys present, or a TypeError."""
    value = td.get(key, None)
    if value is None:
        present = sorted(str(k) for k in td.keys())
        raise KeyError(f"{owner} needs {what} ({cls.__name__}) at {key!r}; the tensordict has keys {present}")
    if not isinstance(value, cls):
        raise TypeError(f"{owner} needs {what} at {key!r} as chatenv {cls.__name__}, got {type(value).__name__}")
    return value


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
        if not callable(getattr(ref_model, "log_probs", None)):
            raise TypeError(f"ref_model must have a log_probs(sequences) method, got {type(ref_model).__name__}")
        self.ref_model = ref_model
        self.tokens_key = tokens_key
        self.out_key = out_key

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Write the reference log-probs into ``td`` (and return it).

        Raises:
            KeyError: If ``td`` has no tokens at ``tokens_key`` (the message lists the keys it has).
            TypeError: If the entry there is not :class:`~chatenv.containers.Tokens`.
            ValueError: If the reference answers with the wrong number or length of rows.
        """
        tokens = _entry(td, self.tokens_key, Tokens, "the tokens to score", "RetrieveLogProb")
        seqs = [s.tolist() for s in _rows(tokens)]
        with torch.inference_mode():
            ref = score_with(self.ref_model, seqs, f"the reference model ({type(self.ref_model).__name__})")
        td.set(self.out_key, _like(tokens, ref, math.nan))
        return td


class KLComputation:
    """Per-token KL penalties and per-token rewards from generation and reference log-probs.

    Args:
        kl: KL coefficient (a finite number >= 0), or a KL controller (with ``coef`` and ``update``; its ``coef``
            is read at each call; call its ``update`` with the returned ``kl_penalty`` sums to adapt it).
        estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"``.
        assistant_only: Count only assistant tokens (``masks.all_assistant_mask``); otherwise every real token.
        add_to_reward: Turn ``("next", "reward")`` into per-token rewards.
        log_probs_key, ref_log_probs_key, masks_key, tokens_key, kl_key: Keys.

    Raises:
        TypeError: For a coefficient that is not a number, a controller without ``coef`` and ``update``, or the old
            spelling ``coef=`` (the message names ``kl=``).
        ValueError: For a negative or non-finite coefficient, or an unknown estimator (with the closest name).
    """

    def __init__(
        self,
        kl: Any = 0.1,
        *,
        estimator: str = "k1",
        assistant_only: bool = True,
        add_to_reward: bool = True,
        log_probs_key: Any = "log_probs",
        ref_log_probs_key: Any = "ref_log_probs",
        masks_key: Any = "masks",
        tokens_key: Any = "tokens",
        kl_key: Any = "kl_penalty",
        **renamed: Any,
    ):
        self._controller = kl_controller(kl, "KLComputation", renamed)
        self.estimator = check_estimator(estimator)
        self._given_controller = self._controller is kl
        self.assistant_only = assistant_only
        self.add_to_reward = add_to_reward
        self.log_probs_key, self.ref_log_probs_key = log_probs_key, ref_log_probs_key
        self.masks_key, self.tokens_key, self.kl_key = masks_key, tokens_key, kl_key

    @property
    def kl(self) -> Any:
        """The coefficient as given: a float, or the controller whose ``coef`` is read at each call."""
        return self._controller if self._given_controller else self._controller.coef

    def _task_rewards(self, td: TensorDictBase, n_rows: int) -> torch.Tensor | None:
        """The task reward of each row, ``(B,)`` (None when not needed and absent)."""
        task = td.get(("next", "task_reward"), None)
        key = ("next", "task_reward")
        if task is None and self.add_to_reward:
            key = ("next", "reward")
            task = td.get(key, None)
            if task is None:
                raise KeyError("add_to_reward needs ('next', 'reward') (the task reward per row)")
            if task.dim() > 2 or (task.dim() == 2 and task.shape[-1] != 1):
                raise ValueError(f"('next', 'reward') must hold one task reward per row, got shape {tuple(task.shape)}")
        if task is not None and task.numel() != n_rows:
            raise ValueError(f"{key} holds {task.numel()} task rewards for {n_rows} rows")
        return None if task is None else task.reshape(-1)

    def _row_kl(self, b: int, g: torch.Tensor, q: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``b``'s per-token KL (0 where not counted) and the positions that count."""
        if g.shape != q.shape or g.shape != a.shape:
            raise ValueError(
                f"row {b}: the generation log-probs at {self.log_probs_key!r} have {g.shape[0]} positions, the "
                f"reference log-probs at {self.ref_log_probs_key!r} {q.shape[0]} and the assistant mask {a.shape[0]}; "
                "all must cover the same tokens (tokens.full): compute the reference log-probs of these tokens "
                "(RetrieveLogProb)"
            )
        counted = (a if self.assistant_only else torch.ones_like(a)) & ~torch.isnan(g)
        if not torch.isfinite(g[counted]).all():
            raise ValueError(
                f"row {b}: the generation log-probs at {self.log_probs_key!r} are infinite on tokens that count for "
                "the KL"
            )
        if not torch.isfinite(q[counted]).all():
            raise ValueError(
                f"row {b}: the reference log-probs at {self.ref_log_probs_key!r} are undefined (NaN or inf) on tokens "
                "that count for the KL"
            )
        kl = torch.zeros_like(g)
        kl[counted] = kl_estimate(g[counted], q[counted], self.estimator)
        return kl, counted

    def _inputs(self, td: TensorDictBase) -> tuple[Tokens, list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Tokens, generation and reference log-prob rows and assistant-mask rows of ``td``, checked."""
        owner = "KLComputation"
        tokens = _entry(td, self.tokens_key, Tokens, "the tokens", owner)
        gen = _rows(_entry(td, self.log_probs_key, LogProbs, "the generation log-probs", owner))
        what = "the reference log-probs (RetrieveLogProb writes them)"
        ref = _rows(_entry(td, self.ref_log_probs_key, LogProbs, what, owner))
        masks = _entry(td, self.masks_key, Masks, "the assistant masks", owner)
        nested = masks.to_nested() if masks.padded else masks
        assist = [m.bool() for m in nested.all_assistant_mask.unbind()]
        if not len(gen) == len(ref) == len(assist):
            raise ValueError(
                f"{len(gen)} rows of generation log-probs, {len(ref)} of reference log-probs and {len(assist)} of "
                "masks: they must come from the same batch"
            )
        return tokens, gen, ref, assist

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        """Write ``kl_penalty`` (and per-token rewards) into ``td`` (and return it).

        Everything is computed and checked before ``td`` is written: a call that raises leaves it as it was.

        Raises:
            KeyError: For a missing entry (the message names the key and the keys ``td`` has).
            TypeError: For an entry of the wrong type.
            ValueError: For log-probs, reference log-probs and masks that do not cover the same tokens, values
                undefined on tokens that count, or a bad coefficient or task reward.
        """
        tokens, gen, ref, assist = self._inputs(td)
        coef = current_coef(self._controller)
        task = self._task_rewards(td, len(gen))
        kls, rewards = [], []
        for b, (g, q, a) in enumerate(zip(gen, ref, assist)):
            kl, counted = self._row_kl(b, g, q, a)
            kls.append(kl)
            if self.add_to_reward:
                rewards.append(shape_token_rewards(kl, task[b], coef, mask=counted))
        updates: dict[Any, Any] = {self.kl_key: _like(tokens, kls, 0.0)}
        if self.add_to_reward:
            updates[("next", "task_reward")] = task.reshape(-1, 1).clone()
            per_token = _like(tokens, rewards, 0.0)
            updates[("next", "reward")] = per_token.full.unsqueeze(-1) if tokens.padded else _jagged_column(rewards)
        for key, value in updates.items():
            td.set(key, value)
        return td


class RetrieveKL:
    """:class:`RetrieveLogProb` then :class:`KLComputation` (keyword arguments go to the latter)."""

    def __init__(self, ref_model: Any, kl: Any = 0.1, **kwargs: Any):
        self.compute = KLComputation(kl, **kwargs)
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
