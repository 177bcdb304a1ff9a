"""The local reference model: a frozen transformers causal LM that scores token ids.

Also the checks every reference scorer of :mod:`wrappers.kl` shares: :func:`check_sequences` (token id sequences
in), :func:`check_scored` (log-prob rows out) and :func:`score_with` (one call to any ``log_probs(sequences)``
scorer, its answer checked).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from chatenv.ids import token_id_array
from wrappers.kl.incremental import IncrementalScorer

__all__ = ["ReferenceModel", "check_scored", "check_sequences", "score_with"]


def _ids(i: int, seq: Any, vocab: int | None, what: str, owner: str) -> list[int]:
    """One sequence of token ids as a list of ints, checked (1-D, not empty, integers, in the vocabulary)."""
    ids = token_id_array(seq, f"{what} {i}", vocab_size=vocab, owner=owner)
    if ids.size == 0:
        raise ValueError(
            f"{what} {i} is empty: a scored sequence needs at least one token (score the prompt and the reply "
            "together: position t holds log p(x_t | x_<t))"
        )
    return ids.tolist()


def check_sequences(
    sequences: Any, vocab: int | None = None, *, what: str = "sequence", owner: str = "the reference model"
) -> list[list[int]]:
    """Token id sequences as lists of ints, checked before anything is scored.

    Args:
        sequences: An iterable of 1-D id sequences (lists, arrays or tensors).
        vocab: The vocabulary size the ids must fit (None: not checked).
        what: What one sequence is, for the error messages (``"sequence"``, ``"prompt"``).
        owner: Whose vocabulary it is, for the error messages.

    Returns:
        One list of ints per sequence (an empty list for no sequences).

    Raises:
        TypeError: For text, non-integer ids, or sequences that are not 1-D.
        ValueError: For an empty sequence, or an id outside ``[0, vocab)``.

    Example:
        >>> check_sequences([[1, 2], (3,)], vocab=10)
        [[1, 2], [3]]
    """
    if isinstance(sequences, (str, bytes)) or not isinstance(sequences, Iterable):
        raise TypeError(f"expected a list of token id sequences, got {type(sequences).__name__}")
    return [_ids(i, s, vocab, what, owner) for i, s in enumerate(sequences)]


def score_with(scorer: Any, sequences: list[list[int]], source: str) -> list[torch.Tensor]:
    """Call ``scorer.log_probs(sequences)`` and check its answer: one float row per sequence, of its length.

    Args:
        scorer: Anything with ``log_probs(sequences)`` (a :class:`ReferenceModel`, a ``RayRefModel``, ...).
        sequences: Checked id sequences (:func:`check_sequences`).
        source: What the scorer is, for the error messages.

    Returns:
        Per sequence, a ``(T,)`` float32 tensor.

    Raises:
        ValueError: If the scorer answers with another number of rows, or a row of another length.
        TypeError: If a row is not numeric.
    """
    return check_scored(scorer.log_probs(sequences) if sequences else [], sequences, source)


def check_scored(rows: Any, sequences: list[list[int]], source: str) -> list[torch.Tensor]:
    """A scorer's answer for ``sequences`` as float32 tensors, checked: one row per sequence, of its length.

    Args:
        rows: What the scorer returned.
        sequences: The sequences it scored.
        source: What the scorer is, for the error messages.

    Returns:
        Per sequence, a ``(T,)`` float32 tensor.

    Raises:
        ValueError: For another number of rows, or a row of another length.
        TypeError: For a row that is not numeric.
    """
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Iterable):
        raise TypeError(f"{source} returned {type(rows).__name__}, expected a list of log-prob rows")
    rows = list(rows)
    if len(rows) != len(sequences):
        raise ValueError(f"{source} returned {len(rows)} rows of log-probs for {len(sequences)} sequences")
    out = []
    for i, (row, seq) in enumerate(zip(rows, sequences)):
        try:
            if isinstance(row, torch.Tensor):
                t = row.detach().to("cpu", torch.float32).reshape(-1)  # (T,)
            else:
                t = torch.as_tensor(np.asarray(row, dtype=np.float32)).reshape(-1)  # (T,)
        except (TypeError, ValueError) as e:
            raise TypeError(f"{source} returned non-numeric log-probs for sequence {i}: {e}") from e
        if t.shape[0] != len(seq):
            raise ValueError(f"{source} returned {t.shape[0]} log-probs for sequence {i} of {len(seq)} tokens")
        out.append(t)
    return out


def _vocab_sizes(model: Any) -> dict[str, int]:
    """The vocabulary sizes a model declares: its config, input embedding rows and output projection rows."""
    sizes: dict[str, int] = {}
    config = getattr(model, "config", None)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "vocab_size", None):
            sizes["config.vocab_size"] = int(text.vocab_size)
    for name, getter in (("input embedding rows", "get_input_embeddings"), ("lm_head rows", "get_output_embeddings")):
        layer = getattr(model, getter, lambda: None)()
        weight = getattr(layer, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            sizes[name] = int(weight.shape[0])
    return sizes


def _check_vocabulary(model: Any, tokenizer: Any) -> int:
    """The number of ids ``model`` scores, once checked to cover every id of ``tokenizer``."""
    sizes = _vocab_sizes(model)
    vocab = min(sizes.values(), default=len(tokenizer))
    if vocab < len(tokenizer):
        detail = ", ".join(f"{k} {v}" for k, v in sizes.items())
        raise ValueError(
            f"the reference model {type(model).__name__} knows {vocab} token ids ({detail}) but its tokenizer has "
            f"{len(tokenizer)}: ids {vocab}..{len(tokenizer) - 1} would have no log-prob; pass the tokenizer the model "
            "was trained with, or resize its embeddings (model.resize_token_embeddings(len(tokenizer)))"
        )
    return vocab


def _check_temperature(temperature: Any) -> float:
    from chatenv.sampling import MIN_TEMPERATURE

    if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.integer, np.floating)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__} {temperature!r}")
    value = float(temperature)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if value < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature {value} is too small: logits / temperature overflow and every log-prob is NaN or "
            f"-inf; use a temperature >= {MIN_TEMPERATURE} (the policy's sampling temperature), or 1.0 with a "
            "policy created with raw_log_probs=True"
        )
    return value


def _check_sizes(batch_size: Any, kv_cache_size: Any) -> None:
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)):
        raise TypeError(f"batch_size must be an int or None, got {type(batch_size).__name__}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (or None: all sequences at once), got {batch_size}")
    if isinstance(kv_cache_size, bool) or not isinstance(kv_cache_size, (int, np.integer)):
        raise TypeError(f"kv_cache_size must be an int, got {type(kv_cache_size).__name__} {kv_cache_size!r}")
    if kv_cache_size < 0:
        raise ValueError(f"kv_cache_size must be >= 0 (0: no incremental scoring), got {kv_cache_size}")


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
        kv_cache_size: How many sequences keep their KV cache for incremental scoring (0: off). A call that
            scores one sequence extending one scored before (the token-level env's ``context + [token]`` at
            each step, the turn-level env's next turn) runs the model over the new tokens only, with the same
            numbers as a full forward; each kept sequence holds the memory of its KV cache. Use about one per env
            sharing this reference, and :meth:`clear_cache` after changing the model's weights.

    Raises:
        TypeError: For a temperature that is not a number, or a ``batch_size`` or ``kv_cache_size`` that is not an
            int.
        ValueError: For a temperature that is not a finite number >= ``MIN_TEMPERATURE`` (1e-4), a model whose
            vocabulary is smaller than its tokenizer's (those ids would have no log-prob), ``batch_size < 1`` or
            ``kv_cache_size < 0``.

    Example:
        >>> ReferenceModel("default", temperature=0.0)
        Traceback (most recent call last):
        ...
        ValueError: temperature must be a finite number > 0, got 0.0
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        batch_size: int | None = None,
        temperature: float = 1.0,
        kv_cache_size: int = 4,
    ):
        from wrappers.policies import TransformersWrapper

        temperature = _check_temperature(temperature)
        _check_sizes(batch_size, kv_cache_size)
        if isinstance(model, torch.nn.Module) and tokenizer is not None and not isinstance(tokenizer, str):
            _check_vocabulary(model, tokenizer)  # before the policy wrapper's own check: name the reference
        scorer = TransformersWrapper(
            model,
            tokenizer=tokenizer,
            generate=False,
            input_mode="tokens",
            raw_log_probs=temperature == 1.0,
            generate_kwargs={"temperature": temperature},
            score_batch_size=batch_size,
        )
        #: Number of token ids the reference scores (ids must lie in ``[0, vocab_size)``).
        self.vocab_size = _check_vocabulary(scorer.model, scorer.tokenizer)
        self._scorer = scorer
        self.temperature = temperature
        self.model = scorer.model
        self.tokenizer = scorer.tokenizer
        self._incremental = IncrementalScorer(self.model, temperature, kv_cache_size) if kv_cache_size else None

    def log_probs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per sequence, ``(T,)`` float32 log-probs; position 0 (no context) is NaN.

        Args:
            sequences: Token id sequences (lists, arrays or 1-D integer tensors), each at least one token long.

        Returns:
            One tensor per sequence (an empty list for no sequences).

        Raises:
            TypeError: For non-integer ids or sequences that are not 1-D.
            ValueError: For an empty sequence, an id outside the reference's vocabulary, or a model that gives
                NaN or infinite log-probs (e.g. NaN weights).
        """
        seqs = check_sequences(sequences, self.vocab_size)
        if not seqs:
            return []
        if len(seqs) == 1 and self._incremental is not None:
            rows = [self._incremental.score(seqs[0])]
        else:
            rows = self._scorer.score_sequences(seqs)
        for i, row in enumerate(rows):
            bad = (~torch.isfinite(row[1:])).nonzero()
            if len(bad):
                j = int(bad[0]) + 1
                raise ValueError(
                    f"the reference model {type(self.model).__name__} gave a non-finite log-prob ({float(row[j])}) "
                    f"for sequence {i} at position {j} of {len(row)}: its weights or activations are NaN or inf "
                    "(a diverged or corrupted checkpoint, or a float16 overflow); check the model or load it in "
                    "float32"
                )
        return rows

    def clear_cache(self) -> None:
        """Drop the KV caches kept for incremental scoring (after changing the model's weights, or to free memory)."""
        if self._incremental is not None:
            self._incremental.clear()

    def __repr__(self) -> str:
        return f"ReferenceModel({type(self.model).__name__}, temperature={self.temperature})"
