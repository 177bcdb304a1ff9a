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
  done step; ``("next", "reward_kl")``: ``-coef * kl_t`` per step (``estimator`` k1 = log p - log p_ref, k2
  or k3); ``("next", "reward")``: their sum (:func:`~wrappers.kl.shape_token_rewards`).

The per-sequence KL sums are kept for the KL controller: :meth:`RolloutFromModel.step_scheduler` feeds them to it.

The KL compares like with like. By default the policy reports the log-probs of the distribution it sampled from
(tempered), and the reference is scored at the same temperature (a model against itself gives KL 0); sampling
settings a reference cannot reproduce (top-k, top-p, min-p, repetition penalty, min_new_tokens) are refused.
With ``raw_log_probs=True`` both sides use the models' own distributions (temperature 1, no filtering) and any
sampling settings are allowed.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from chatenv.containers import Tokens
from chatenv.padding import pad_sequences
from wrappers.kl.controllers import KLController, current_coef, kl_controller, use_and_update
from wrappers.kl.estimators import check_estimator, check_log_probs, kl_estimate, shape_token_rewards
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


def _kl_temperature(settings: Any, raw_log_probs: bool) -> float:
    """The temperature of the distribution whose log-probs the policy reports, once a reference can score it too.

    Raises:
        ValueError: For sampling settings that reshape the distribution beyond a temperature, without
            ``raw_log_probs``.
    """
    if raw_log_probs or settings.greedy:
        return 1.0  # the policy reports the model's own log-probs
    reshaping = {
        "top_k": settings.top_k > 0,
        "top_p": settings.top_p < 1.0,
        "min_p": settings.min_p > 0.0,
        "repetition_penalty": settings.repetition_penalty != 1.0,
        "min_new_tokens": settings.min_new_tokens > 0,
    }
    refused = [name for name, on in reshaping.items() if on]
    if refused:
        raise ValueError(
            f"generate_kwargs {refused} reshape the sampling distribution beyond a temperature: the policy's "
            "log-probs would come from a filtered distribution that a reference model cannot score, and the KL "
            "would compare different things; drop them, or pass raw_log_probs=True to compute the KL (and "
            "sample_log_prob) from the models' own distributions"
        )
    return float(settings.temperature)


def _reference(ref_model: Any, tokenizer: Any, temperature: float, raw_log_probs: bool) -> Any:
    """The reference scorer at ``temperature`` (a model or a path is wrapped; a scorer's temperature is checked).

    A scorer without a ``temperature`` attribute is taken to score the model's own distribution (temperature 1).

    Raises:
        ValueError: For a scorer at another temperature.
    """
    if not hasattr(ref_model, "log_probs"):
        # each rollout scores new sequences: no KV cache is worth keeping between calls
        return ReferenceModel(ref_model, tokenizer, temperature=temperature, kv_cache_size=0)
    ref_temperature = float(getattr(ref_model, "temperature", 1.0))
    if not math.isclose(ref_temperature, temperature, rel_tol=1e-9):
        fix = (
            "score the reference at temperature 1.0"
            if raw_log_probs
            else f"use ReferenceModel(..., temperature={temperature}), or pass raw_log_probs=True (both at 1.0)"
        )
        raise ValueError(
            f"the policy reports log-probs at temperature {temperature} but the reference "
            f"{type(ref_model).__name__} scores at temperature {ref_temperature}: the KL would compare different "
            f"distributions (a model against itself would not give 0); {fix}"
        )
    return ref_model


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
        kl: The KL coefficient: a constant (default 0.1), or a KL controller that :meth:`step_scheduler` updates
            with the KL seen since the last call.
        estimator: ``"k1"`` (default), ``"k2"`` or ``"k3"`` (:func:`~wrappers.kl.kl_estimate`).
        max_new_tokens: Steps per row.
        score_clip: Scores are clipped to ``[-score_clip, score_clip]``.
        generate_kwargs: More generation settings (temperature, seed, ...). Without ``raw_log_probs`` only a
            temperature may reshape the distribution (the reference is scored at it); top-k, top-p, min-p,
            repetition penalty and min_new_tokens are refused.
        raw_log_probs: Compute the KL from the models' own log-probs (temperature 1, no filtering): the policy
            reports them (``sample_log_prob`` too) and the reference scores at temperature 1. Any sampling settings
            are then allowed.

    A ``ref_model`` given as a model or a path is scored at the policy's temperature; a scorer (anything with
    ``log_probs``) must already score at it (its ``temperature`` attribute; none means 1.0).

    Raises:
        TypeError: For arguments of the wrong type (a ``kl`` controller without ``coef`` and ``update``, a reward
            that is not callable, a ``score_clip`` or ``max_new_tokens`` that is not a number), or an old spelling
            (``kl_coef=``, ``kl_controller=``, ``kl_estimator=``: the message names the new one).
        ValueError: For both or neither of ``reward_model`` and ``reward_fn``, a ``score_clip`` that is not a
            finite number > 0, ``max_new_tokens < 1``, a bad
            coefficient or estimator, a policy, reference and tokenizer whose vocabularies differ, sampling settings
            the reference cannot reproduce, or a reference scoring at another temperature than the policy reports.
    """

    def __init__(
        self,
        model: Any,
        ref_model: Any,
        reward_model: Any = None,
        *,
        tokenizer: Any,
        reward_fn: Any = None,
        kl: float | KLController = 0.1,
        estimator: str = "k1",
        max_new_tokens: int = 50,
        score_clip: float = 10.0,
        generate_kwargs: dict | None = None,
        raw_log_probs: bool = False,
        **renamed: Any,
    ):
        from wrappers.policies import TransformersWrapper

        self.controller = kl_controller(kl, "RolloutFromModel", renamed)
        _check_reward(reward_model, reward_fn)
        self.estimator = check_estimator(estimator)
        self.score_clip = _positive_finite(score_clip, "score_clip")
        self.max_new_tokens = _max_new_tokens(max_new_tokens)
        policy_vocab = _check_vocabularies(model, ref_model, tokenizer)
        self.policy = TransformersWrapper(
            model,
            tokenizer=tokenizer,
            input_mode="tokens",
            raw_log_probs=raw_log_probs,
            generate_kwargs={**(generate_kwargs or {}), "max_new_tokens": max_new_tokens},
        )
        raw = bool(self.policy.raw_log_probs)
        temperature = _kl_temperature(self.policy.settings, raw)
        wrapped = not hasattr(ref_model, "log_probs")
        ref_model = _reference(ref_model, tokenizer, temperature, raw)
        if wrapped:
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
        coef = current_coef(self.controller)
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
            kl[i, :n] = kl_estimate(log_p.double(), log_q.double(), self.estimator).float()
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
        if values:
            use_and_update(self.controller, values, n_steps=len(values))  # atomic, should envs share the controller
        return current_coef(self.controller)
