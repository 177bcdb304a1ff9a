"""Strict readers of token ids and env observations: refuse what is not what the input mode reads, never coerce.

Token ids must be integers: a float id (``1.5``, or a float tensor, NaN or not) is refused rather than truncated;
a nested or 2-D value given as one sequence is refused rather than flattened; text and message dicts given to a
tokens-mode policy are refused with the input mode that reads them. :func:`id_row` reads one id sequence and
:func:`split_observations` one observation or a batch of them, as :meth:`~wrappers.policies.LLMWrapperBase.act`
and :class:`~wrappers.token_policy.TokenStepPolicy` take them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from chatenv.history import History

__all__ = ["check_id_tensor", "id_row", "split_observations"]

_HINTS = {
    "text": "text prompts are read by input_mode='text'",
    "history": "chats (lists of message dicts) are read by input_mode='history'",
    "tokens": "token ids are read by input_mode='tokens'",
}


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_scalar(x: Any) -> bool:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim == 0
    return isinstance(x, (int, float, np.number, np.bool_))


def _is_chat(value: Any) -> bool:
    """A message dict, a chat (a non-empty list of message dicts) or a :class:`History`."""
    if isinstance(value, (Mapping, History)):
        return True
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and isinstance(value[0], Mapping)


def _kind(value: Any) -> str:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"{type(value).__name__} of dtype {value.dtype} and shape {tuple(value.shape)}"
    return type(value).__name__


def check_id_tensor(value: torch.Tensor | np.ndarray, what: str) -> None:
    """Refuse an id tensor or array that does not hold integers (floats are never rounded to ids).

    Raises:
        TypeError: For a float, bool, complex or object dtype (NaN named when the floats hold some).
    """
    dtype = value.dtype
    if isinstance(value, np.ndarray):
        integer, floating = np.issubdtype(dtype, np.integer), np.issubdtype(dtype, np.floating)
    else:
        floating = dtype.is_floating_point
        integer = not floating and not dtype.is_complex and dtype != torch.bool
    if integer:
        return
    nan = ""
    if floating:
        floats = torch.as_tensor(value)
        nan = " holding NaN" if bool(torch.isnan(floats.values() if floats.is_nested else floats).any()) else ""
    raise TypeError(
        f"{what}: token ids must be integers, got dtype {dtype}{nan}; ids are never rounded or truncated, pass an "
        "integer (int64) tensor or array"
    )


def _sequence_ids(value: Sequence, what: str) -> list[int]:
    ids = []
    for pos, x in enumerate(value):
        if isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 0:
            check_id_tensor(x, f"{what}, position {pos}")
            x = x.item()
        if _is_int(x):
            ids.append(int(x))
        elif isinstance(x, (bool, np.bool_)):
            raise TypeError(f"{what}: token ids must be integers, got the bool {x!r} at position {pos}")
        elif _is_scalar(x):
            raise TypeError(
                f"{what}: token ids must be integers, got {x!r} ({type(x).__name__}) at position {pos}; ids are "
                "never rounded or truncated"
            )
        else:
            raise TypeError(
                f"{what}: expected a flat sequence of integer token ids, got a {_kind(x)} at position {pos} (a nested "
                "or ragged list); give one list of ids per observation"
            )
    return ids


def id_row(value: Any, what: str, mode: str = "tokens") -> list[int]:
    """One sequence of token ids (a list, tuple, 1-D array or 1-D tensor of integers) as a list of int.

    Args:
        value: The ids.
        what: What ``value`` is, for error messages (e.g. ``"observation 0"``).
        mode: The input mode of the reader, for the hint on text and chats (``"tokens"``; none otherwise).

    Raises:
        TypeError: For text, message dicts, floats (never truncated), bools or nested lists.
        ValueError: For an array or tensor that is not 1-D.

    Example:
        >>> id_row(np.array([1, 2, 3]), "observation 0")
        [1, 2, 3]
        >>> id_row([1, 2.5], "row 0")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: row 0: token ids must be integers, got 2.5 (float) at position 1; ids are never rounded...
    """
    if isinstance(value, (str, bytes)):
        hint = f"; {_HINTS['text']}" if mode == "tokens" else ""
        raise TypeError(f"{what}: expected token ids, got a str ({value[:40]!r}){hint}")
    if _is_chat(value):
        hint = f"; {_HINTS['history']}" if mode == "tokens" else ""
        raise TypeError(f"{what}: expected token ids, got message dicts (a chat){hint}")
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if isinstance(value, torch.Tensor) and value.is_nested:
            raise ValueError(f"{what}: expected a 1-D sequence of token ids, got a nested tensor")
        check_id_tensor(value, what)
        if value.ndim != 1:
            raise ValueError(
                f"{what}: expected a 1-D sequence of token ids, got shape {tuple(value.shape)}; one observation is "
                "one sequence of ids (give a batch as a list of them)"
            )
        return value.tolist()
    if isinstance(value, Sequence):
        return _sequence_ids(value, what)
    raise TypeError(f"{what}: expected a sequence of integer token ids, got {_kind(value)}")


# ------------------------------------------------------------------------------------ observations


def _split_tokens(observations: Any) -> tuple[bool, list]:
    if isinstance(observations, (str, bytes)) or _is_chat(observations):
        id_row(observations, "tokens mode observations")
    if isinstance(observations, (torch.Tensor, np.ndarray)) and not getattr(observations, "is_nested", False):
        check_id_tensor(observations, "tokens mode observations")
        if observations.ndim == 1:
            return True, [torch.as_tensor(id_row(observations, "observation 0"), dtype=torch.long)]
        if observations.ndim != 2:
            raise ValueError(
                f"tokens mode observations: expected one 1-D sequence of ids or a (B, T) batch of them, got shape "
                f"{tuple(observations.shape)}"
            )
    if not isinstance(observations, (Sequence, torch.Tensor, np.ndarray)):
        raise TypeError(f"tokens mode: expected token ids or a list of them, got {_kind(observations)}")
    if len(observations) and all(_is_scalar(x) for x in observations):
        return True, [torch.as_tensor(id_row(observations, "observation 0"), dtype=torch.long)]
    rows = [id_row(o, f"observation {b}") for b, o in enumerate(observations)]
    return False, [torch.as_tensor(r, dtype=torch.long) for r in rows]


def _split_text(observations: Any) -> tuple[bool, list]:
    if isinstance(observations, str):
        return True, [observations]
    if _is_chat(observations):
        raise TypeError(f"text mode: expected prompt text, got message dicts (a chat); {_HINTS['history']}")
    if not isinstance(observations, Sequence):
        raise TypeError(f"text mode: expected a prompt (str) or a list of them, got {_kind(observations)}")
    for b, o in enumerate(observations):
        if not isinstance(o, str):
            hint = _HINTS["tokens"] if _is_scalar(o) or isinstance(o, (Sequence, np.ndarray, torch.Tensor)) else ""
            hint = _HINTS["history"] if _is_chat(o) else hint
            raise TypeError(f"text mode: observation {b} must be a str, got {_kind(o)}" + (f"; {hint}" if hint else ""))
    return False, list(observations)


def _check_history(observations: Any) -> None:
    if isinstance(observations, str):
        raise TypeError(f"history mode: expected a chat (a list of message dicts), got a str; {_HINTS['text']}")
    ids = isinstance(observations, (torch.Tensor, np.ndarray)) or (
        isinstance(observations, Sequence) and bool(observations) and all(_is_scalar(x) for x in observations)
    )
    if ids:
        raise TypeError(f"history mode: expected a chat (a list of message dicts), got token ids; {_HINTS['tokens']}")


def split_observations(mode: Any, observations: Any) -> tuple[bool, list]:
    """``(single, batch)``: whether ``observations`` is one observation, and the batch as a list.

    In tokens mode every observation is checked and returned as an int64 tensor; in text mode every one must be
    a str; history mode checks for text and token ids and leaves chats to the mode (see
    :meth:`chatenv.modes.InputMode.split_batch`).

    Args:
        mode: The input mode object (:func:`chatenv.modes.get_mode`).
        observations: One observation or a batch (list) of them.

    Raises:
        TypeError: For observations of another input mode (with the mode that reads them) or ids that are not
            integers.
        ValueError: For id arrays of the wrong shape.
    """
    if mode.name == "tokens":
        return _split_tokens(observations)
    if mode.name == "text":
        return _split_text(observations)
    _check_history(observations)
    return mode.split_batch(observations)
