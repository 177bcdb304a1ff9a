"""Picklable callables that build a policy wrapper inside a Ray actor."""

from __future__ import annotations

from typing import Any

__all__ = ["TransformersFactory", "VLLMFactory"]


def _check_model(model: Any) -> str:
    if not isinstance(model, str) or not model:
        raise TypeError(
            f"model must be a model path or 'default' (the actor loads it; model objects are not sent), got "
            f"{type(model).__name__}"
        )
    return model


class TransformersFactory:
    """Builds a :class:`~wrappers.policies.TransformersWrapper` from a saved model (in the actor that calls it).

    Args:
        model: A model folder (with its tokenizer) or ``"default"`` (the embedded SmolLM2).
        device: Where the model runs (e.g. ``"cuda"``; default: CPU).
        dtype: The model's dtype (e.g. ``torch.bfloat16``; default float32).
        **policy_kwargs: The policy's options (``input_mode``, ``generate_kwargs``, ...).

    Raises:
        TypeError: For a model that is not a path string.
    """

    def __init__(self, model: str, *, device: str | None = None, dtype: Any = None, **policy_kwargs: Any):
        self.model, self.device, self.dtype = _check_model(model), device, dtype
        self.policy_kwargs = dict(policy_kwargs)

    def __call__(self) -> Any:
        """The policy (loads the model)."""
        from wrappers.policies import TransformersWrapper

        if self.device is None and self.dtype is None:
            return TransformersWrapper(self.model, **self.policy_kwargs)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self.model == "default":
            from chatenv.models import default_model_path

            path = str(default_model_path())
        else:
            path = self.model
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype or torch.float32)
        loaded = loaded.to(self.device or "cpu").eval()
        return TransformersWrapper(loaded, tokenizer=AutoTokenizer.from_pretrained(path), **self.policy_kwargs)

    def __repr__(self) -> str:
        options = f"device={self.device!r}, dtype={self.dtype!r}, {self.policy_kwargs}"
        return f"TransformersFactory({self.model!r}, {options})"


class VLLMFactory:
    """Builds a :class:`~wrappers.policies.VLLMWrapper` (a vLLM engine) in the actor that calls it.

    Give the collector ``inference_gpus=1`` on GPU machines, and a ``load_weights=fn(policy, state_dict)`` that
    loads weights into the engine if you broadcast weights (the default loader needs a torch model at
    ``policy.model``).

    Args:
        model: A model folder.
        engine_kwargs: Arguments of ``vllm.LLM``.
        **policy_kwargs: The policy's options (``input_mode``, ``generate_kwargs``, ...).

    Raises:
        TypeError: For a model that is not a path string.
    """

    def __init__(self, model: str, *, engine_kwargs: dict | None = None, **policy_kwargs: Any):
        self.model = _check_model(model)
        self.engine_kwargs = dict(engine_kwargs or {})
        self.policy_kwargs = dict(policy_kwargs)

    def __call__(self) -> Any:
        """The policy (starts the engine)."""
        from wrappers.policies import VLLMWrapper

        return VLLMWrapper(self.model, engine_kwargs=self.engine_kwargs, **self.policy_kwargs)

    def __repr__(self) -> str:
        return f"VLLMFactory({self.model!r}, engine_kwargs={self.engine_kwargs}, {self.policy_kwargs})"
