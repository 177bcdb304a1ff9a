"""The asynchronous collection loop: each episode's next request goes out the moment its previous step returns.

:class:`AsyncCollector` shares the synchronous :class:`~chatenv.rollout.collect.Collector`'s budget, slots,
transitions and bookkeeping (:meth:`~chatenv.rollout.collect.Collector.record`); only the scheduling differs. Every
env goes through the same three stages, each a :class:`~concurrent.futures.Future`, independently of the others:

1. **reply**: ``policy.submit(input)`` (an :class:`~chatenv.protocols.AsyncRolloutPolicy`): the backend batches
   whatever requests are waiting (continuous batching on vLLM's async engine);
2. **reference** (envs with a KL wrapper's reference model, or ``ref_model=``): the reply joins the reference's
   batching queue (:class:`~chatenv.rollout.batching.Batcher`), scored in batches as they fill by
   :func:`~chatenv.actions.attach_ref_log_probs`;
3. **step**: the env steps on a worker thread (:meth:`~chatenv.rollout.pools.ListPool.submit`); a slow reward holds
   up its own env only, while the engine keeps generating for the others.

The main thread only waits for the next finished future and moves that env on, so all bookkeeping happens in one
thread. When several futures finish together they are handled in the order they were submitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

from chatenv.actions import ScoredAction, attach_ref_log_probs
from chatenv.rollout.batching import Batcher
from chatenv.rollout.collect import Budget, Collector, PolicyRow, Transition, action_of, policy_rows
from chatenv.rollout.pools import EnvPool, ListPool

__all__ = ["AsyncCollector", "seed_key"]


def seed_key(episode: int, turn: int) -> int:
    """The request key of an episode's turn (what ``policy.submit(..., seed_key=...)`` gets)."""
    return (episode << 20) + turn


@dataclass
class _Job:
    """What one env is waiting for."""

    stage: str  # "reply" | "reference" | "step"
    env: int
    order: int
    row: PolicyRow | None = None
    deadline: float | None = None


def _row(job: _Job) -> PolicyRow:
    """The policy row a reference or step job carries."""
    if job.row is None:
        raise RuntimeError(f"a {job.stage} job of env {job.env} without its policy row")
    return job.row


class AsyncCollector(Collector):
    """One asynchronous collection over a list of envs (see the module docstring).

    Args:
        pool: A :class:`~chatenv.rollout.pools.ListPool` (envs step one at a time, on worker threads).
        policy: An :class:`~chatenv.protocols.AsyncRolloutPolicy`.
        budget: What to collect.
        ref_model: A reference scorer for every env, or None (then the envs' own shared references are used).
        on_episode: Called with each finished episode's transitions.
        ref_window: Seconds a reference batch waits for more replies once it has one.

    Raises:
        ValueError: For a pool that cannot step envs one at a time (a vector env).
    """

    def __init__(
        self,
        pool: EnvPool,
        policy: Any,
        budget: Budget,
        ref_model: Any,
        on_episode: Callable[[list[Transition]], None] | None = None,
        *,
        ref_window: float = 0.005,
    ):
        if not isinstance(pool, ListPool):
            raise ValueError(
                "mode='async' steps each env on its own; a Gymnasium vector env steps all its sub-envs together. "
                "Pass a list of envs, or use mode='sync'"
            )
        super().__init__(pool, policy, budget, ref_model, on_episode)
        self.pool: ListPool = pool
        self.jobs: dict[Future[Any], _Job] = {}
        self.parked: list[int] = []
        self._order = 0
        every = list(range(pool.n))
        groups = [(ref_model, every)] if ref_model is not None else pool.reference_groups(every)
        self.references: dict[int, Batcher] = {}
        for ref, indices in groups:
            batcher = Batcher(_scorer(ref), window=ref_window, name="chatenv-reference")
            self.references.update(dict.fromkeys(indices, batcher))

    # ------------------------------------------------------------------------------------ stages

    def _add(self, future: Future[Any], job: _Job) -> None:
        self._order += 1
        job.order = self._order
        self.jobs[future] = job

    def request(self, i: int) -> None:
        """Submit env ``i``'s next reply (or park the env while the step budget is spoken for)."""
        if self.budget.steps is not None and len(self.transitions) + len(self.jobs) >= self.budget.steps:
            self.parked.append(i)
            return
        slot = self.slots[i]
        future = self.policy.submit(self.policy_input([i]), seed_key=seed_key(slot.episode, slot.turn))
        self._add(future, _Job("reply", i, 0))

    def _step(self, i: int, row: PolicyRow, action: ScoredAction) -> None:
        timeout = self.pool.step_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        self._add(self.pool.submit(i, action), _Job("step", i, 0, row, deadline))

    def _handle(self, job: _Job, future: Future[Any]) -> None:
        """Move env ``job.env`` on by one stage (``future`` is done; its error is raised here)."""
        i = job.env
        if job.stage == "reply":
            row = policy_rows(future.result(), self.policy, 1)[0]
            action = action_of(row)
            batcher = self.references.get(i)
            if batcher is None:
                self._step(i, row, action)
            else:
                self._add(batcher.submit(action), _Job("reference", i, 0, row))
        elif job.stage == "reference":
            self._step(i, _row(job), future.result())
        else:
            self.record(i, _row(job), future.result())
            if self.slots[i].active:
                self.request(i)
            parked, self.parked = self.parked, []
            for j in parked:
                self.request(j)

    # ------------------------------------------------------------------------------------ the loop

    def _next_deadline(self) -> float | None:
        deadlines = [j.deadline for j in self.jobs.values() if j.deadline is not None]
        return None if not deadlines else max(0.0, min(deadlines) - time.monotonic())

    def _wait_once(self) -> None:
        done, _ = wait(list(self.jobs), timeout=self._next_deadline(), return_when=FIRST_COMPLETED)
        if not done:
            now = time.monotonic()
            stuck = [j.env for j in self.jobs.values() if j.deadline is not None and j.deadline <= now]
            if stuck:
                raise self.pool.timeout_error(sorted(stuck))
            return
        for future in sorted(done, key=lambda f: self.jobs[f].order):
            self._handle(self.jobs.pop(future), future)

    def run(self, seed: int | None) -> None:
        """Collect until the budget is spent (or no env can go on)."""
        try:
            self.open(seed)
        except BaseException:
            self._close_references()
            raise
        self.drive()

    def drive(self) -> None:
        """Collect for the episodes begun (and those started as they end) until the budget is spent."""
        try:
            for i, slot in enumerate(self.slots):
                if slot.active:
                    self.request(i)
            while self.jobs and not self.budget.done(len(self.transitions)):
                self._wait_once()
        except BaseException as e:
            self._settle(wait_for_steps=not isinstance(e, KeyboardInterrupt))
            raise
        finally:
            self._close_references()

    def _close_references(self) -> None:
        for batcher in set(self.references.values()):
            batcher.close()

    def _settle(self, wait_for_steps: bool) -> None:
        """After a failure: keep the steps that commit (they are in their envs), waiting up to their deadlines."""
        for future, job in sorted(self.jobs.items(), key=lambda fj: fj[1].order):
            if job.stage != "step":
                continue
            if wait_for_steps and not future.done():
                left = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
                wait([future], timeout=left)
            if future.done() and future.exception() is None:
                self.keep(job.env, _row(job), future.result())
        self.jobs.clear()


def _scorer(ref: Any) -> Callable[[list[ScoredAction]], list[ScoredAction]]:
    """A batch function scoring replies with ``ref`` (one forward per batch), returning the scored actions."""

    def score(actions: list[ScoredAction]) -> list[ScoredAction]:
        attach_ref_log_probs(ref, actions)
        return actions

    return score
