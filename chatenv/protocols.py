"""The interfaces the core drives, declared as typed protocols.

:func:`chatenv.rollout` needs a policy (:class:`RolloutPolicy`), optionally a reference scorer
(:class:`ReferenceScorer`), and envs; it reaches env wrappers only through Gymnasium's
``has_wrapper_attr`` / ``get_wrapper_attr``, never by class name. Anything with these attributes works: the
adapters in the separate ``wrappers`` package implement them, and so can a user's own classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["REF_MODEL_ATTR", "ReferenceScorer", "RolloutPolicy"]

#: The attribute an env wrapper exposes (found with ``env.get_wrapper_attr``) when it scores replies with a
#: reference model; envs sharing one such model get one batched reference forward per rollout round.
REF_MODEL_ATTR = "ref_model"


@runtime_checkable
class ReferenceScorer(Protocol):
    """Scores token sequences with a frozen reference model."""

    def log_probs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Per sequence, ``(T,)`` float32 log p(x_t | x_<t); position 0 (no context) is NaN."""
        ...


@runtime_checkable
class RolloutPolicy(Protocol):
    """What :func:`chatenv.rollout` needs of a policy (``wrappers.policies.LLMWrapperBase`` has it).

    Attributes:
        generate: True for a policy that samples replies.
        num_samples: None (rollouts take one reply per observation).
        input_mode: ``"history"``, ``"text"`` or ``"tokens"``; must match the envs'.
        input_key: Where the policy reads its input in a tensordict.
        pad_token_id: The id used to pad token tensors.
        pad_output: Padded (True) or nested (False) outputs.
        tokens_key, masks_key, log_probs_key, text_key, history_key: Where the outputs go (None: not written).
    """

    generate: bool
    num_samples: int | None
    input_mode: str
    input_key: Any
    pad_token_id: int
    pad_output: bool
    tokens_key: Any
    masks_key: Any
    log_probs_key: Any
    text_key: Any
    history_key: Any

    def __call__(self, tensordict: Any) -> Any:
        """Generate a reply for every row of ``tensordict`` (batch ``(B,)``)."""
        ...
