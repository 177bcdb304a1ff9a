"""The policy behind the endpoint: requests batched into policy calls on one worker thread.

Any object with the policy interface (:class:`~chatenv.protocols.ServedPolicy`; ``wrappers.policies`` wrappers
have it) can serve. Every request is generated after exactly the ids of its session's segment: the ids go to the
policy as the env's token view (:meth:`chatenv.modes.InputMode.policy_input`), in whichever input mode the policy
has, as :func:`chatenv.rollout` does; the replies are read back with :func:`chatenv.rollout.collect.policy_rows`.

Requests that arrive within ``batch_wait`` of each other, or while the policy is busy, are batched (the library's
one batching queue, :class:`~chatenv.rollout.batching.Batcher`): the worker calls the policy once per group of
equal settings (``policy.get_new_version(generate_kwargs=...)``, cached). A request with a seed
gets its own call and a fresh policy version, so the same seed and prompt give the same replies. If a batched call
fails, its jobs are retried one by one, so one bad request cannot fail the others.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from chatenv.modes import get_mode
from chatenv.rollout.batching import Batcher
from chatenv.rollout.collect import policy_rows
from chatenv.serve.errors import APIError

__all__ = ["Generated", "Job", "PolicyRunner", "check_policy"]


@dataclass
class Generated:
    """One generated reply: its ids, their log-probs (NaN where none) and the policy version that produced it.

    With ``top_logprobs``, ``top`` holds the most likely tokens at each step (``(id, log-prob)``, most likely first).
    """

    ids: list[int]
    log_probs: list[float]
    version: int | None = None
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class Job:
    """A request's generation: ``n`` replies after ``ids``.

    Attributes:
        ids: The prompt (the session segment's ids).
        mask: Its assistant mask.
        messages: The request's messages (the observation of a history-mode policy).
        n: Replies to generate.
        generate_kwargs: Generation settings (the policy's names), ``max_new_tokens`` included.
        seed: Sampling seed, or None.
        on_delta: Called from the worker thread with ``(reply index, new ids, their log-probs or None)`` as the
            replies are generated (policies with a ``stream`` method stream; others hand each reply on at its end).
    """

    ids: list[int]
    mask: list[bool]
    messages: list[dict[str, Any]]
    n: int
    generate_kwargs: dict[str, Any]
    seed: int | None = None
    on_delta: Callable[[int, list[int], list[float] | None], None] | None = None
    delivered: bool = False  # some of its tokens were handed on (a failed batch cannot be retried for it)

    def key(self) -> Any:
        """Jobs with equal keys share a policy call (a seeded job shares with none)."""
        if self.seed is not None:
            return ("seeded", id(self))
        return tuple(sorted((k, _hashable(v)) for k, v in self.generate_kwargs.items()))


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def check_policy(policy: Any) -> None:
    """Refuse what cannot serve: a scoring policy, one with ``num_samples``, or one lacking the policy interface.

    Raises:
        TypeError: For a missing attribute (named).
        ValueError: For a scoring policy or one with ``num_samples``.
    """
    needed = ("input_mode", "input_key", "pad_token_id", "tokens_key", "masks_key", "log_probs_key", "tokenizer")
    missing = [name for name in needed if not hasattr(policy, name)]
    if missing or not callable(policy):
        raise TypeError(f"the policy lacks the policy interface (missing {missing or ['__call__']})")
    if not getattr(policy, "generate", False):
        raise ValueError("the endpoint needs a generating policy (generate=True)")
    if getattr(policy, "num_samples", None) is not None:
        raise ValueError("serve a policy without num_samples: requests ask for 'n' replies themselves")


class PolicyRunner:
    """Runs generation jobs on one worker thread, batching the jobs that wait with equal settings.

    Args:
        policy: The policy (see :func:`check_policy`).
        max_batch: Most rows (prompts x ``n``) per policy call.
        cache_size: Policy versions kept for request settings seen before.
        batch_wait: Seconds the worker waits, once a job arrived, for more jobs to batch with it (requests sent
            at once by concurrent agents arrive a few milliseconds apart).
    """

    def __init__(self, policy: Any, *, max_batch: int = 32, cache_size: int = 16, batch_wait: float = 0.02):
        check_policy(policy)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        self.policy = policy
        self.max_batch = max_batch
        self.cache_size = cache_size
        self.batch_wait = float(batch_wait)
        self.calls = 0
        self._versions: OrderedDict[Any, Any] = OrderedDict()
        self._batcher: Batcher | None = None
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------------------------------------ submitting

    async def generate(self, job: Job) -> list[Generated]:
        """Generate a job's replies (awaitable from the server's event loop).

        Raises:
            APIError: If the policy refused or failed this job (the other jobs of its batch are unaffected).
        """
        result = await asyncio.wrap_future(self._queue().submit(job))
        if isinstance(result, APIError):
            raise result
        generated: list[Generated] = result
        return generated

    def generate_now(self, job: Job) -> list[Generated]:
        """Generate a job's replies on the calling thread (no batching; for benchmarks and tests)."""
        return self._call([job])[0]

    def close(self) -> None:
        """Stop the worker thread once the queued jobs are run."""
        with self._start_lock:
            if self._batcher is not None:
                self._batcher.close()
                self._batcher = None

    def _queue(self) -> Batcher:
        """The batching queue (the library's one: :class:`chatenv.rollout.batching.Batcher`), started on first use."""
        with self._start_lock:
            if self._batcher is None:
                self._batcher = Batcher(
                    self._run_jobs, max_batch=self.max_batch, window=self.batch_wait, name="chatenv-serve-policy"
                )
            return self._batcher

    # ------------------------------------------------------------------------------------------ the worker

    def _run_jobs(self, jobs: list[Job]) -> list[Any]:
        """One batch: per job, its replies or the :class:`APIError` that refused it (jobs grouped by settings)."""
        results: dict[int, Any] = {}
        for group in self._groups(jobs):
            self._run_group(group, results)
        return [results[id(job)] for job in jobs]

    def _groups(self, jobs: list[Job]) -> list[list[Job]]:
        """Jobs by settings, in arrival order, each group at most ``max_batch`` rows."""
        groups: dict[Any, list[list[Job]]] = {}
        for job in jobs:
            chunks = groups.setdefault(job.key(), [[]])
            if chunks[-1] and sum(j.n for j in chunks[-1]) + job.n > self.max_batch:
                chunks.append([])
            chunks[-1].append(job)
        return [chunk for chunks in groups.values() for chunk in chunks]

    def _run_group(self, group: list[Job], results: dict[int, Any]) -> None:
        try:
            replies = self._call(group)
        except Exception as e:
            if len(group) > 1:  # find the job at fault: the others still get their replies
                for job in group:
                    if job.delivered:  # its client has tokens of this attempt: it gets the error
                        results[id(job)] = _api_error(e)
                    else:
                        self._run_group([job], results)
                return
            results[id(group[0])] = _api_error(e)
            return
        for job, reply in zip(group, replies):
            results[id(job)] = reply
            if job.on_delta is not None and not job.delivered:  # a policy that cannot stream: whole replies
                for k, g in enumerate(reply):
                    job.on_delta(k, list(g.ids), list(g.log_probs))

    def _call(self, group: list[Job]) -> list[list[Generated]]:
        """One policy call for every row of ``group``; the replies per job."""
        policy = self._version(group[0])
        mode = get_mode(policy.input_mode)
        rows = [job for job in group for _ in range(job.n)]
        td = mode.policy_input(
            [_observation(mode.name, job, policy) for job in rows],
            input_key=policy.input_key,
            pad_token_id=policy.pad_token_id,
            token_views=[(np.asarray(j.ids, dtype=np.int64), np.asarray(j.mask, dtype=bool)) for j in rows],
            tokens_key=policy.tokens_key,
            masks_key=policy.masks_key,
        )
        out = self._generate(policy, td, rows, [k for job in group for k in range(job.n)])
        self.calls += 1
        generated = [_generated(row) for row in policy_rows(out, policy, len(rows))]
        _attach_top(out, generated)
        results, k = [], 0
        for job in group:
            results.append(generated[k : k + job.n])
            k += job.n
        return results

    @staticmethod
    def _generate(policy: Any, td: Any, rows: list[Job], replies: list[int]) -> Any:
        """The policy's output for ``td``; streamed to the rows' jobs that take new tokens, if the policy streams."""
        if not any(job.on_delta for job in rows) or not callable(getattr(policy, "stream", None)):
            return policy(td)
        stream = policy.stream(td)
        for delta in stream:
            job = rows[delta.row]
            if job.on_delta is not None:
                job.delivered = True
                job.on_delta(
                    replies[delta.row], list(delta.ids), None if delta.log_probs is None else list(delta.log_probs)
                )
        return stream.result()

    def _version(self, job: Job) -> Any:
        """The policy with the job's settings (cached per settings; a fresh one for a seeded job)."""
        kwargs = dict(job.generate_kwargs)
        if job.seed is not None:
            kwargs["seed"] = job.seed
        if not kwargs:
            return self.policy
        key = job.key()
        if key in self._versions:
            self._versions.move_to_end(key)
            return self._versions[key]
        if not callable(getattr(self.policy, "get_new_version", None)):
            raise APIError(
                f"this policy takes no per-request settings (got {sorted(kwargs)})", code="unsupported_parameter"
            )
        version = self.policy.get_new_version(generate_kwargs=kwargs)
        if job.seed is None:
            self._versions[key] = version
            while len(self._versions) > self.cache_size:
                self._versions.popitem(last=False)
        return version


def _observation(mode: str, job: Job, policy: Any) -> Any:
    """A job's prompt as the policy's input mode reads it (the token view rides along)."""
    if mode == "tokens":
        return np.asarray(job.ids, dtype=np.int64)
    if mode == "history":
        return job.messages
    ct = getattr(policy, "chat_tokenizer", None)
    if ct is None:
        from chatenv.tokenization import chat_tokenizer

        ct = chat_tokenizer(policy.tokenizer, getattr(policy, "template", None))
    return ct.decode(job.ids)


def _generated(row: Any) -> Generated:
    ids = row.response.tolist()
    lps = row.log_probs[1].tolist() if row.log_probs is not None else [math.nan] * len(ids)
    return Generated(ids, [float(v) for v in lps], row.version)


def _attach_top(out: Any, generated: list[Generated]) -> None:
    """The policy output's top log-probs (``top_log_probs``: ``ids`` and ``log_probs``, padded) on each reply."""
    top = out.get("top_log_probs", None) if hasattr(out, "get") else None
    if top is None:
        return
    ids = top["ids"].reshape(len(generated), -1, top["ids"].shape[-1]).tolist()
    lps = top["log_probs"].reshape(len(generated), -1, top["ids"].shape[-1]).tolist()
    for g, row_ids, row_lps in zip(generated, ids, lps):
        g.top = [
            [(int(i), float(v)) for i, v in zip(step_ids, step_lps) if i >= 0]
            for step_ids, step_lps in zip(row_ids[: len(g.ids)], row_lps[: len(g.ids)])
        ]


def _api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, TypeError)):
        return APIError(f"the policy refused the request: {e}")
    return APIError(f"the policy failed: {type(e).__name__}: {e}", status=500, type="server_error")
