"""Policy wrappers: one API over transformers and vLLM (see :class:`~wrappers.policies.base.LLMWrapperBase`).

- backends: :class:`TransformersWrapper`, :class:`VLLMWrapper` (imported on first use: vLLM is optional);
- options: :class:`PolicyConfig` (every option of a policy), :class:`GenerationSettings` and
  :func:`normalize_generate_kwargs` (the generation vocabulary, from the core's :mod:`chatenv.sampling`);
- distributions: :func:`process_logits` (the sampling distribution, shared with
  :class:`~wrappers.token_policy.TokenStepPolicy`), :class:`MaskedCategorical` (what ``get_dist`` returns).
"""

from __future__ import annotations

from typing import Any

from chatenv.sampling import GenerationSettings, normalize_generate_kwargs
from wrappers.policies.base import LLMWrapperBase
from wrappers.policies.config import PolicyConfig
from wrappers.policies.distribution import MaskedCategorical
from wrappers.policies.logits import process_logits
from wrappers.policies.transformers import TransformersWrapper

__all__ = [
    "GenerationSettings",
    "LLMWrapperBase",
    "MaskedCategorical",
    "PolicyConfig",
    "TransformersWrapper",
    "VLLMWrapper",
    "normalize_generate_kwargs",
    "process_logits",
]


def __getattr__(name: str) -> Any:
    # vLLM is an optional extra: its wrapper module imports it only when used
    if name == "VLLMWrapper":
        from wrappers.policies.vllm import VLLMWrapper

        return VLLMWrapper
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
