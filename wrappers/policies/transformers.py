"""Policy wrapper over a Hugging Face transformers causal LM."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from chatenv.sampling import GenerationSettings
from wrappers.policies.asynchronous import AsyncPolicyMixin, Weights, check_state_dict
from wrappers.policies.base import LLMWrapperBase
from wrappers.policies.config import PolicyConfig
from wrappers.policies.constrained import GrammarProcessor, step_log_probs
from wrappers.policies.logits import (
    apply_repetition_penalty,
    new_token_counts,
    prefix_seen,
    process_logits,
    reports_processed,
)
from wrappers.policies.outputs import Sample
from wrappers.policies.streaming import OnTokens

__all__ = ["TransformersWrapper"]


class TransformersWrapper(AsyncPolicyMixin, LLMWrapperBase):
    """A transformers causal LM as a chat policy (generation with ``model.generate``, scoring by a forward pass).

    Args:
        model: A ``PreTrainedModel`` (causal LM), a path to one, or ``"default"`` for the embedded SmolLM2.
        tokenizer: Its fast tokenizer; loaded from ``model`` when that is a path or ``"default"``.
        score_batch_size: Sequences per forward pass when scoring (default: all at once).
        **kwargs: The common policy options, see :class:`~wrappers.policies.base.LLMWrapperBase`;
            ``requires_grad=True`` makes scoring keep the autograd graph (to train through :meth:`get_dist` or
            :meth:`log_prob`, e.g. as the actor of TorchRL's ``GRPOLoss``).

    Generation-time log-probs come from the processed scores ``generate`` sampled from (repetition penalty,
    min-tokens, temperature, top-k, top-p and min-p applied); scoring applies the same processing
    (:func:`~wrappers.policies.logits.process_logits`), so both agree. With ``raw_log_probs=True`` (and for
    greedy decoding) both report the model's own distribution.

    Requests can also come one at a time (:meth:`submit`, :meth:`agenerate`, as ``chatenv.rollout(...,
    mode="async")`` sends them): those waiting when the model is free, or arriving within :attr:`batch_window`
    seconds, run as one batched ``generate`` on a worker thread. :meth:`update_weights` loads a state dict into the
    model between batches and bumps :attr:`version`.

    Example:
        >>> import torch; from tensordict import TensorDict
        >>> from chatenv import ChatHistory, History
        >>> policy = TransformersWrapper("default", generate_kwargs={"max_new_tokens": 8, "temperature": 0})
        >>> td = TensorDict(history=ChatHistory(prompt=History.from_chats([[{"role": "user", "content": "Hi"}]]),
        ...                                     batch_size=[1]), batch_size=[1])
        >>> out = policy(td)
        >>> out["history"].response.to_chats()[0][0]["role"]
        'assistant'
    """

    backend = "transformers"
    version_options = ("score_batch_size",)
    differentiable = True

    def __init__(self, model: Any, *, tokenizer: Any = None, score_batch_size: int | None = None, **kwargs: Any):
        model, tokenizer = _load(model, tokenizer)
        self._attach(model, tokenizer, PolicyConfig.from_arguments(**kwargs), score_batch_size)

    def _attach(
        self,
        model: Any,
        tokenizer: Any,
        config: PolicyConfig,
        score_batch_size: int | None,
        weights: Weights | None = None,
    ) -> None:
        """Set this policy up on a loaded model (the constructor and every new version come here)."""
        if not hasattr(model, "generate") or not hasattr(model, "config"):
            raise TypeError(f"expected a transformers causal LM (PreTrainedModel), got {type(model).__name__}")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(config.settings, name) != 0.0:
                raise ValueError(f"{name} is not supported by the transformers backend; use repetition_penalty")
        if score_batch_size is not None and (isinstance(score_batch_size, bool) or score_batch_size < 1):
            raise ValueError(f"score_batch_size must be a positive int, got {score_batch_size}")
        super().__init__(tokenizer=tokenizer, config=config)
        self.model = model
        self.score_batch_size = score_batch_size
        # min-p filtering costs a sort per step even at 0: leave it unset unless the model's own generation
        # config would switch it on, which an explicit 0.0 then overrides
        self._min_p_off = 0.0 if getattr(model.generation_config, "min_p", None) is not None else None
        self._check_vocabulary()
        self._init_async(weights)

    @classmethod
    def _on_model(
        cls, model: Any, tokenizer: Any, config: PolicyConfig, score_batch_size: int | None, weights: Any = None
    ):
        """A policy of this class on an already loaded model (what new versions are: they share its weights)."""
        policy = cls.__new__(cls)
        cls._attach(policy, model, tokenizer, config, score_batch_size, weights)
        return policy

    def _with_config(self, config: PolicyConfig, **options: Any) -> TransformersWrapper:
        batch = options.get("score_batch_size", self.score_batch_size)
        return self._on_model(self.model, self.tokenizer, config, batch, self._weights)

    def _load_weights(self, state_dict: Any) -> None:
        """Copy ``state_dict`` into the model (names and shapes checked first: a refused update changes nothing)."""
        check_state_dict(state_dict, self.model.state_dict())
        with torch.no_grad():
            self.model.load_state_dict(state_dict, strict=False)

    @property
    def context_length(self) -> int | None:  # noqa: D102
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def _vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def _min_tokens_ids(self) -> tuple[int, ...]:
        """The ids ``min_new_tokens`` forbids (none when EOS is ignored: generation then has no stop ids)."""
        return () if self.settings.ignore_eos else self.stop_ids

    # ----------------------------------------------------------------------------------- generation

    def _generation_kwargs(self, s: GenerationSettings, pad_widths: Sequence[int], per_row: int) -> dict[str, Any]:
        """What ``model.generate`` is called with for ``s``: the one translation of the settings for it.

        The repetition penalty runs as our own processor: ``generate``'s counts the left padding of shorter
        prompts as seen tokens, so a row's distribution would depend on the rest of the batch.
        """
        from transformers import GenerationConfig, LogitsProcessorList

        sample = not s.greedy
        own = self.return_log_probs and reports_processed(s, self.raw_log_probs)
        config = GenerationConfig(
            max_new_tokens=s.max_new_tokens,
            min_new_tokens=s.min_new_tokens or None,
            min_length=None if s.min_new_tokens else 0,
            do_sample=sample,
            temperature=s.temperature if sample else 1.0,
            top_k=s.top_k if sample else 0,
            top_p=s.top_p if sample else 1.0,
            min_p=s.min_p if sample and s.min_p > 0 else self._min_p_off,
            typical_p=1.0,
            epsilon_cutoff=0.0,
            eta_cutoff=0.0,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            renormalize_logits=False,
            num_return_sequences=per_row,
            num_beams=1,
            eos_token_id=[] if s.ignore_eos else list(self.stop_ids),
            pad_token_id=self.pad_token_id,
            stop_strings=list(s.stop) or None,
            output_scores=own,
            output_logits=self.return_log_probs and not own,
            return_dict_in_generate=True,
        )
        processors = LogitsProcessorList()
        if s.repetition_penalty != 1.0:
            processors.append(_RepetitionPenalty(s.repetition_penalty, pad_widths, per_row))
        if s.grammar is not None:  # after the penalties, before the temperature and filters (generate adds those)
            processors.append(GrammarProcessor(self.tokenizer, self._vocab_size(), self._grammar_stops(s), s.grammar))
        extra = {"tokenizer": self.tokenizer} if s.stop else {}
        return {"generation_config": config, "logits_processor": processors, **extra}

    def _generate_ids(
        self, prompts: list[list[int]], settings: GenerationSettings, on_tokens: OnTokens | None = None
    ) -> list[list[Sample]]:
        from chatenv.padding import pad_sequences

        # generate's greedy search returns one sequence per row: greedy samples are rows of their own
        repeat = settings.num_samples if settings.greedy else 1
        rows = [p for p in prompts for _ in range(repeat)]
        ids, mask = pad_sequences([torch.tensor(p, dtype=torch.long) for p in rows], "left", self.pad_token_id)
        device = self._device
        kwargs = self._generation_kwargs(
            settings, [ids.shape[1] - len(p) for p in rows], settings.num_samples // repeat
        )
        if on_tokens is not None:
            kwargs["streamer"] = _RowStreamer(on_tokens, lambda row: self._ends_at_last(row, settings))
        seeded = (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
            if settings.seed is not None
            else contextlib.nullcontext()
        )
        # one version of the weights per batch: an update (update_weights) waits for the generation to finish
        with self._weights.lock, seeded, torch.inference_mode():
            if settings.seed is not None:
                torch.manual_seed(self._call_seed(settings.seed))
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        generated = out.sequences[:, ids.shape[1] :].cpu()
        log_probs, top = None, None
        if self.return_log_probs:
            steps = out.scores if kwargs["generation_config"].output_scores else out.logits
            grammar = next((p for p in kwargs["logits_processor"] if isinstance(p, GrammarProcessor)), None)
            log_probs, top = step_log_probs(steps, generated, settings.top_logprobs, grammar)
        n = settings.num_samples
        samples: list[list[Sample]] = []
        for i, row in enumerate(generated.tolist()):
            end, finished = self._response_end(row, settings)
            lp = log_probs[i, :end].clone() if log_probs is not None else None
            if i % n == 0:
                samples.append([])
            alternatives = None if top is None else (top[0][i, :end].clone(), top[1][i, :end].clone())
            samples[-1].append(Sample(row[:end], lp, finished, alternatives))
        return samples

    def _grammar_stops(self, s: GenerationSettings) -> tuple[int, ...]:
        """The ids a grammar lets end a reply once it is complete."""
        return self.stop_ids if not s.ignore_eos else ()

    def _response_end(self, row: list[int], s: GenerationSettings) -> tuple[int, bool]:
        """Length of a generated row (``generate`` pads finished rows) and whether it stopped by itself."""
        end = len(row)
        finished = False
        if not s.ignore_eos:
            for j, tok in enumerate(row):
                if tok in self.stop_ids:
                    end, finished = j + 1, True
                    break
        if s.stop:
            for j in range(end):
                text = self.chat_tokenizer.decode(row[: j + 1])
                if any(stop in text for stop in s.stop):
                    return j + 1, True
        return end, finished

    def _ends_at_last(self, row: list[int], s: GenerationSettings) -> bool:
        """Whether :meth:`_response_end` ends ``row`` at its last id (the ids before it were checked already)."""
        if not s.ignore_eos and row[-1] in self.stop_ids:
            return True
        if not s.stop:
            return False
        # a stop string that the last id completes lies in the last ids: one per byte of it at most (byte tokens)
        window = 4 * max(len(stop) for stop in s.stop) + 4
        tail = self.chat_tokenizer.decode(row[-window:])
        return any(stop in tail for stop in s.stop)

    # ----------------------------------------------------------------------------------- scoring

    def _batches(self, seqs: list[list[int]]) -> Iterator[tuple[int, list[list[int]], torch.Tensor, torch.Tensor]]:
        """Yield ``(start, chunk, ids, logits)`` per forward pass over right-padded chunks of ``seqs``.

        Under ``torch.inference_mode()``, or with autograd on when the policy was made with ``requires_grad=True``.
        """
        from chatenv.padding import pad_sequences

        size = self.score_batch_size or len(seqs)
        device = self._device
        # requires_grad: keep the graph (a loss trains through these logits), even inside a caller's no_grad
        with torch.enable_grad() if self.config.requires_grad else torch.inference_mode():
            for start in range(0, len(seqs), size):
                chunk = seqs[start : start + size]
                ids, mask = pad_sequences(
                    [torch.tensor(s, dtype=torch.long) for s in chunk], "right", self.pad_token_id
                )
                ids = ids.to(device)
                logits = self.model(input_ids=ids, attention_mask=mask.to(device)).logits.float()
                yield start, chunk, ids, logits

    def _reported(self, logits: torch.Tensor, ids: torch.Tensor, chunk: list[list[int]], splits: list[int]):
        """``(B, T, V)`` logits (row t predicts token t + 1) of the distribution whose log-probs are reported."""
        s = self.settings
        if not reports_processed(s, self.raw_log_probs):
            return logits
        width = logits.shape[1]
        seen = prefix_seen(ids, [len(c) for c in chunk], logits.shape[-1]) if s.repetition_penalty != 1.0 else None
        new = new_token_counts(splits, width) if s.min_new_tokens else None
        return process_logits(logits, s, stop_ids=self._min_tokens_ids, new_tokens=new, seen=seen)

    def _score_ids(self, seqs: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
        out = []
        for start, chunk, ids, logits in self._batches(seqs):
            logits = self._reported(logits, ids, chunk, splits[start : start + len(chunk)])[:, :-1]
            lp = (logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)).cpu()
            nan = torch.tensor([math.nan])
            out.extend(torch.cat([nan, lp[b, : len(seq) - 1]]) for b, seq in enumerate(chunk))
        return out

    def _full_logits(self, seqs: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
        out = []
        for start, chunk, ids, batch in self._batches(seqs):
            batch = self._reported(batch, ids, chunk, splits[start : start + len(chunk)]).cpu()
            for b, seq in enumerate(chunk):
                logits = batch[b, : len(seq)]
                # row t of the result is the distribution of token t: shift by one (row 0 has no distribution)
                out.append(torch.cat([torch.zeros(1, logits.shape[-1]), logits[:-1]]))
        return out


class _RowStreamer:
    """``generate``'s streamer: each step's tokens handed on per row, until the row's reply has ended.

    ``generate`` first puts the prompts, then one ``(rows,)`` tensor per step; a finished row gets padding, which is
    not handed on. A row ends where :meth:`TransformersWrapper._response_end` ends it (a stop id or a stop string),
    so what is handed on is exactly the reply's ids.

    Args:
        on_tokens: The stream's callback.
        ended: Whether a row's ids so far hold a finished reply.
    """

    def __init__(self, on_tokens: OnTokens, ended: Callable[[list[int]], bool]):
        self.on_tokens = on_tokens
        self.ended = ended
        self.rows: list[list[int]] | None = None
        self.finished: list[bool] = []

    def put(self, value: torch.Tensor) -> None:  # noqa: D102
        if self.rows is None:  # the prompts
            self.rows = [[] for _ in range(value.shape[0])]
            self.finished = [False] * value.shape[0]
            return
        for row, token in enumerate(value.reshape(-1).tolist()):
            if self.finished[row]:
                continue
            self.rows[row].append(int(token))
            self.finished[row] = self.ended(self.rows[row])
            self.on_tokens(row, [int(token)], None)

    def end(self) -> None:  # noqa: D102
        """Nothing to flush: every token was handed on as it came."""


class _RepetitionPenalty:
    """``generate`` logits processor: the repetition penalty over each row's own tokens (left padding excluded).

    Args:
        penalty: The repetition penalty.
        pad_widths: Left padding of each prompt.
        num_samples: Rows per prompt (``generate`` repeats each prompt this many times, consecutively).
    """

    def __init__(self, penalty: float, pad_widths: Sequence[int], num_samples: int):
        self.penalty = penalty
        self.pad_widths = torch.as_tensor(list(pad_widths), dtype=torch.long).repeat_interleave(num_samples)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        real = positions[None, :] >= self.pad_widths.to(input_ids.device)[:, None]  # (N, L)
        # padding positions repeat the row's last token (always real), so they add nothing
        ids = torch.where(real, input_ids, input_ids[:, -1:]).clamp(max=scores.shape[-1] - 1)
        seen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
        return apply_repetition_penalty(scores, seen, self.penalty)


def _load(model: Any, tokenizer: Any) -> tuple[Any, Any]:
    if isinstance(model, str):
        if model == "default":
            from chatenv.models import load_default_model

            loaded, default_tokenizer = load_default_model()
            return loaded, tokenizer if tokenizer is not None else default_tokenizer
        from transformers import AutoModelForCausalLM, AutoTokenizer

        loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        loaded.eval()
        return loaded, tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model)
    if tokenizer is None:
        raise ValueError("pass tokenizer=... with a model object (or give the model as a path to load both)")
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return model, tokenizer
