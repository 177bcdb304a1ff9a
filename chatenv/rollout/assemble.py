"""Transitions into one TensorDict in TorchRL's layout."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from chatenv.containers import LogProbs, Masks, Tokens
from chatenv.modes import get_mode
from chatenv.protocols import OutputLayout, layout_of
from chatenv.rollout.collect import Transition

__all__ = ["STALE_POLICIES", "apply_staleness", "assemble"]

#: what ``max_staleness`` does with stale transitions: ``"flag"`` keeps them (``stale`` column), ``"drop"`` removes them
STALE_POLICIES = ("flag", "drop")

#: per-token info entries written by KL env wrappers, recorded shaped like the log-probs
_PER_TOKEN = ("ref_log_probs", "kl")


def _column(values: Sequence[Any], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(list(values), dtype=dtype).reshape(len(values), 1)


def _per_token(transitions: list[Transition], key: str, padded: bool) -> LogProbs | None:
    """A per-token info entry as LogProbs (NaN on the prompt, and on rows whose env did not report it)."""
    values = [t.result.info.get(key) for t in transitions]
    if all(v is None for v in values):
        return None
    responses = []
    for t, v in zip(transitions, values):
        n = len(t.row.response)
        responses.append(
            torch.full((n,), math.nan)
            if v is None
            else torch.as_tensor(np.asarray(v, dtype=np.float32).reshape(-1), dtype=torch.float32)
        )
    prompts = [torch.full((len(t.row.prompt),), math.nan) for t in transitions]
    out: LogProbs = LogProbs.from_sequences(prompts, responses, padded=padded)
    return out


def _set_sequences(td: TensorDict, transitions: list[Transition], layout: OutputLayout) -> None:
    rows = [t.row for t in transitions]
    padded = layout.pad_output
    tokens = Tokens.from_sequences(
        [r.prompt for r in rows], [r.response for r in rows], padded=padded, pad_value=layout.pad_token_id
    )
    td.set(layout.tokens_key, tokens)
    if layout.masks_key is not None and rows[0].assistant is not None:
        td.set(layout.masks_key, Masks.from_tokens(tokens, [r.assistant for r in rows if r.assistant is not None]))
    log_probs = [r.log_probs for r in rows if r.log_probs is not None]
    if layout.log_probs_key is not None and rows[0].log_probs is not None:
        td.set(
            layout.log_probs_key,
            LogProbs.from_sequences([lp[0] for lp in log_probs], [lp[1] for lp in log_probs], padded=padded),
        )
    for name, container in get_mode(layout.input_mode).build_views([r.view for r in rows]).items():
        key = layout.text_key if name == "text" else layout.history_key
        if key is not None:
            td.set(key, container)
    for key in _PER_TOKEN:
        values = _per_token(transitions, key, padded)
        if values is not None:
            td.set(key, values)


def _set_rewards(td: TensorDict, transitions: list[Transition]) -> None:
    results = [t.result for t in transitions]
    task = [r.info.get("task_reward") for r in results]
    if any(v is not None for v in task):
        td.set(("next", "task_reward"), _column([math.nan if v is None else v for v in task], torch.float32))
    td.set(("next", "reward"), _column([r.reward for r in results], torch.float32))
    td.set(("next", "terminated"), _column([r.terminated for r in results], torch.bool))
    td.set(("next", "truncated"), _column([r.truncated for r in results], torch.bool))
    td.set(("next", "done"), _column([r.done for r in results], torch.bool))
    chats = [r.info.get("chat") for r in results]
    if any(c is not None for c in chats):  # the whole chat of each finished episode, as JSON ("" on other rows)
        td.set(("next", "chat"), NonTensorStack.from_list(["" if c is None else json.dumps(c) for c in chats]))
    failed = [bool((r.info.get("task_info") or {}).get("reward_error")) for r in results]
    if any(failed):
        td.set(("next", "reward_failed"), _column(failed, torch.bool))
    tools = [r.info.get("tool_turn") for r in results]
    if any(t is not None for t in tools):  # the turn's tool calls and failed calls (0 for envs without tools)
        for key, name in (("tool_calls", "calls"), ("tool_errors", "errors")):
            td.set(("next", key), _column([(t or {}).get(name, 0) for t in tools], torch.long))
    drift = [r.info.get("template_drift") for r in results]
    if any(d for d in drift):  # tokens of the turn's reply a fresh render writes differently (templates that
        td.set(("next", "template_drift"), _column([d or 0 for d in drift], torch.long))  # rewrite the past)
        td.set(("next", "segment"), _column([r.info.get("segment", 0) for r in results], torch.long))
    components = [dict(r.info.get("reward_components", {}) or {}) for r in results]
    for name in sorted({k for c in components for k in c}):
        td.set(("next", "reward_components", name), _column([c.get(name, math.nan) for c in components], torch.float32))


def assemble(transitions: list[Transition], policy: OutputLayout | Any, *, groups: bool = False) -> TensorDict:
    """One row per transition: containers of the turn, ``("next", ...)`` rewards and flags, bookkeeping.

    ``policy`` is the :class:`~chatenv.protocols.OutputLayout` of the rows (or a policy, whose layout is read with
    :func:`~chatenv.protocols.layout_of`): where the containers go, padding, input mode.

    Bookkeeping: ``episode``, ``turn``, ``env_index``, with ``groups`` ``group``, and ``policy_version`` (the
    version of the policy that generated each reply) when the policy reports one (``-1`` on rows without). The row
    that ends an episode holds the env's whole chat as JSON in ``("next", "chat")`` (the env's messages: structure
    from its ids, not from parsing text); other rows hold ``""``.

    With tools, ``("next", "tool_calls")`` and ``("next", "tool_errors")`` count each turn's calls and failed
    calls. With a template that rewrites the past, ``("next", "template_drift")`` counts the tokens of each reply a
    fresh render writes differently and ``("next", "segment")`` numbers the episode's context segments (a new one
    starts where ``rerender=True`` replaced the context with a fresh render). Entries some rows lack (a component a
    task did not report, KL values of an env without a KL wrapper) are NaN in those rows, never dropped.
    """
    n = len(transitions)
    td = TensorDict(batch_size=[n])
    if n:
        _set_sequences(td, transitions, layout_of(policy))
        _set_rewards(td, transitions)
    td.set("episode", torch.tensor([t.episode for t in transitions], dtype=torch.long))
    td.set("turn", torch.tensor([t.turn for t in transitions], dtype=torch.long))
    td.set("env_index", torch.tensor([t.env_index for t in transitions], dtype=torch.long))
    if groups:
        td.set("group", torch.tensor([t.group for t in transitions], dtype=torch.long))
    versions = [t.row.version for t in transitions]
    if any(v is not None for v in versions):
        td.set("policy_version", torch.tensor([-1 if v is None else v for v in versions], dtype=torch.long))
    return td


def apply_staleness(td: TensorDict, current: int, max_staleness: int, stale: str = "flag") -> TensorDict:
    """Mark or remove transitions generated more than ``max_staleness`` versions before ``current``.

    A row is stale when ``current - policy_version > max_staleness`` (rows without a version, ``-1``, are stale).

    Args:
        td: An assembled rollout (with ``policy_version``).
        current: The policy's version now.
        max_staleness: Versions a transition may lag behind ``current``.
        stale: ``"flag"``: keep every row and add a ``stale`` bool column ``(N,)``; ``"drop"``: remove stale rows
            (an episode may then lack its older turns).

    Raises:
        KeyError: If ``td`` has no ``policy_version`` column (the policy reports no version).
    """
    if td.batch_size[0] == 0:
        if stale != "drop":
            td.set("stale", torch.zeros(0, dtype=torch.bool))
        return td
    if "policy_version" not in td.keys():
        raise KeyError("max_staleness needs the policy_version column; the policy reports no version")
    versions = td.get("policy_version")
    old = (versions < 0) | (int(current) - versions > max_staleness)
    if stale == "drop":
        return td[~old]
    td.set("stale", old)
    return td
