"""A token-step policy for :class:`~chatenv.envs.TokenEnv`: one token per env per call, with a KV cache.

Stepping a token-level env with a plain forward per step re-reads the whole context each time (O(T²) over an
episode). :class:`TokenStepPolicy` keeps the model's key/value cache across calls, batched over a vector of envs:
each call feeds only the tokens each env's observation gained since the last call (its previous action, or the
task's messages and the next header after a finished reply), so a step costs about one incremental forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["TokenStepPolicy"]


class TokenStepPolicy:
    """Samples the next token for each observation, reusing the KV cache between calls.

    Args:
        model: A transformers causal LM.
        tokenizer: Its tokenizer (for the pad id).
        temperature: Sampling temperature (0: greedy).
        top_k: Keep the k most likely tokens (0: off).
        top_p: Nucleus mass (1.0: off).
        raw_log_probs: Report the model's own log-probs instead of those of the distribution sampled from.
        seed: Seed of the sampling generator.

    :meth:`act` takes a batch of observations (int64 id arrays). When every observation extends what the cache
    holds for its row, only the new tokens are fed; otherwise (a reset, a new batch) the cache is rebuilt from the
    observations.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        raw_log_probs: bool = False,
        seed: int | None = None,
    ):
        if temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
            raise ValueError(f"invalid sampling settings: temperature={temperature}, top_k={top_k}, top_p={top_p}")
        self.model = model
        self.tokenizer = tokenizer
        self.temperature, self.top_k, self.top_p = float(temperature), int(top_k), float(top_p)
        self.raw_log_probs = raw_log_probs
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = int(pad if pad is not None else 0)
        self.generator = torch.Generator(device=next(model.parameters()).device)
        if seed is not None:
            self.generator.manual_seed(seed)
        self.reset()

    @classmethod
    def from_wrapper(cls, policy: Any) -> TokenStepPolicy:
        """The token-step version of a :class:`~wrappers.policies.TransformersWrapper` (same model and sampling)."""
        s = policy.settings
        return cls(
            policy.model,
            policy.tokenizer,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            raw_log_probs=policy.raw_log_probs,
            seed=s.seed,
        )

    def reset(self) -> None:
        """Forget the cache (the next call rebuilds it)."""
        self._ids: list[list[int]] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def act(self, observations: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Next token and its log-prob for each observation: ``(actions (B,), log_probs (B,))``."""
        rows = [np.asarray(o, dtype=np.int64).reshape(-1).tolist() for o in observations]
        if any(not r for r in rows):
            raise ValueError("an observation is empty; token ids are needed to predict the next one")
        config = self.model.config.get_text_config()
        vocab, limit = int(config.vocab_size), getattr(config, "max_position_embeddings", None)
        for b, r in enumerate(rows):
            if min(r) < 0 or max(r) >= vocab:
                raise ValueError(f"observation {b} holds token ids outside the model's vocabulary [0, {vocab})")
            if limit is not None and len(r) >= limit:
                raise ValueError(f"observation {b} has {len(r)} tokens; the model's context holds {limit}")
        extend = (
            self._cache is not None
            and len(rows) == len(self._ids)
            and all(len(r) > len(c) and r[: len(c)] == c for r, c in zip(rows, self._ids))
        )
        new = [r[len(c) :] for r, c in zip(rows, self._ids)] if extend else rows
        logits = self._forward(new, keep_cache=extend)
        self._ids = rows
        actions, log_probs = self._sample(logits)
        return actions.cpu().numpy(), log_probs.cpu().numpy()

    def _forward(self, chunks: list[list[int]], keep_cache: bool) -> torch.Tensor:
        """Feed each row's new tokens (left-padded to one width); logits of each row's last token."""
        device = self._device
        width = max(len(c) for c in chunks)
        ids = torch.full((len(chunks), width), self.pad_token_id, dtype=torch.long)
        chunk_mask = torch.zeros((len(chunks), width), dtype=torch.bool)
        for b, c in enumerate(chunks):
            ids[b, width - len(c) :] = torch.tensor(c, dtype=torch.long)
            chunk_mask[b, width - len(c) :] = True
        if keep_cache:
            mask = torch.cat([self._mask, chunk_mask], dim=1)
            past = self._cache
        else:
            mask, past = chunk_mask, None
        # positions count real tokens only, so padding (at the left or between chunks) does not shift them
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -width:]
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(device),
                attention_mask=mask.long().to(device),
                position_ids=positions.to(device),
                past_key_values=past,
                use_cache=True,
            )
        self._cache, self._mask = out.past_key_values, mask
        return out.logits[:, -1].float()

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.temperature == 0:
            actions = logits.argmax(-1)
            return actions, logits.log_softmax(-1).gather(-1, actions[:, None]).squeeze(-1)
        processed = logits / self.temperature
        if self.top_k:
            kth = processed.topk(min(self.top_k, processed.shape[-1]), dim=-1).values[:, -1:]
            processed = processed.masked_fill(processed < kth, float("-inf"))
        if self.top_p < 1.0:
            from transformers.generation import TopPLogitsWarper

            processed = TopPLogitsWarper(top_p=self.top_p)(torch.zeros(len(processed), 1, dtype=torch.long), processed)
        probs = processed.softmax(-1)
        actions = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        source = logits if self.raw_log_probs else processed
        return actions, source.log_softmax(-1).gather(-1, actions[:, None]).squeeze(-1)
