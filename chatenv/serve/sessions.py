"""Per-session, token-exact trajectories of the requests an agent sends to the capture endpoint.

A :class:`Session` holds one or more :class:`Segment` objects. A segment is one token-in/token-out (TITO) sequence
(an :class:`~chatenv.envs.state.EpisodeState`, the state an env's episode keeps too): its ids are the rendering of
the first request's messages, then, per later request, the reply the model generated (verbatim ids) and only the
new messages' tokens (:meth:`~chatenv.tokenization.ChatTokenizer.continuation`), never a re-rendering. A request
*extends* a segment when its messages are the segment's messages, then one of the replies returned for the
segment's previous request (compared semantically, :func:`~chatenv.serve.messages.message_key`), then new messages,
with the same tools.

A session holds any number of open segments, found by their opening message (an index), so concurrent episodes sent
through one session URL (harnesses that cannot set a header per sample) each continue their own segment, and
requests of one session run concurrently. The rule when a request could continue several segments: the one whose
recorded chat covers the most of the request's messages; among those, one no other request is extending right now,
the most recently extended first. A request that continues a segment another request is extending at that moment
(a retry, or another of its ``n`` replies) continues a *fork* of it: a new segment with a copy of its ids, so both
stay token-exact and whole. A request that extends no segment starts a new one (counted in ``divergences`` when the
session had segments: a new episode, or an agent that rewrote its history).

A reply sent back without its leading reasoning block or re-spaced (agents often drop the model's reasoning from the
history they send) still extends the segment from its recorded ids, and counts as ``restored``; any other change (the
agent rewrote, trimmed or reordered its history, or changed its tools) starts a new segment.

The assistant mask is True on generated ids only (each reply and its end-of-turn id); log-probs are the policy's
generation log-probs there and NaN elsewhere. A request is planned first (:meth:`Session.plan`, nothing changes),
claims its segment (:meth:`Session.claim`) and is committed after generation succeeded (:meth:`Session.commit`), or
releases the claim (:meth:`Session.release`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
from dataclasses import dataclass
from typing import Any

from chatenv.envs.state import EpisodeState, Extension
from chatenv.serve.errors import APIError
from chatenv.serve.messages import message_key, sent_back, tools_key
from chatenv.tokenization import ChatTokenizer

__all__ = ["Choice", "Plan", "Segment", "Session"]


@dataclass
class Choice:
    """One generated reply.

    Attributes:
        ids: The generated ids, verbatim (the end-of-turn id included when the model produced it).
        log_probs: Their generation log-probs (NaN where the policy reported none).
        message: The assistant message as the endpoint returned it (chatenv form: arguments as dicts).
        complete: Whether the model ended its turn (an end-of-turn id), rather than being cut.
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        version: The policy version that generated it, if the policy reports one.
        stop_string: The request's stop string that ended it, if one did.
    """

    ids: list[int]
    log_probs: list[float]
    message: dict[str, Any]
    complete: bool
    finish_reason: str
    version: int | None = None
    stop_string: str | None = None


@dataclass
class Turn:
    """One reply in a segment: where it starts, its prompt's messages and how it ended.

    ``drift``: tokens of the reply that a fresh render of the chat writes differently (templates that rewrite earlier
    turns, e.g. drop past reasoning; the kept ids stay as sampled), known once the next request extends the segment.
    """

    start: int
    length: int
    finish_reason: str
    prompt_messages: list[dict[str, Any]]
    reply: dict[str, Any]
    version: int | None = None
    drift: int = 0


class Segment:
    """One token-exact sequence of a session: an :class:`~chatenv.envs.state.EpisodeState` and its turns.

    Args:
        chat_tokenizer: Renders its messages (with tool support when it has tools).
        messages: The first request's messages (chatenv form).
        tools: The tool schemas rendered into the prompt, or None.
    """

    def __init__(self, chat_tokenizer: ChatTokenizer, messages: list[dict[str, Any]], tools: list[Any] | None):
        self.chat = EpisodeState(chat_tokenizer, messages, tools=tools, generated_mask=True)
        self.chat_tokenizer = chat_tokenizer
        self.tools = tools
        self.tools_key = tools_key(tools)
        self.turns: list[Turn] = []
        self.pending: list[Choice] = []
        self.claimed = False  # a request is extending it right now
        self.used = 0  # when it was last extended (the session's request count then)
        self.origin: Segment | None = None  # the segment this one was forked from
        self.continued = 0  # pending replies continued in forks (not discarded)

    def forked(self) -> Segment:
        """A new segment with a copy of this one's ids, turns and pending replies (to extend apart from it)."""
        new = copy.copy(self)
        new.chat = self.chat.fork()
        new.turns = [dataclasses.replace(t, prompt_messages=list(t.prompt_messages)) for t in self.turns]
        new.pending = list(self.pending)
        new.claimed = False
        new.origin, new.continued = self, 0
        return new

    def opening_key(self) -> tuple[str, tuple[Any, ...]]:
        """What indexes the segment in its session: its tools and its first message."""
        return self.tools_key, message_key(self.chat.messages[0])

    def __len__(self) -> int:
        return len(self.chat)

    def match(self, messages: list[dict[str, Any]], tools_text: str) -> tuple[int, list[dict[str, Any]], bool] | None:
        """``(choice, new messages, restored)`` when ``messages`` extend this segment through reply ``choice``.

        ``restored``: some assistant message came back without its reasoning or re-spaced
        (:func:`~chatenv.serve.messages.sent_back`); the recorded ids still hold. None when the messages do not
        extend the segment.
        """
        if tools_text != self.tools_key or not self.pending:
            return None
        held = self.chat.held_messages()
        n = len(held)
        if len(messages) <= n:
            return None
        kinds = [sent_back(m, h) for m, h in zip(messages[:n], held)]
        if None in kinds:
            return None
        matches = [sent_back(messages[n], choice.message) for choice in self.pending]
        if "same" in matches:  # the reply as returned: the first such choice (equal replies have equal ids)
            return matches.index("same"), messages[n + 1 :], "restored" in kinds
        if matches.count("restored") == 1:  # one reply it can only be: never a guess between several
            return matches.index("restored"), messages[n + 1 :], True
        return None

    def extended(self, choice: int, new: list[dict[str, Any]]) -> Extension:
        """The extension by reply ``choice`` and the ``new`` messages, planned (changes nothing)."""
        c = self.pending[choice]
        return self.chat.plan(c.message, c.ids, c.complete, new, log_probs=c.log_probs)

    def commit(self, choice: int, ext: Extension) -> None:
        """Record reply ``choice`` of the pending ones as this segment's turn and apply its extension."""
        c = self.pending[choice]
        turn = Turn(len(self.chat), len(c.ids), c.finish_reason, self.chat.messages, dict(c.message), c.version)
        turn.drift = ext.drift
        self.turns.append(turn)
        self.chat.commit(ext)
        self.pending = []

    def snapshot(self) -> dict[str, Any]:
        """The segment as JSON data, its last pending reply (choice 0) included as a turn; NaN becomes None."""
        chat = self.chat
        ids, mask, lps = chat.token_ids.tolist(), chat.assistant_mask.tolist(), chat.log_probs.tolist()
        turns = [_turn_dict(t) for t in self.turns]
        messages = chat.messages
        if self.pending:
            c = self.pending[0]
            turns.append(_turn_dict(Turn(len(ids), len(c.ids), c.finish_reason, messages, c.message, c.version)))
            ids += c.ids
            mask += [True] * len(c.ids)
            lps += list(c.log_probs)
            messages.append(dict(c.message))
        return {
            "ids": ids,
            "assistant_mask": mask,
            "log_probs": [None if math.isnan(v) else v for v in lps],
            "turns": turns,
            "messages": messages,
            "tools": self.tools,
        }


def _rank(seg: Segment) -> tuple[int, bool, int]:
    """How strongly a request that extends ``seg`` should continue it (the module's rule: higher first)."""
    return len(seg.chat.messages), not seg.claimed, seg.used


def _turn_dict(t: Turn) -> dict[str, Any]:
    return {
        "start": t.start,
        "length": t.length,
        "finish_reason": t.finish_reason,
        "prompt_messages": [dict(m) for m in t.prompt_messages],
        "reply": dict(t.reply),
        "policy_version": t.version,
        "template_drift": t.drift,
    }


@dataclass
class Plan:
    """What a request will do to its session once its generation succeeds.

    Attributes:
        segment: The segment the request extends, or the new one it starts.
        new: Whether ``segment`` is new (the first request, or a divergence).
        choice: The pending reply the request continues (extensions only).
        ids, mask, log_probs: The prompt: the segment's sequence the reply is generated after.
        messages: The request's messages.
        ext: The extension of ``segment`` (extensions only).
        restored: The request sent a recorded reply back without its reasoning or re-spaced (extensions only).
        turns: How many turns ``segment`` had when the plan was made (a claim checks it is still so).
        forked: ``segment`` is a fork of a segment another request was extending.
        reserved: Tokens the claim reserved (the request's ``n`` x its reply budget).
        budget: The reply budget of each of the request's replies.
    """

    segment: Segment
    new: bool
    choice: int | None
    ids: list[int]
    mask: list[bool]
    log_probs: list[float]
    messages: list[dict[str, Any]]
    ext: Extension | None = None
    restored: bool = False
    turns: int = 0
    forked: bool = False
    reserved: int = 0
    budget: int = 0


class Session:
    """The trajectory of one session: its segments, divergences and posted rewards.

    Args:
        session_id: The session's id.
        scope: Which API key made it (None: the endpoint has one key or none); other keys cannot see it.
    """

    def __init__(self, session_id: str, scope: int | None = None):
        self.id = session_id
        self.scope = scope
        self.segments: list[Segment] = []
        self.divergences = 0
        self.requests = 0
        self.pending = 0  # requests in flight (a refused first request removes the session only when alone)
        self.discarded_choices = 0
        self.restored = 0  # requests that sent a reply back without its reasoning or re-spaced, kept in one segment
        self.forks = 0  # segments started as forks of one another request was extending
        self.rewards: list[dict[str, Any]] = []
        self.reserved = 0  # tokens the requests in flight may add
        self._by_opening: dict[tuple[str, tuple[Any, ...]], list[Segment]] = {}
        self._lock = threading.Lock()  # guards the data: requests plan on worker threads, readers on others

    def plan(
        self,
        chat_tokenizer: ChatTokenizer,
        messages: list[dict[str, Any]],
        tools: list[Any] | None,
        prompt_ids: list[int] | None = None,
    ) -> Plan:
        """Where a request's messages go: an open segment (TITO continuation), a fork of one, or a new segment.

        ``prompt_ids``: the ids a client says it continues (token routes). When they are not the continuation of the
        segment the messages extend but are a fresh render of the messages (clients that re-render the whole chat
        each turn), the request starts a new segment from that render: the model is sampled after exactly those ids,
        so that is what is recorded (the earlier replies in it are prompt, not sampled, tokens).

        Changes nothing; :meth:`claim` then takes the segment for the request (see the module's rule).
        """
        key = tools_key(tools)
        with self._lock:
            candidates = []
            for seg in self._by_opening.get((key, message_key(messages[0])), []) if messages else []:
                found = seg.match(messages, key) if seg.chat_tokenizer is chat_tokenizer else None
                if found is not None:
                    candidates.append((seg, found))
            candidates.sort(key=lambda c: _rank(c[0]), reverse=True)
            for seg, (choice, new, restored) in candidates:
                plan = self._extension(seg, choice, new, restored, messages)
                if prompt_ids is None or plan.ids == prompt_ids:  # with client ids: the segment that holds them
                    return plan
        return self._new_plan(chat_tokenizer, messages, tools)

    @staticmethod
    def _extension(
        seg: Segment, choice: int, new: list[dict[str, Any]], restored: bool, messages: list[dict[str, Any]]
    ) -> Plan:
        """The plan that extends ``seg`` (a fork of it when another request is extending it now)."""
        forked = seg.claimed
        if forked:
            seg = seg.forked()
        ext = seg.extended(choice, new)
        ext.messages = [dict(m) for m in messages]  # the chat as the request writes it
        ids, mask, lps = seg.chat.view_after(ext)
        return Plan(seg, forked, choice, ids, mask, lps, messages, ext, restored, len(seg.turns), forked)

    @staticmethod
    def _new_plan(chat_tokenizer: ChatTokenizer, messages: list[dict[str, Any]], tools: list[Any] | None) -> Plan:
        segment = Segment(chat_tokenizer, messages, tools)
        n = len(segment)
        return Plan(segment, True, None, segment.chat.token_ids.tolist(), [False] * n, [math.nan] * n, messages)

    def claim(self, plan: Plan, reserve: int, limit: int | None) -> bool:
        """Take ``plan``'s segment for its request and reserve ``reserve`` tokens; False if the plan went stale.

        A plan goes stale when another request claimed or extended its segment since it was made (plan again: the
        segment is then forked). Nothing is taken when this raises or returns False.

        Raises:
            APIError: 400 ``session_too_large`` when the session would hold more than ``limit`` ids.
        """
        with self._lock:
            seg = plan.segment
            if not plan.new and (seg.claimed or len(seg.turns) != plan.turns):
                return False
            growth = len(plan.ids) - (0 if plan.new and not plan.forked else len(seg)) + reserve
            if plan.forked:
                growth += len(seg)  # a fork holds a copy of the ids it was forked from
            held = sum(len(s) for s in self.segments) + self.reserved + growth
            if limit is not None and held > limit:
                raise APIError(
                    f"session {self.id!r} would hold up to {held} tokens with this request, over this endpoint's "
                    f"limit of {limit} per session; start a new session",
                    param="messages",
                    code="session_too_large",
                )
            if not plan.new:
                seg.claimed = True
            plan.reserved = growth  # the prompt's new ids too: concurrent claims see each other's whole growth
            self.reserved += growth
            return True

    def release(self, plan: Plan) -> None:
        """Give back what :meth:`claim` took for a request that will not commit (refused, failed or cancelled)."""
        with self._lock:
            self._release(plan)

    def _release(self, plan: Plan) -> None:
        if not plan.new:
            plan.segment.claimed = False
        self.reserved -= plan.reserved
        plan.reserved = 0

    def commit(self, plan: Plan, choices: list[Choice]) -> None:
        """Apply a planned and claimed request whose generation returned ``choices`` (cannot fail)."""
        with self._lock:
            self._release(plan)
            seg = plan.segment
            if plan.forked:  # a whole episode of its own: neither a divergence nor a discarded choice
                assert plan.choice is not None and plan.ext is not None  # a fork's plan extends it
                self.forks += 1
                origin = seg.origin
                if origin is not None and len(origin.turns) == plan.turns:
                    origin.continued += 1  # one of its pending replies is continued here, not discarded
                else:  # the origin moved on and counted this reply as discarded
                    self.discarded_choices -= 1
                self.restored += plan.restored
                seg.commit(plan.choice, plan.ext)
                self.segments.append(seg)
                self._by_opening.setdefault(seg.opening_key(), []).append(seg)
            elif plan.new:
                if self.segments:
                    self.divergences += 1
                self.segments.append(seg)
                self._by_opening.setdefault(seg.opening_key(), []).append(seg)
            else:
                assert plan.choice is not None and plan.ext is not None  # an extension's plan has both
                self.discarded_choices += len(seg.pending) - 1 - seg.continued
                self.restored += plan.restored
                seg.commit(plan.choice, plan.ext)
            seg.pending = list(choices)
            seg.continued = 0
            self.requests += 1
            seg.used = self.requests

    def add_reward(self, reward: float, name: str = "agent") -> None:
        """Record a reward posted for this session (summed per name)."""
        with self._lock:
            self.rewards.append({"name": name, "reward": float(reward)})

    def snapshot(self) -> dict[str, Any]:
        """The session as JSON data: segments (ids, assistant mask, log-probs, turns, messages), counts, rewards."""
        with self._lock:
            totals: dict[str, float] = {}
            for r in self.rewards:
                totals[r["name"]] = totals.get(r["name"], 0.0) + r["reward"]
            return {
                "id": self.id,
                "requests": self.requests,
                "divergences": self.divergences,
                "forks": self.forks,
                "discarded_choices": self.discarded_choices,
                "restored": self.restored,
                "rewards": totals,
                "reward": sum(totals.values()),
                "segments": [s.snapshot() for s in self.segments],
            }
