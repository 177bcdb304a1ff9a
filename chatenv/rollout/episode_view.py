"""The episode view of a rollout: one row per episode instead of one per turn, and back.

A turn-level rollout (:func:`chatenv.rollout`) has one row per assistant turn; trainers that take whole
trajectories (GRPO over multi-turn episodes, TRL's ``rollout_func``) want one row per episode: the first prompt,
then everything after it (the assistant's replies *and* the env's messages between them) as one completion, with
the assistant mask telling the replies apart. Token-in/token-out makes this exact: each turn's prompt is the
previous turn's prompt + reply + the env's new tokens, so the last turn's ids hold the whole episode.

:func:`episodes` builds the view; :func:`turns` gives the per-turn layout back, equal to the rollout's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from chatenv.containers import LogProbs, Masks, Tokens
from chatenv.padding import nested, pad_sequences

__all__ = ["episodes", "turns"]

_PER_TOKEN = ("log_probs", "ref_log_probs", "kl")


def _rows_by_episode(td: TensorDict) -> list[list[int]]:
    order: dict[int, list[tuple[int, int]]] = {}
    for k, (ep, turn) in enumerate(zip(td["episode"].tolist(), td["turn"].tolist())):
        order.setdefault(ep, []).append((turn, k))
    out = []
    for ep in sorted(order):
        rows = [k for _, k in sorted(order[ep])]
        turns_seen = [t for t, _ in sorted(order[ep])]
        first = turns_seen[0] if turns_seen else 0  # a branch of a forked episode starts at its branch point's turn
        if turns_seen != list(range(first, first + len(turns_seen))):
            raise ValueError(f"episode {ep} has turns {turns_seen}; an episode view needs consecutive turns")
        out.append(rows)
    return out


def _stack(values: list[torch.Tensor], padded: bool, fill: Any) -> torch.Tensor:
    return pad_sequences(values, "right", fill)[0] if padded else nested(values)


class _Episode:
    """One episode's pieces, read from its turns' rows."""

    def __init__(self, td: TensorDict, rows: list[int], parts: dict[str, Any]):
        first, last = rows[0], rows[-1]
        self.prompt = parts["prompt"][first]
        full = torch.cat([parts["prompt"][last], parts["response"][last]])
        p0 = len(self.prompt)
        self.completion = full[p0:]
        self.starts, self.lengths = [], []
        for k in rows:
            prompt = parts["prompt"][k]
            if not torch.equal(prompt[:p0], self.prompt) or not torch.equal(full[: len(prompt)], prompt):
                raise ValueError(
                    f"turn rows of episode {int(td['episode'][first])} do not extend each other (row {k}); an episode "
                    "view needs token-in/token-out rows as chatenv.rollout records them (envs built with "
                    "rerender=True start a new context segment where a template rewrites the past: train on the "
                    "rows, or use the default token-in/token-out stepping)"
                )
            self.starts.append(len(prompt) - p0)
            self.lengths.append(len(parts["response"][k]))
        self.mask = parts["masks"][last] if parts["masks"] is not None else None
        self.per_token = {}
        for key, resp in parts["per_token"].items():
            values = torch.full((len(self.completion),), math.nan)
            for k, start, n in zip(rows, self.starts, self.lengths):
                values[start : start + n] = resp[k]
            self.per_token[key] = values


def _parts(td: TensorDict) -> dict[str, Any]:
    tokens = td["tokens"]
    per_token = {key: td[key].unpadded("response") for key in _PER_TOKEN if key in td.keys()}
    return {
        "prompt": tokens.unpadded("prompt"),
        "response": tokens.unpadded("response"),
        "masks": td["masks"].unpadded() if "masks" in td.keys() else None,
        "per_token": per_token,
        "padded": bool(tokens.padded),
    }


def episodes(td: TensorDict, *, pad_token_id: int | None = None) -> TensorDict:
    """One row per episode of a turn-level rollout TensorDict.

    Args:
        td: What :func:`chatenv.rollout` returned (padded or nested; the view keeps the layout).
        pad_token_id: Padding id of the token tensors (default: read from the rollout's padding, else 0).

    Returns:
        A TensorDict of batch ``(E,)``, by episode:

        - ``tokens``: ``prompt`` = the first prompt, ``response`` = the completion (every later token: replies and
          the env's messages), ``full`` = both; ``masks``: the assistant mask over ``full`` (the replies and their
          end-of-turn tokens only);
        - ``log_probs`` (and ``ref_log_probs``, ``kl`` when recorded): generation values on the replies' tokens,
          NaN on the prompt and on the env's tokens (they were not sampled);
        - ``turn_start``, ``turn_length``: where each reply sits in the completion (``(E, turns)``, padded with
          -1, or nested); ``turn_reward`` (NaN-padded or nested) and ``turn_task_reward`` if recorded;
          ``turn_version`` (the policy version that sampled each reply, -1 where not reported; padded with -1 past
          ``num_turns``, or nested) when the rollout has ``policy_version``;
        - ``reward`` (sum over turns; ``task_reward``, ``tool_calls``, ``tool_errors``, ``template_drift`` too if
          recorded),
          ``num_turns``, ``terminated``,
          ``truncated``, ``episode``, ``env_index`` and ``group`` if the rollout had groups.

    Raises:
        ValueError: If an episode's turns are missing or its rows do not extend each other.

    Example:
        >>> # view = chatenv.episodes(chatenv.rollout(envs, policy, episodes=8)); view["tokens"].response
    """
    rows = _rows_by_episode(td)
    if ("next", "segment") in td.keys(True):
        segment = td["next", "segment"][:, 0]
        for r in rows:
            if int(segment[r].max()) > 0:
                raise ValueError(
                    f"episode {int(td['episode'][r[0]])} has several context segments: envs built with "
                    "rerender=True start a new context segment where a template rewrites the past, so its turns do "
                    "not extend one token chain; train on the rows, or use the default token-in/token-out stepping"
                )
    parts = _parts(td)
    padded = parts["padded"]
    eps = [_Episode(td, r, parts) for r in rows]
    pad = _pad_id(td["tokens"]) if pad_token_id is None else pad_token_id
    out = TensorDict(batch_size=[len(eps)])
    tokens = Tokens.from_sequences([e.prompt for e in eps], [e.completion for e in eps], padded=padded, pad_value=pad)
    out.set("tokens", tokens)
    if parts["masks"] is not None:
        out.set("masks", Masks.from_tokens(tokens, [e.mask for e in eps if e.mask is not None]))
    for key in parts["per_token"]:
        prompts = [torch.full((len(e.prompt),), math.nan) for e in eps]
        out.set(key, LogProbs.from_sequences(prompts, [e.per_token[key] for e in eps], padded=padded))
    long = [torch.tensor(e.starts) for e in eps], [torch.tensor(e.lengths) for e in eps]
    out.set("turn_start", _stack(long[0], padded, -1))
    out.set("turn_length", _stack(long[1], padded, -1))
    _set_episode_columns(out, td, rows, padded)
    return out


def _pad_id(tokens: Tokens) -> int:
    """The id padded ``Tokens`` were padded with (0 when nothing is padded, or for nested ones)."""
    if tokens.padded:
        full = tokens.full
        pads = full[~tokens.attention_mask()] if full is not None else torch.zeros(0)
        if pads.numel():
            return int(pads[0])
    return 0


def _set_episode_columns(out: TensorDict, td: TensorDict, rows: list[list[int]], padded: bool) -> None:
    reward = td["next", "reward"][:, 0]
    per_turn = [reward[r] for r in rows]
    out.set("turn_reward", _stack(per_turn, padded, math.nan))
    out.set("reward", torch.stack([v.sum() for v in per_turn]))
    if "policy_version" in td.keys():
        out.set("turn_version", _stack([td["policy_version"][r] for r in rows], padded, -1))
    if ("next", "task_reward") in td.keys(True):
        task = [td["next", "task_reward"][:, 0][r] for r in rows]
        out.set("turn_task_reward", _stack(task, padded, math.nan))
        out.set("task_reward", torch.stack([v.sum() for v in task]))
    for key in ("tool_calls", "tool_errors", "template_drift"):  # per-turn counts, summed per episode
        if ("next", key) in td.keys(True):
            out.set(key, torch.stack([td["next", key][:, 0][r].sum() for r in rows]))
    last = [r[-1] for r in rows]
    out.set("num_turns", torch.tensor([len(r) for r in rows], dtype=torch.long))
    out.set("terminated", td["next", "terminated"][last, 0].clone())
    out.set("truncated", td["next", "truncated"][last, 0].clone())
    for key in ("episode", "env_index", "group"):
        if key in td.keys():
            out.set(key, td[key][last].clone())


def turns(view: TensorDict) -> TensorDict:
    """The per-turn layout of an episode view (the rows :func:`chatenv.rollout` recorded, same values).

    Returns ``tokens``, ``masks``, the per-token entries, ``("next", "reward" | "task_reward" | "terminated" |
    "truncated" | "done")``, ``episode``, ``turn``, ``env_index``, ``group`` and ``policy_version``, by episode then
    turn.
    """
    tokens = view["tokens"]
    padded = bool(tokens.padded)
    prompts, completions = tokens.unpadded("prompt"), tokens.unpadded("response")
    starts, lengths = _unstack(view["turn_start"], padded), _unstack(view["turn_length"], padded)
    masks = view["masks"].unpadded() if "masks" in view.keys() else None
    per_token = {k: view[k].unpadded("response") for k in _PER_TOKEN if k in view.keys()}
    rows: dict[str, list[Any]] = {"prompt": [], "response": [], "mask": [], "episode": [], "turn": []}
    rows.update({k: [] for k in per_token})
    for e, (p, c) in enumerate(zip(prompts, completions)):
        for t, (s, n) in enumerate(zip(starts[e].tolist(), lengths[e].tolist())):
            rows["prompt"].append(torch.cat([p, c[:s]]))
            rows["response"].append(c[s : s + n])
            if masks is not None:
                rows["mask"].append(masks[e][: len(p) + s + n])
            for k, values in per_token.items():
                rows[k].append(values[e][s : s + n])
            rows["episode"].append(e)
            rows["turn"].append(t)
    pad = _pad_id(tokens)
    out = TensorDict(batch_size=[len(rows["prompt"])])
    flat = Tokens.from_sequences(rows["prompt"], rows["response"], padded=padded, pad_value=pad)
    out.set("tokens", flat)
    if masks is not None:
        out.set("masks", Masks.from_tokens(flat, rows["mask"]))
    for k in per_token:
        nan = [torch.full((len(p),), math.nan) for p in rows["prompt"]]
        out.set(k, LogProbs.from_sequences(nan, rows[k], padded=padded))
    _set_turn_columns(out, view, rows, padded)
    return out


def _unstack(value: torch.Tensor, padded: bool) -> Sequence[torch.Tensor]:
    if not padded:
        return list(value.unbind())
    return [row[row >= 0] for row in value]


def _set_turn_columns(out: TensorDict, view: TensorDict, rows: dict[str, list[Any]], padded: bool) -> None:
    episode = torch.tensor(rows["episode"], dtype=torch.long)
    turn = torch.tensor(rows["turn"], dtype=torch.long)
    n_turns = view["num_turns"][episode]
    last = turn == n_turns - 1
    for key, name in (("turn_reward", "reward"), ("turn_task_reward", "task_reward")):
        if key in view.keys():
            values = _unstack_float(view[key], padded)
            out.set(
                ("next", name), torch.stack([values[e][t] for e, t in zip(rows["episode"], rows["turn"])]).unsqueeze(-1)
            )
    out.set(("next", "terminated"), (view["terminated"][episode] & last).unsqueeze(-1))
    out.set(("next", "truncated"), (view["truncated"][episode] & last).unsqueeze(-1))
    out.set(("next", "done"), out["next", "terminated"] | out["next", "truncated"])
    out.set("episode", view["episode"][episode] if "episode" in view.keys() else episode)
    out.set("turn", turn)
    for key in ("env_index", "group"):
        if key in view.keys():
            out.set(key, view[key][episode])
    if "turn_version" in view.keys():
        versions = _unstack_float(view["turn_version"], padded)
        out.set("policy_version", torch.stack([versions[e][t] for e, t in zip(rows["episode"], rows["turn"])]))


def _unstack_float(value: torch.Tensor, padded: bool) -> Sequence[torch.Tensor]:
    return list(value) if padded else list(value.unbind())
