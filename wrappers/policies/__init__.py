"""Policy wrappers: one API over transformers and vLLM (see :class:`~wrappers.policies.base.LLMWrapperBase`)."""

from __future__ import annotations

from typing import Any

from wrappers.policies.base import LLMWrapperBase, MaskedCategorical
from wrappers.policies.settings import GenerationSettings, normalize_generate_kwargs
from wrappers.policies.transformers import TransformersWrapper

__all__ = [
    "GenerationSettings",
    "LLMWrapperBase",
    "MaskedCategorical",
    "TransformersWrapper",
    "VLLMWrapper",
    "normalize_generate_kwargs",
]


def __getattr__(name: str) -> Any:
    # vLLM is an optional extra: its wrapper module imports it only when used
    if name == "VLLMWrapper":
        from wrappers.policies.vllm import VLLMWrapper

        return VLLMWrapper
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
