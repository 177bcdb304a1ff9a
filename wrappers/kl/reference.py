"""The local reference model: a frozen transformers causal LM that scores token ids."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ReferenceModel"]


class ReferenceModel:
    """A frozen transformers causal LM that returns log p(x_t | x_<t) of given ids (fp32, no autograd).

    It implements :class:`chatenv.protocols.ReferenceScorer`, so :func:`chatenv.rollout`, the env wrappers and the
    transforms of :mod:`wrappers.kl` all take it (as does anything else with the same ``log_probs`` method).

    Args:
        model: A ``PreTrainedModel``, a path, or ``"default"`` (the embedded SmolLM2).
        tokenizer: Its tokenizer (loaded with a path or ``"default"``).
        batch_size: Sequences per forward pass (default: all at once).
        temperature: Temperature of the reference distribution. Set it to the policy's sampling temperature:
            the policy reports log-probs of the tempered distribution it sampled from, and a KL compares
            distributions at the same temperature (a model against its own copy then gives 0). Alternatively
            keep 1.0 and create the policy with ``raw_log_probs=True``.

    Raises:
        ValueError: For a temperature that is not a finite number > 0.
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, batch_size: int | None = None, temperature: float = 1.0):
        from wrappers.policies import TransformersWrapper

        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        self._scorer = TransformersWrapper(
            model,
            tokenizer=tokenizer,
            generate=False,
            input_mode="tokens",
            raw_log_probs=temperature == 1.0,
            generate_kwargs={"temperature": temperature},
            score_batch_size=batch_size,
        )
        self.temperature = float(temperature)
        self.model = self._scorer.model
        self.tokenizer = self._scorer.tokenizer

    def log_probs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per sequence, ``(T,)`` float32 log-probs; position 0 (no context) is NaN."""
        if not sequences:
            return []
        seqs = [[int(x) for x in s] for s in sequences]
        # The one use of the policy's private scorer: once the policy wrappers' public scoring method lands
        # (``score_sequences(sequences)``, same result), call that instead.
        return self._scorer._score_ids(seqs, [len(s) for s in seqs])  # noqa: SLF001

    def __repr__(self) -> str:
        return f"ReferenceModel({type(self.model).__name__}, temperature={self.temperature})"
