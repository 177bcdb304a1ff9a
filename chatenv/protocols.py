"""The interfaces the core drives, declared as typed protocols.

:func:`chatenv.rollout` needs a policy (:class:`RolloutPolicy`), optionally a reference scorer
(:class:`ReferenceScorer`), and envs; it reaches env wrappers only through Gymnasium's
``has_wrapper_attr`` / ``get_wrapper_attr``, never by class name. Anything with these attributes works: the
adapters in the separate ``wrappers`` package implement them, and so can a user's own classes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = [
    "LAYOUT_FIELDS",
    "REF_MODEL_ATTR",
    "VERSION_KEY",
    "AsyncRolloutPolicy",
    "OutputLayout",
    "ReferenceScorer",
    "RolloutPolicy",
    "VersionedPolicy",
    "layout_of",
]

#: The attribute an env wrapper exposes (found with ``env.get_wrapper_attr``) when it scores replies with a
#: reference model; envs sharing one such model get one batched reference forward per rollout round.
REF_MODEL_ATTR = "ref_model"

#: Where a policy output may say which policy version (weights version) generated each row: int64, batch ``(B,)``.
#: Rollouts record it per transition in the ``policy_version`` column.
VERSION_KEY = "policy_version"


@dataclass(frozen=True)
class OutputLayout:
    """Where a policy's output puts each container, and how: all that assembling its rows needs of a policy.

    Rollouts read it from the policy once (:func:`layout_of`); the capture endpoint and Ray's workers, which hold
    no policy object, pass one themselves.

    Attributes:
        tokens_key: Where the :class:`~chatenv.containers.Tokens` go.
        masks_key, log_probs_key, text_key, history_key: Where the other containers go (None: not written).
        input_mode: ``"history"``, ``"text"`` or ``"tokens"`` (which text/chat views the rows carry).
        pad_token_id: The id used to pad token tensors.
        pad_output: Padded (True) or nested (False) containers.
    """

    tokens_key: Any = "tokens"
    masks_key: Any = "masks"
    log_probs_key: Any = "log_probs"
    text_key: Any = None
    history_key: Any = None
    input_mode: str = "tokens"
    pad_token_id: int = 0
    pad_output: bool = True


#: the names of :class:`OutputLayout`'s fields (policy attributes of the same names)
LAYOUT_FIELDS = tuple(f.name for f in fields(OutputLayout))


def layout_of(policy: Any) -> OutputLayout:
    """The output layout of a policy: its ``output_layout`` if it has one, else read from its attributes.

    An :class:`OutputLayout` is returned as it is.

    Raises:
        TypeError: If the policy lacks one of the attributes (a :class:`RolloutPolicy` has them all).
    """
    if isinstance(policy, OutputLayout):
        return policy
    given = getattr(policy, "output_layout", None)
    if isinstance(given, OutputLayout):
        return given
    missing = [name for name in LAYOUT_FIELDS if name != "pad_output" and not hasattr(policy, name)]
    if missing:
        raise TypeError(f"{type(policy).__name__} is not a RolloutPolicy: it has no {missing}")
    values = {name: getattr(policy, name) for name in LAYOUT_FIELDS if name != "pad_output"}
    return OutputLayout(**values, pad_output=bool(getattr(policy, "pad_output", True)))


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


@runtime_checkable
class VersionedPolicy(Protocol):
    """A policy whose weights can be replaced while it runs; every replacement bumps its version.

    Attributes:
        version: The version of the weights now in use: 0 at construction, +1 per :meth:`update_weights`.
    """

    version: int

    def update_weights(self, state_dict: Mapping[str, Any]) -> int:
        """Load new weights (replies generated from now on use them); the new version."""
        ...


@runtime_checkable
class AsyncRolloutPolicy(RolloutPolicy, Protocol):
    """What ``chatenv.rollout(..., mode="async")`` needs of a policy: requests submitted one at a time.

    :meth:`submit` queues a request and returns at once; the backend batches what is waiting (continuous batching
    on vLLM's async engine, a short batching window for transformers) and resolves each future when its reply is
    ready. ``wrappers.policies.TransformersWrapper`` and ``VLLMWrapper`` have it (and ``agenerate``, the same as
    a coroutine).

    Attributes:
        version: The policy's current weights version (see :class:`VersionedPolicy`).
    """

    version: int

    def submit(self, tensordict: Any, *, seed_key: int | None = None) -> Future[Any]:
        """Queue a generation for every row of ``tensordict`` (batch ``(B,)``).

        Args:
            tensordict: The policy's input, as for ``__call__``.
            seed_key: An int naming the request within a run (a rollout passes one per episode turn): with a
                sampling seed, backends that seed each request (vLLM) derive its seed from it, so its sample does
                not depend on when it runs.

        Returns:
            A future of the output tensordict (the layout ``__call__`` returns), holding :data:`VERSION_KEY`: the
            version of the weights that generated each row.
        """
        ...


@runtime_checkable
class ServedPolicy(RolloutPolicy, Protocol):
    """What the capture endpoint (:mod:`chatenv.serve`) needs of a policy.

    A rollout policy, its tokenizer, and copies with other generation settings for each request's ``temperature``,
    ``max_tokens``, ``seed``, ... Optional attributes it uses when present: ``chat_tokenizer`` (else one is built
    from ``tokenizer`` and ``template``), ``context_length`` (the context check), ``settings.max_new_tokens`` (the
    default reply budget).

    Attributes:
        tokenizer: The Hugging Face fast tokenizer of the model.
    """

    tokenizer: Any

    def get_new_version(self, **overrides: Any) -> Any:
        """A copy sharing the model with some options changed (``generate_kwargs={...}`` for generation settings)."""
        ...
