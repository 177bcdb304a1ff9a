"""Policy wrapper over a Hugging Face transformers causal LM."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from wrappers.policies.base import LLMWrapperBase, _Sample
from wrappers.policies.settings import GenerationSettings

__all__ = ["TransformersWrapper"]


class TransformersWrapper(LLMWrapperBase):
    """A transformers causal LM as a chat policy (generation with ``model.generate``, scoring by a forward pass).

    Args:
        model: A ``PreTrainedModel`` (causal LM), a path to one, or ``"default"`` for the embedded SmolLM2.
        tokenizer: Its fast tokenizer; loaded from ``model`` when that is a path or ``"default"``.
        score_batch_size: Sequences per forward pass when scoring (default: all at once).
        **kwargs: The common policy options, see :class:`~wrappers.policies.base.LLMWrapperBase`.

    Generation-time log-probs come from the processed scores ``generate`` sampled from (temperature, top-k,
    top-p, min-p and min-tokens applied); scoring applies the same processing, so both agree. With
    ``raw_log_probs=True`` both report the model's own distribution.

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

    def __init__(self, model: Any, *, tokenizer: Any = None, score_batch_size: int | None = None, **kwargs: Any):
        model, tokenizer = _load(model, tokenizer)
        if not hasattr(model, "generate") or not hasattr(model, "config"):
            raise TypeError(f"expected a transformers causal LM (PreTrainedModel), got {type(model).__name__}")
        super().__init__(tokenizer=tokenizer, **kwargs)
        self.model = model
        if score_batch_size is not None and score_batch_size < 1:
            raise ValueError(f"score_batch_size must be a positive int, got {score_batch_size}")
        self.score_batch_size = score_batch_size
        # min-p filtering costs a sort per step even at 0: leave it unset unless the model's own generation
        # config would switch it on, which an explicit 0.0 then overrides
        self._min_p_off = 0.0 if getattr(model.generation_config, "min_p", None) is not None else None
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self.settings, name) != 0.0:
                raise ValueError(f"{name} is not supported by the transformers backend; use repetition_penalty")
        self._record({**kwargs, "score_batch_size": score_batch_size})

    def _new_version(self, given: dict[str, Any]) -> TransformersWrapper:
        return TransformersWrapper(self.model, tokenizer=self.tokenizer, **given)

    @property
    def context_length(self) -> int | None:  # noqa: D102
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)

    def _vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # ----------------------------------------------------------------------------------- generation

    def _generation_config(self, s: GenerationSettings) -> Any:
        from transformers import GenerationConfig

        sample = not s.greedy
        return GenerationConfig(
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
            repetition_penalty=s.repetition_penalty,
            no_repeat_ngram_size=0,
            renormalize_logits=False,
            num_return_sequences=s.num_samples,
            num_beams=1,
            eos_token_id=[] if s.ignore_eos else list(self.stop_ids),
            pad_token_id=self.pad_token_id,
            stop_strings=list(s.stop) or None,
            output_scores=self.return_log_probs and not self.raw_log_probs,
            output_logits=self.return_log_probs and self.raw_log_probs,
            return_dict_in_generate=True,
        )

    def _generate_ids(self, prompts: list[list[int]], settings: GenerationSettings) -> list[list[_Sample]]:
        from chatenv.padding import pad_sequences

        ids, mask = pad_sequences([torch.tensor(p, dtype=torch.long) for p in prompts], "left", self.pad_token_id)
        device = self._device
        config = self._generation_config(settings)
        extra = {"tokenizer": self.tokenizer} if settings.stop else {}
        seeded = (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
            if settings.seed is not None
            else contextlib.nullcontext()
        )
        with seeded, torch.inference_mode():
            if settings.seed is not None:
                torch.manual_seed(self._call_seed(settings.seed))
            out = self.model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config, **extra
            )
        width = ids.shape[1]
        generated = out.sequences[:, width:].cpu()
        steps = out.logits if self.raw_log_probs else out.scores
        log_probs = None
        if self.return_log_probs and generated.shape[1]:
            cols = []
            for t, step in enumerate(steps):
                step = step.float()
                chosen = step.gather(-1, generated[:, t : t + 1].to(step.device)).squeeze(-1)
                cols.append((chosen - step.logsumexp(-1)).cpu())
            log_probs = torch.stack(cols, dim=1)
        n = settings.num_samples
        samples: list[list[_Sample]] = []
        for i, row in enumerate(generated.tolist()):
            end, finished = self._response_end(row, settings)
            lp = log_probs[i, :end].clone() if log_probs is not None else None
            if lp is None and self.return_log_probs:
                lp = torch.zeros(0)
            if i % n == 0:
                samples.append([])
            samples[-1].append(_Sample(row[:end], lp, finished))
        return samples

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
            text = ""
            for j in range(end):
                text = self.chat_tokenizer.decode(row[: j + 1])
                if any(stop in text for stop in s.stop):
                    return j + 1, True
        return end, finished

    # ----------------------------------------------------------------------------------- scoring

    def _batches(self, seqs: list[list[int]]):
        """Yield ``(chunk, ids, logits)`` per forward pass over right-padded chunks of ``seqs``."""
        from chatenv.padding import pad_sequences

        size = self.score_batch_size or len(seqs)
        device = self._device
        with torch.inference_mode():
            for start in range(0, len(seqs), size):
                chunk = seqs[start : start + size]
                ids, mask = pad_sequences(
                    [torch.tensor(s, dtype=torch.long) for s in chunk], "right", self.pad_token_id
                )
                ids = ids.to(device)
                logits = self.model(input_ids=ids, attention_mask=mask.to(device)).logits.float()
                yield start, chunk, ids, logits

    def _process(self, logits: torch.Tensor, splits: list[int]) -> torch.Tensor:
        """Apply the sampling transformations to ``(B, T, V)`` logits (row t predicts token t + 1)."""
        s = self.settings
        if self.raw_log_probs or s.greedy:
            return logits
        if s.repetition_penalty != 1.0:
            raise ValueError(
                "scoring cannot reproduce repetition_penalty (it depends on each sample's history); pass "
                "raw_log_probs=True to score the model's own distribution"
            )
        from transformers.generation import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        logits = logits.clone()
        if s.min_new_tokens:
            # response token j (row split - 1 + j) cannot be an end token while j < min_new_tokens
            for b, split in enumerate(splits):
                lo, hi = max(split - 1, 0), min(split - 1 + s.min_new_tokens, logits.shape[1])
                if hi > lo:
                    logits[b, lo:hi, list(self.stop_ids)] = -math.inf
        if s.temperature != 1.0:
            logits = logits / s.temperature
        shape = logits.shape
        flat = logits.reshape(-1, shape[-1])
        dummy = torch.zeros(flat.shape[0], 1, dtype=torch.long)
        if s.top_k:
            flat = TopKLogitsWarper(top_k=s.top_k)(dummy, flat)
        if s.top_p < 1.0:
            flat = TopPLogitsWarper(top_p=s.top_p)(dummy, flat)
        if s.min_p > 0.0:
            flat = MinPLogitsWarper(min_p=s.min_p)(dummy, flat)
        return flat.reshape(shape)

    def _score_ids(self, seqs: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
        out = []
        for start, chunk, ids, logits in self._batches(seqs):
            logits = self._process(logits, splits[start : start + len(chunk)])[:, :-1]
            lp = (logits.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)).cpu()
            nan = torch.tensor([math.nan])
            out.extend(torch.cat([nan, lp[b, : len(seq) - 1]]) for b, seq in enumerate(chunk))
        return out

    def _full_logits(self, seqs: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
        out = []
        for start, chunk, _, batch in self._batches(seqs):
            batch = self._process(batch, splits[start : start + len(chunk)]).cpu()
            for b, seq in enumerate(chunk):
                logits = batch[b, : len(seq)]
                # row t of the result is the distribution of token t: shift by one (row 0 has no distribution)
                out.append(torch.cat([torch.zeros(1, logits.shape[-1]), logits[:-1]]))
        return out


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
