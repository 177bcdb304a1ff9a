"""RolloutFromModel: one ``generate`` call laid out as a token-level rollout with KL-shaped rewards.

For single-reply RLHF-style training: prompts in, a TensorDict of batch ``(B, max_new_tokens)`` out, as if a
token-level env had been stepped one token at a time:

- ``action``: the generated token of each step (pad id after the reply ended);
- ``input_ids``: the full padded sequence (prompt + reply) of each row, as a stride-0 view over the step dim (the
  memory-light form of the per-step model inputs), with ``attention_mask`` marking what step t could see
  (prompt + the t tokens before it); ``("next", "attention_mask")`` adds the step's own token;
- ``sample_log_prob``: the generation-time log-prob of the action;
- ``valid``: False on steps after the reply ended;
- ``("next", "terminated")``: at the end-of-turn / EOS step (the tokenizer's ids, never a hard-coded one);
  ``("next", "truncated")``: at the last step of a reply cut by ``max_new_tokens``; ``("next", "done")``: either;
- ``("next", "reward_raw")``: the reward function's (or reward model's) score, clipped to ``±score_clip``, at the
  done step; ``("next", "reward_kl")``: ``-coef * kl_t`` per step (``kl_estimator`` k1 = log p - log p_ref, k2
  or k3); ``("next", "reward")``: their sum (:func:`~wrappers.kl.shape_token_rewards`).

The per-sequence KL sums are kept for the KL controller: :meth:`RolloutFromModel.step_scheduler` feeds them to it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from chatenv.containers import Tokens
from chatenv.padding import pad_sequences
from wrappers.kl.controllers import ConstantKLController, KLController
from wrappers.kl.estimators import check_estimator, check_kl_coef, check_log_probs, kl_estimate, shape_token_rewards
from wrappers.kl.reference import ReferenceModel, check_sequences, score_with

__all__ = ["RolloutFromModel"]


def _describe(fn: Any, role: str) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{role} ({name})"


def _score(value: Any, row: int, source: str) -> float:
    """One reward score as a float: a finite real number (a bool counts as 0 or 1)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{source} must return a number, got {type(value).__name__} {value!r} for row {row}")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(
            f"{source} returned a non-finite score {score} for row {row}; return a finite number (a NaN must not be "
            "clipped into a reward)"
        )
    return score


def _positive_finite(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def _max_new_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"max_new_tokens must be an int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"max_new_tokens must be >= 1 (steps per reply), got {value}")
    return int(value)


def _check_reward(reward_model: Any, reward_fn: Any) -> None:
    if (reward_model is None) == (reward_fn is None):
        raise ValueError("give exactly one of reward_model=... or reward_fn=...")
    for name, fn in (("reward_model", reward_model), ("reward_fn", reward_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}")


def _controller(kl_coef: Any, kl_controller: Any) -> KLController:
    if kl_controller is None:
        return ConstantKLController(kl_coef)
    if not (hasattr(kl_controller, "coef") and callable(getattr(kl_controller, "update", None))):
        raise TypeError(
            f"kl_controller must be a KL controller (with .coef and .update(kl_values)), got "
            f"{type(kl_controller).__name__}; for a constant coefficient pass kl_coef=..."
        )
    check_kl_coef(kl_controller.coef, f"{type(kl_controller).__name__}.coef")
    return kl_controller


def _config_vocab(model: Any) -> int | None:
    """The vocabulary size a transformers model's config declares (None for anything else)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    return None if vocab is None else int(vocab)


def _check_vocabularies(model: Any, ref_model: Any, tokenizer: Any) -> int:
    """The policy's vocabulary size, once the tokenizer and the reference are checked against it."""
    policy_vocab = _config_vocab(model)
    if policy_vocab is None:
        raise TypeError(f"model must be a transformers causal LM (with a config), got {type(model).__name__}")
    if len(tokenizer) > policy_vocab:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} ids but the model only {policy_vocab}: pass the model's own tokenizer"
        )
    ref_vocab = _config_vocab(getattr(ref_model, "model", ref_model))
    if ref_vocab is not None and ref_vocab != policy_vocab:
        raise ValueError(
            f"the policy has {policy_vocab} token ids but the reference model {ref_vocab}: their log-probs are not "
            "comparable; use a reference with the policy's vocabulary (e.g. a frozen copy of the initial policy)"
        )
    return policy_vocab


class RolloutFromModel:
    """Generate replies for a batch of prompts and return them as a token-level rollout.

    Args:
        model: The policy (a transformers causal LM).
        ref_model: The reference: a :class:`~wrappers.kl.ReferenceModel`, a model, or anything with
            ``log_probs(sequences)``.
        reward_model: ``fn(input_ids (B, L), attention_mask (B, L)) -> (B,)`` scores of full sequences, or
            None when ``reward_fn`` is given.
        tokenizer: The policy's tokenizer.
        reward_fn: ``fn(reply_text) -> float`` scores of the decoded replies (instead of ``reward_model``).
        kl_coef: Constant KL coefficient (ignored with ``kl_controller``).
        kl_controller: A KL controller; :meth:`step_scheduler` updates it with the KL seen since the last call.
        kl_estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"`` (:func:`~wrappers.kl.kl_estimate`).
        max_new_tokens: Steps per row.
        score_clip: Scores are clipped to ``[-score_clip, score_clip]``.
        generate_kwargs: More generation settings (temperature, top_p, seed, ...).

    Raises:
        TypeError: For arguments of the wrong type (a ``kl_controller`` without ``coef`` and ``update``, a reward
            that is not callable, a ``score_clip`` or ``max_new_tokens`` that is not a number).
        ValueError: For both or neither of ``reward_model`` and ``reward_fn``, a ``score_clip`` that is not a finite
            number > 0, ``max_new_tokens < 1``, a bad coefficient or estimator, or a policy, reference and tokenizer
            whose vocabularies differ.
    """

    def __init__(
        self,
        model: Any,
        ref_model: Any,
        reward_model: Any = None,
        *,
        tokenizer: Any,
        reward_fn: Any = None,
        kl_coef: float = 0.1,
        kl_controller: KLController | None = None,
        kl_estimator: str = "k1",
        max_new_tokens: int = 50,
        score_clip: float = 10.0,
        generate_kwargs: dict | None = None,
    ):
        from wrappers.policies import TransformersWrapper

        _check_reward(reward_model, reward_fn)
        self.kl_estimator = check_estimator(kl_estimator)
        self.score_clip = _positive_finite(score_clip, "score_clip")
        self.max_new_tokens = _max_new_tokens(max_new_tokens)
        self.controller = _controller(kl_coef, kl_controller)
        policy_vocab = _check_vocabularies(model, ref_model, tokenizer)
        self.policy = TransformersWrapper(
            model,
            tokenizer=tokenizer,
            input_mode="tokens",
            generate_kwargs={**(generate_kwargs or {}), "max_new_tokens": max_new_tokens},
        )
        if not hasattr(ref_model, "log_probs"):
            ref_model = ReferenceModel(ref_model, tokenizer)
            _check_vocabularies(model, ref_model, tokenizer)  # a reference given as a path is known only now
        self.ref_model = ref_model
        self.vocab_size = policy_vocab
        self.tokenizer = tokenizer
        self.reward_model, self.reward_fn = reward_model, reward_fn
        self.stop_ids = set(self.policy.stop_ids)
        self._kl_seen: list[float] = []

    def _prompt_rows(self, prompts: Any) -> list[torch.Tensor]:
        """The prompts as 1-D id tensors, checked (a non-empty batch of non-empty id sequences in the vocabulary)."""
        if isinstance(prompts, Tokens):
            rows = list(prompts.unpadded("prompt"))
        else:
            rows = check_sequences(prompts, self.vocab_size, what="prompt", owner="the policy")
        if not rows:
            raise ValueError("rollout needs at least one prompt, got an empty batch")
        return [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in rows]

    def rollout(self, prompts: Any) -> TensorDict:
        """Generate one reply per prompt (a list of id sequences, or :class:`~chatenv.containers.Tokens`).

        A call that raises (a bad prompt, a reward function that fails or returns something that is not a finite
        number, a broken reference) feeds nothing to the KL controller.

        Raises:
            TypeError: For prompts that are not integer id sequences, or a score that is not a number.
            ValueError: For an empty batch or prompt, ids outside the vocabulary, or a NaN or infinite score or
                log-prob (the message names its source).
        """
        rows = self._prompt_rows(prompts)
        b, t_max, pad = len(rows), self.max_new_tokens, self.policy.pad_token_id
        td_in = TensorDict(tokens=Tokens.from_sequences(rows, padded=True, pad_value=pad), batch_size=[b])
        out = self.policy(td_in)
        responses = [r.tolist() for r in out["tokens"].unpadded("response")]
        log_probs = out["log_probs"].unpadded("response")
        seqs = [p.tolist() + r for p, r in zip(rows, responses)]
        kl, valid = self._kl(rows, responses, log_probs, seqs)  # (B, T), (B, T)
        coef = check_kl_coef(self.controller.coef, f"{type(self.controller).__name__}.coef")
        scores = torch.tensor(self._scores(seqs, responses))  # (B,)
        self._kl_seen.extend(float(row.sum()) for row in kl)
        action = torch.full((b, t_max), pad, dtype=torch.long)
        sample_lp = torch.zeros(b, t_max)
        terminated = torch.zeros(b, t_max, dtype=torch.bool)
        truncated = torch.zeros(b, t_max, dtype=torch.bool)
        for i, (r, lp) in enumerate(zip(responses, log_probs)):
            n = len(r)
            action[i, :n] = torch.tensor(r, dtype=torch.long)
            sample_lp[i, :n] = lp
            if n:
                (terminated if r[-1] in self.stop_ids else truncated)[i, n - 1] = True
        full, _ = pad_sequences([torch.tensor(s, dtype=torch.long) for s in seqs], "right", pad)
        visible = torch.tensor([len(p) for p in rows])[:, None] + torch.arange(t_max)[None, :]  # (B, T) seen at t
        positions = torch.arange(full.shape[1])
        ids = full[:, None, :].expand(b, t_max, full.shape[1])  # (B, T, L) stride-0 view over the step dim
        return TensorDict(
            {
                "action": action,
                "input_ids": ids,
                "attention_mask": (positions[None, None, :] < visible[:, :, None]) & valid[:, :, None],
                "sample_log_prob": sample_lp.unsqueeze(-1),
                "valid": valid,
                "next": {
                    "input_ids": ids,
                    "attention_mask": (positions[None, None, :] < (visible + 1)[:, :, None]) & valid[:, :, None],
                    "terminated": terminated.unsqueeze(-1),
                    "truncated": truncated.unsqueeze(-1),
                    "done": (terminated | truncated).unsqueeze(-1),
                    # the one shaping rule: the score on the last step of the reply, -coef * kl_t on every step
                    "reward_raw": shape_token_rewards(torch.zeros(b, t_max), scores, 0.0, mask=valid).unsqueeze(-1),
                    "reward_kl": shape_token_rewards(kl, 0.0, coef, mask=valid).unsqueeze(-1),
                    "reward": shape_token_rewards(kl, scores, coef, mask=valid).unsqueeze(-1),
                },
            },
            batch_size=[b, t_max],
        )

    def _kl(
        self, rows: list[torch.Tensor], responses: list[list[int]], log_probs: list[torch.Tensor], seqs: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step KL estimates ``(B, T)`` (0 after a reply) and the steps that hold a reply token."""
        name = type(self.ref_model).__name__
        ref = score_with(self.ref_model, seqs, f"the reference model ({name})")
        source = f"the reference model's log-probs ({name})"
        kl = torch.zeros(len(rows), self.max_new_tokens)
        valid = torch.zeros(len(rows), self.max_new_tokens, dtype=torch.bool)
        for i, (p, r) in enumerate(zip(rows, responses)):
            n = len(r)
            log_p = check_log_probs(log_probs[i], n, f"row {i}: the policy's generation log-probs")
            log_q = check_log_probs(ref[i][len(p) : len(p) + n], n, f"row {i}: {source}")
            kl[i, :n] = kl_estimate(log_p.double(), log_q.double(), self.kl_estimator).float()
            valid[i, :n] = True
        return kl, valid

    def _scores(self, seqs: list[list[int]], responses: list[list[int]]) -> list[float]:
        """Scores of the rows, checked finite numbers, clipped to ``±score_clip`` (a NaN is never clipped)."""
        if self.reward_fn is not None:
            texts = [self.policy.chat_tokenizer.parse_response(r)[0]["content"] if r else "" for r in responses]
            raw = [_score(self.reward_fn(t), i, _describe(self.reward_fn, "reward_fn")) for i, t in enumerate(texts)]
        else:
            ids, mask = pad_sequences(
                [torch.tensor(s, dtype=torch.long) for s in seqs], "right", self.policy.pad_token_id
            )
            with torch.inference_mode():
                out = self.reward_model(ids, mask)
            source = _describe(self.reward_model, "reward_model")
            try:
                values = torch.as_tensor(out).reshape(-1).float().tolist()
            except (TypeError, ValueError, RuntimeError) as e:
                raise TypeError(f"{source} must return one number per sequence, got {type(out).__name__}") from e
            if len(values) != len(seqs):
                raise ValueError(f"{source} returned {len(values)} scores for {len(seqs)} sequences")
            raw = [_score(v, i, source) for i, v in enumerate(values)]
        return [max(-self.score_clip, min(self.score_clip, s)) for s in raw]

    def step_scheduler(self) -> float:
        """Feed the per-sequence KL sums seen since the last call to the controller; return the new coefficient."""
        values, self._kl_seen = self._kl_seen, []
        if not values:
            return float(self.controller.coef)
        return float(self.controller.update(values, n_steps=len(values)))
