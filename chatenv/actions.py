"""What a policy hands an env: :class:`ScoredAction` (generated ids + their log-probs), and its one converter.

Envs take plain actions too (text, a message dict, token ids); a :class:`ScoredAction` adds the generation-time
log-probs so KL env wrappers need one reference forward and no second policy pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chatenv.ids import check_vocab, token_id_array, token_ids

__all__ = ["ScoredAction", "action_ids", "action_token", "attach_ref_log_probs", "scored_action_from_output"]


@dataclass
class ScoredAction:
    """Generated ids with their generation-time log-probs (and, optionally, reference log-probs).

    :class:`~chatenv.envs.ChatEnv` takes only the ids; env wrappers that compute KL penalties (``wrappers.kl``)
    use the log-probs.

    Attributes:
        ids: The generated token ids.
        log_probs: The policy's log-prob of each generated id.
        ref_log_probs: The reference model's log-prob of each id, if already computed (e.g. for many envs in
            one batch by :func:`chatenv.rollout`).
        prompt_ids: The ids the reply was generated after (the observation's ids), so a reference can score
            the reply without asking the env.
        placeholder: A reply whose step will be discarded (a vector env's idle sub-env); KL wrappers pass it
            through without computing anything or updating controllers.
    """

    ids: Any
    log_probs: Any = None
    ref_log_probs: Any = None
    prompt_ids: Any = None
    placeholder: bool = False


def scored_action_from_output(td: Any) -> ScoredAction:
    """A :class:`ScoredAction` from one row of a policy wrapper's output (``tokens`` and, if any, ``log_probs``).

    Raises:
        TypeError: If ``td`` holds no ``tokens`` container.
        ValueError: If it holds more than one row.
    """
    tokens, lps = td.get("tokens", None), td.get("log_probs", None)
    if tokens is None or not hasattr(tokens, "unpadded"):
        raise TypeError("a tensordict action must hold the policy's 'tokens' output")
    if tokens.batch_dims != 1 or tokens.batch_size[0] != 1:
        raise ValueError(
            f"a tensordict action must hold one response, got batch {tuple(tokens.batch_size)}; step each env "
            "with its row (td[i:i + 1])"
        )
    ids = tokens.unpadded("response")[0].numpy().astype(np.int64)
    lp = lps.unpadded("response")[0].numpy() if lps is not None and lps.has("response") else None
    prompt = tokens.unpadded("prompt")[0].numpy().astype(np.int64) if tokens.has("prompt") else None
    return ScoredAction(ids, lp, prompt_ids=prompt)


def attach_ref_log_probs(ref_model: Any, actions: Sequence[ScoredAction]) -> None:
    """Score every non-placeholder action's reply with ``ref_model`` in one batch; set ``ref_log_probs``.

    Args:
        ref_model: A :class:`~chatenv.protocols.ReferenceScorer`.
        actions: Actions with ``prompt_ids``; those that already have ``ref_log_probs`` are left alone.

    Raises:
        ValueError: If an action that needs scoring has no ``prompt_ids``.
    """
    todo = [a for a in actions if not a.placeholder and a.ref_log_probs is None]
    if not todo:
        return
    seqs = []
    for a in todo:
        if a.prompt_ids is None:
            raise ValueError("a ScoredAction needs prompt_ids to be scored by a reference model")
        seqs.append(_int_ids(a.prompt_ids, "prompt_ids") + _int_ids(a.ids, "ids"))
    rows = list(ref_model.log_probs(seqs))
    if len(rows) != len(seqs):
        raise ValueError(f"the reference model returned {len(rows)} rows of log-probs for {len(seqs)} sequences")
    for a, seq, lp in zip(todo, seqs, rows):
        if len(lp) != len(seq):
            raise ValueError(f"the reference model returned {len(lp)} log-probs for a sequence of {len(seq)} ids")
        n = len(seq) - len(np.asarray(a.ids).reshape(-1))
        a.ref_log_probs = np.asarray(lp[n:], dtype=np.float32)


def _int_ids(values: Any, what: str) -> list[int]:
    return token_ids(values, f"ScoredAction.{what}")


def _as_array(action: Any) -> Any:
    try:
        import torch

        if isinstance(action, torch.Tensor):
            return action.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return action


def action_ids(action: Any, vocab_size: int) -> list[int]:
    """Generated token ids from an action (a 1-D int sequence, array or tensor, a ScoredAction, a policy row).

    The ids are read by :func:`chatenv.ids.token_id_array` (floats are never truncated, nesting never flattened).

    Raises:
        TypeError: For anything that is not a 1-D sequence of integers.
        ValueError: For an empty reply or ids outside ``[0, vocab_size)``.
    """
    if isinstance(action, ScoredAction):
        action = action.ids
    elif hasattr(action, "batch_size") and hasattr(action, "get"):  # a policy wrapper's output row
        action = scored_action_from_output(action).ids
    try:
        ids = token_id_array(action, "the action")
    except TypeError as e:
        raise TypeError(
            f"unsupported action {type(action).__name__}: {e}; give the reply as text, a message dict, or a 1-D "
            "sequence of generated token ids (integers)"
        ) from e
    if ids.size == 0:
        raise ValueError("empty action: a reply needs at least one generated token")
    check_vocab(ids, vocab_size, "the action")
    reply: list[int] = ids.tolist()
    return reply


def action_token(action: Any, vocab_size: int) -> int:
    """One token id from a token-level action (an int, a one-element array or tensor, a ScoredAction).

    Raises:
        TypeError: For anything that is not one integer.
        ValueError: For an id outside ``[0, vocab_size)``.
    """
    if isinstance(action, ScoredAction):
        action = np.asarray(action.ids)
    action = _as_array(action)
    if isinstance(action, np.ndarray):
        if action.size != 1:
            raise TypeError(f"one step takes one token id, got an array of shape {action.shape}")
        if not np.issubdtype(action.dtype, np.integer):
            raise TypeError(f"the action is one token id (an int), got an array of {action.dtype}")
        action = action.reshape(()).item()
    if isinstance(action, (bool, np.bool_)) or not isinstance(action, (int, np.integer)):
        raise TypeError(f"the action is one token id (an int), got {type(action).__name__}")
    if not 0 <= int(action) < vocab_size:
        raise ValueError(f"token id {int(action)} is outside the vocabulary [0, {vocab_size})")
    return int(action)
