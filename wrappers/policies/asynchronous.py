"""Requests one at a time, weight versions and weight updates, for every policy backend.

:class:`AsyncPolicyMixin` gives a backend of :class:`~wrappers.policies.base.LLMWrapperBase` what
``chatenv.rollout(..., mode="async")`` needs (:class:`~chatenv.protocols.AsyncRolloutPolicy`):

- :meth:`~AsyncPolicyMixin.submit` reads and checks the input on the caller's thread, hands the prompt ids to the
  backend's :meth:`~AsyncPolicyMixin._submit_ids` and returns a future of the usual output tensordict. The default
  :meth:`~AsyncPolicyMixin._submit_ids` is a batching queue (:class:`chatenv.rollout.batching.Batcher`): requests
  waiting when the model is free, or arriving within ``batch_window`` seconds, go through one batched
  ``_generate_ids`` on a worker thread (the transformers backend, and vLLM's synchronous ``LLM``). vLLM's async
  engine overrides it and submits every request to the engine on its own (continuous batching).
  :meth:`~AsyncPolicyMixin.agenerate` is the same as a coroutine.
- :attr:`~AsyncPolicyMixin.version` counts weight updates (0 at construction); :meth:`~AsyncPolicyMixin.update_weights`
  loads a state dict into the model (backend hook ``_load_weights``) and bumps it. Policies made from one another
  (:meth:`~wrappers.policies.base.LLMWrapperBase.get_new_version`) share the model, so they share the version.
  Every output of :meth:`submit` holds the version of the weights that generated it
  (:data:`chatenv.protocols.VERSION_KEY`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from tensordict import TensorDictBase

from chatenv.protocols import VERSION_KEY
from chatenv.rollout.batching import Batcher

__all__ = ["AsyncPolicyMixin", "Weights", "check_state_dict", "gather", "then"]


class Weights:
    """The version of one model's weights, shared by every policy on that model.

    ``lock`` keeps a weight update and a batched generation apart: a batch runs on one version of the weights.

    Attributes:
        version: The number of updates so far.
        lock: Held while generating a batch and while loading weights.
    """

    def __init__(self) -> None:
        self.version = 0
        self.lock = threading.RLock()


class AsyncPolicyMixin:
    """Adds :meth:`submit`, :meth:`agenerate`, :attr:`version` and :meth:`update_weights` to a policy backend.

    Backends call :meth:`_init_async` when they attach to a model (with the :class:`Weights` of the policy they were
    made from, if any) and implement ``_load_weights(state_dict)``.
    """

    #: seconds the batching queue waits for more requests after the first of a batch (read at the first submit)
    batch_window: float = 0.005
    #: most requests per batched generation (None: no limit)
    max_batch: int | None = None

    def _init_async(self, weights: Weights | None = None) -> None:
        self._weights = weights if weights is not None else Weights()
        self._batcher: Batcher | None = None
        self._batcher_lock = threading.Lock()
        self._io_lock = threading.RLock()  # tokenizer work (reading inputs, building outputs) one thread at a time

    @property
    def version(self) -> int:
        """The version of the weights now in use: 0 at construction, +1 per :meth:`update_weights`."""
        return self._weights.version

    def update_weights(self, state_dict: Mapping[str, Any]) -> int:
        """Load new weights into the model; replies generated from now on use them.

        Args:
            state_dict: Parameter name -> tensor, as ``model.state_dict()`` names them (Hugging Face checkpoint
                names).

        Returns:
            The new :attr:`version`.

        Raises:
            TypeError: If ``state_dict`` is not a mapping of tensors.
            NotImplementedError: If the backend cannot load weights while running.
        """
        if not isinstance(state_dict, Mapping) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
            raise TypeError(f"update_weights takes a state dict (name -> tensor), got {type(state_dict).__name__}")
        if not state_dict:
            raise ValueError("update_weights got an empty state dict")
        with self._weights.lock:
            self._load_weights(state_dict)
            self._weights.version += 1
            return self._weights.version

    @contextlib.contextmanager
    def updating_weights(self) -> Iterator[None]:
        """Change the model's weights in place (e.g. an optimizer step on this policy's own model) as one update.

        No batched generation runs while the block does, and :attr:`version` goes up by one when it ends without
        an exception, so the replies sampled after it are told apart from those before.
        """
        with self._weights.lock:
            yield
            self._weights.version += 1

    def _load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot load new weights")

    # ------------------------------------------------------------------------------------ requests

    def submit(self, tensordict: TensorDictBase, *, seed_key: int | None = None) -> Future:
        """Queue a generation for every row of ``tensordict`` (batch ``()`` or ``(B,)``); returns at once.

        Args:
            tensordict: The policy's input, as for calling the policy.
            seed_key: An int naming the request within a run (rollouts pass one per episode turn); backends that
                seed each request (vLLM) derive its sampling seed from the settings' seed and this key, so the sample
                does not depend on what else is running. The batching queue seeds each batch instead (reproducible
                for the same batches).

        Returns:
            A future of the output: the layout ``policy(tensordict)`` returns, plus ``policy_version`` (``(B,)``
            int64, the version of the weights that generated each row).

        Raises:
            ValueError: For a scoring policy, ``num_samples``, or an input the policy cannot read (raised here, before
                anything is queued).
        """
        if not self.generate:
            raise ValueError("submit() generates; this policy scores (generate=False)")
        if self.num_samples is not None:
            raise ValueError("submit() takes one reply per row; use a policy without num_samples")
        if tensordict.batch_dims > 1:
            raise ValueError(f"expected a tensordict of batch shape () or (B,), got {tuple(tensordict.batch_size)}")
        single = tensordict.batch_dims == 0
        with self._io_lock:
            rows = self._rows(tensordict.unsqueeze(0) if single else tensordict)
        inner = self._submit_ids([r.ids for r in rows], self.settings, seed_key)
        outer: Future = Future()

        def finish(f: Future) -> None:
            try:
                samples, versions = f.result()
                outer.set_result(self._async_output(tensordict, single, rows, samples, versions))
            except BaseException as e:  # handed to the caller through the future
                outer.set_exception(e)

        inner.add_done_callback(finish)
        return outer

    async def agenerate(self, tensordict: TensorDictBase, *, seed_key: int | None = None) -> TensorDictBase:
        """:meth:`submit` as a coroutine: the output tensordict once the reply is ready."""
        return await asyncio.wrap_future(self.submit(tensordict, seed_key=seed_key))

    def _async_output(
        self, tensordict: TensorDictBase, single: bool, rows: list, samples: list, versions: list[int]
    ) -> TensorDictBase:
        """The output of a submitted request, written as ``forward`` writes it (``inplace`` respected)."""
        with self._io_lock:
            _, outputs = self._writer.generated(rows, samples)
        if self.inplace is True:
            target = tensordict
        elif self.inplace == "empty":
            target = tensordict.empty()
        else:
            target = tensordict.copy()
        if single:
            outputs = {k: v[0] for k, v in outputs.items()}
        stamp = torch.tensor(versions, dtype=torch.long)
        outputs[VERSION_KEY] = stamp[0] if single else stamp
        for key, value in outputs.items():
            target.set(key, value)
        return target

    def _submit_ids(self, prompts: list[list[int]], settings: Any, seed_key: int | None) -> Future:
        """A future of ``(samples per prompt, version per prompt)``; default: through the batching queue."""
        futures = [self._queue().submit(p) for p in prompts]
        if len(futures) == 1:
            return futures[0]
        return gather(futures)

    def _queue(self) -> Batcher:
        with self._batcher_lock:
            if self._batcher is None:
                self._batcher = Batcher(
                    self._run_batch, max_batch=self.max_batch, window=self.batch_window, name="chatenv-generate"
                )
            return self._batcher

    def _run_batch(self, prompts: list[list[int]]) -> list[tuple[list, list[int]]]:
        """One batched generation of queued prompts, on one version of the weights."""
        with self._weights.lock:
            version = self._weights.version
            samples = self._generate_ids(prompts, self.settings)
            self._generation_calls += 1
        return [([s], [version]) for s in samples]

    def close_async(self) -> None:
        """Stop this policy's batching thread (it starts again on the next :meth:`submit`)."""
        with self._batcher_lock:
            if self._batcher is not None:
                self._batcher.close()
                self._batcher = None


def then(future: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of ``fn(future.result())`` (``fn`` runs in the thread that completes ``future``)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # handed on through the new future
            out.set_exception(e)

    future.add_done_callback(done)
    return out


def gather(futures: list[Future]) -> Future:
    """One future of ``(samples, versions)`` over per-prompt futures of the same."""
    out: Future = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            parts = [f.result() for f in futures]
            out.set_result(([s for p in parts for s in p[0]], [v for p in parts for v in p[1]]))
        except BaseException as e:  # the first failure fails the request
            out.set_exception(e)

    for f in futures:
        f.add_done_callback(one_done)
    return out


def check_state_dict(state_dict: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor]) -> None:
    """Refuse names the model does not have and shapes that differ from its own, before anything is loaded.

    Raises:
        KeyError: Naming up to five unknown parameter names.
        ValueError: Naming the first parameter whose shape differs.
    """
    unknown = [k for k in state_dict if k not in own]
    if unknown:
        raise KeyError(f"the model has no parameters named {unknown[:5]} ({len(unknown)} unknown names in all)")
    for k, v in state_dict.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ValueError(f"{k} has shape {tuple(v.shape)}; the model's is {tuple(own[k].shape)}")
