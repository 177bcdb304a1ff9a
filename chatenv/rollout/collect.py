"""The collection loop: one policy call per round for every env mid-episode, then one step of each."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from chatenv.actions import ScoredAction, attach_ref_log_probs
from chatenv.modes import ViewRow, get_mode
from chatenv.protocols import VERSION_KEY, layout_of
from chatenv.rollout.plan import EpisodePlan
from chatenv.rollout.pools import EnvPool, StepResult

__all__ = ["VERSION_KEY", "Budget", "Collector", "PolicyRow", "Transition", "action_of", "policy_rows"]


@dataclass
class PolicyRow:
    """One row of a policy's output, unpadded: the prompt and the generated reply with their masks and log-probs."""

    prompt: torch.Tensor  # (P,) int64
    response: torch.Tensor  # (R,) int64
    assistant: torch.Tensor | None  # (P + R,) bool
    log_probs: tuple[torch.Tensor, torch.Tensor] | None  # (P,), (R,) float32
    view: ViewRow = field(default_factory=ViewRow)
    version: int | None = None  # the policy version that generated the reply, if the policy reports one


@dataclass
class Transition:
    """One step of one env: the policy's row and the env's answer."""

    episode: int
    turn: int
    env_index: int
    row: PolicyRow
    result: StepResult
    group: int = 0


@dataclass
class Budget(EpisodePlan):
    """An :class:`~chatenv.rollout.plan.EpisodePlan` being collected: the plan and the episodes started and finished.

    Attributes:
        started: Episodes started so far.
        finished: Episodes finished so far.
    """

    started: int = 0
    finished: int = 0

    @classmethod
    def of(cls, plan: EpisodePlan) -> Budget:
        """A fresh budget for ``plan``."""
        return cls(**{f.name: getattr(plan, f.name) for f in fields(EpisodePlan)})

    def may_start(self) -> bool:
        """Whether another episode may start."""
        return self.episodes is None or self.started < self.episodes

    def done(self, collected: int) -> bool:
        """Whether collection is complete."""
        if self.steps is not None:
            return collected >= self.steps
        return self.finished >= (self.episodes or 0)


@dataclass
class _Slot:
    """One env's episode in progress."""

    obs: Any = None
    episode: int = -1
    turn: int = 0
    active: bool = False


def policy_rows(out: Any, policy: Any, n: int) -> list[PolicyRow]:
    """Unpack a ``(n,)`` policy output into rows, each container once (``policy``: a policy or its layout)."""
    layout = layout_of(policy)
    tokens = out.get(layout.tokens_key)
    prompts, responses = tokens.unpadded("prompt"), tokens.unpadded("response")
    masks = out.get(layout.masks_key, None) if layout.masks_key is not None else None
    assistant = masks.unpadded() if masks is not None else [None] * n
    lps = out.get(layout.log_probs_key, None) if layout.log_probs_key is not None else None
    lp_rows = list(zip(lps.unpadded("prompt"), lps.unpadded("response"))) if lps is not None else [None] * n
    views = [ViewRow() for _ in range(n)]
    text = out.get(layout.text_key, None) if layout.text_key is not None else None
    if text is not None:
        for v, p, r in zip(views, text.prompt, text.response):
            v.prompt_text, v.response_text = p, r
    history = out.get(layout.history_key, None) if layout.history_key is not None else None
    if history is not None:
        for v, p, r in zip(views, history.prompt.to_chats(), history.response.to_chats()):
            v.prompt_chat, v.reply = [m for m in p if m], [m for m in r if m]
    rows = [PolicyRow(*fields) for fields in zip(prompts, responses, assistant, lp_rows, views)]
    for row, version in zip(rows, _versions(out, policy, n)):
        row.version = version
    return rows


def _versions(out: Any, policy: Any, n: int) -> list[int | None]:
    """Per row, the policy version: the output's ``policy_version`` entry, else the policy's ``version``."""
    stamped = out.get(VERSION_KEY, None) if hasattr(out, "get") else None
    if stamped is not None:
        return [int(v) for v in torch.as_tensor(stamped).reshape(-1).tolist()]
    version = getattr(policy, "version", None)
    return [None if version is None else int(version)] * n


def action_of(row: PolicyRow) -> ScoredAction:
    """The env action of a policy row: its reply ids with their log-probs and the prompt ids (for reference models)."""
    lp = row.log_probs[1].numpy() if row.log_probs is not None else None
    return ScoredAction(row.response.numpy(), lp, prompt_ids=row.prompt.numpy())


class Collector:
    """One collection: slots per env, the budget, and the transitions so far (kept when something fails)."""

    def __init__(
        self,
        pool: EnvPool,
        policy: Any,
        budget: Budget,
        ref_model: Any,
        on_episode: Callable[[list[Transition]], None] | None = None,
    ):
        self.pool, self.policy, self.budget, self.ref_model = pool, policy, budget, ref_model
        self.on_episode = on_episode
        #: called as ``on_turn(env, episode, turn)`` when an episode goes on to its turn ``turn`` (between steps)
        self.on_turn: Callable[[Any, int, int], None] | None = None
        self.mode = get_mode(pool.input_mode)
        self.slots = [_Slot() for _ in range(pool.n)]
        self.transitions: list[Transition] = []

    def begin(self, i: int, obs: Any) -> None:
        """Start tracking an episode in env ``i`` (if the budget allows another)."""
        if not self.budget.may_start():
            self.slots[i].active = False
            return
        self.slots[i] = _Slot(obs=obs, episode=self.budget.started, active=True)
        self.budget.started += 1

    def start(self, i: int) -> None:
        """Reset env ``i`` for the next episode as planned (its seed and options) and track it."""
        if not self.budget.may_start():
            self.slots[i].active = False
            return
        seed, options = self.budget.reset_of(self.budget.started)
        self.begin(i, self.pool.restart(i, seed=seed, options=options))

    def active(self) -> list[int]:
        """The envs mid-episode that get a reply this round."""
        idx = [i for i, s in enumerate(self.slots) if s.active]
        if self.budget.steps is not None:
            idx = idx[: self.budget.steps - len(self.transitions)]
        return idx

    def round(self, active: list[int]) -> None:
        """One policy call for ``active`` envs, one step each, bookkeeping."""
        rows = policy_rows(self.policy(self.policy_input(active)), self.policy, len(active))
        actions = {i: action_of(row) for i, row in zip(active, rows)}
        self.score_reference(active, actions)
        try:
            results, started = self.pool.step(actions)
        except BaseException as e:
            # the envs that did step have committed their turn: keep those transitions before giving up
            done = getattr(e, "completed", {})
            for i, row in zip(active, rows):
                if i in done:
                    self.keep(i, row, done[i])
            raise
        for i, row in zip(active, rows):
            self.record(i, row, results[i])
        for i, obs in started.items():
            if not self.slots[i].active:
                self.begin(i, obs)

    def policy_input(self, indices: list[int]) -> Any:
        """The policy's input tensordict for the envs at ``indices`` (their observations and token views)."""
        return self.mode.policy_input(
            [self.slots[i].obs for i in indices],
            input_key=self.policy.input_key,
            pad_token_id=self.policy.pad_token_id,
            token_views=self.pool.token_views(indices),
            tokens_key=self.policy.tokens_key,
            masks_key=self.policy.masks_key,
        )

    def keep(self, i: int, row: PolicyRow, result: StepResult) -> None:
        """Keep env ``i``'s transition (its slot's episode and turn) without moving the slot on."""
        slot = self.slots[i]
        group = self.budget.group(slot.episode)
        self.transitions.append(Transition(slot.episode, slot.turn, self.pool.origin(i), row, result, group))

    def score_reference(self, active: list[int], actions: dict[int, ScoredAction]) -> None:
        """One batched reference forward per shared reference model for this round's replies."""
        groups = [(self.ref_model, active)] if self.ref_model is not None else self.pool.reference_groups(active)
        for ref, indices in groups:
            attach_ref_log_probs(ref, [actions[i] for i in indices])

    def record(self, i: int, row: PolicyRow, result: StepResult) -> None:
        """Keep a transition and move env ``i``'s slot on (next turn, or a new episode)."""
        slot = self.slots[i]
        self.keep(i, row, result)
        if result.done:
            self.budget.finished += 1
            slot.active = False
            if self.on_episode is not None:
                self.on_episode(
                    sorted((t for t in self.transitions if t.episode == slot.episode), key=lambda t: t.turn)
                )
            if self.budget.planned:
                self.start(i)
            elif self.budget.may_start():
                obs = self.pool.restart(i)
                if obs is not None:
                    self.begin(i, obs)
            return
        slot.obs = result.obs
        slot.turn += 1
        if self.on_turn is not None:
            self.on_turn(self.pool.env(i), slot.episode, slot.turn)

    def open(self, seed: int | None) -> None:
        """Start the first episodes: as planned (seeds and options per episode), else the envs' own resets."""
        if self.budget.planned:
            for i in range(self.pool.n):
                self.start(i)
        else:
            for i, obs in self.pool.reset(seed, self.budget.episodes).items():
                self.begin(i, obs)

    def run(self, seed: int | None) -> None:
        """Collect until the budget is spent (or no env can go on)."""
        self.open(seed)
        self.drive()

    def drive(self) -> None:
        """Run rounds for the episodes begun until the budget is spent (or no env can go on)."""
        while not self.budget.done(len(self.transitions)):
            active = self.active()
            if active:
                self.round(active)
            elif self.pool.pending() and self.budget.may_start():
                # envs that start their next episode on their next step: take it (no replies needed)
                for i, obs in self.pool.step({})[1].items():
                    self.begin(i, obs)
            else:
                break

    def collected(self) -> list[Transition]:
        """The transitions so far, by episode then turn."""
        return sorted(self.transitions, key=lambda t: (t.episode, t.turn))
