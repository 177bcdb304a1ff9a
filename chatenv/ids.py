"""Token ids read strictly: the one reader of "a 1-D sequence of integer token ids" that the core and wrappers share.

Floats are never rounded or truncated to ids (``1.5``, a float tensor, NaN or not); a nested, ragged or 2-D
value is never flattened; bools are not ids; an optional vocabulary bound names the first id outside it. Every
message starts with what the value is (``"observation 0"``, ``"the action"``) and names the value found, so
callers pass that name and add their own context (the input mode that reads text, say) around the call.

Wrong dtypes and shapes raise ``TypeError`` (the value is not a sequence of ids); ids outside the vocabulary
raise ``ValueError``. Emptiness is left to callers: what an empty sequence means differs (an empty reply, an empty
prompt).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

__all__ = ["check_id_dtype", "check_vocab", "token_id_array", "token_ids"]

_NEVER_ROUNDED = "ids are never rounded or truncated"
_INT64_MAX = np.iinfo(np.int64).max


def _kind(value: Any) -> str:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"{type(value).__name__} of dtype {value.dtype} and shape {tuple(value.shape)}"
    return type(value).__name__


def _is_id(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check_id_dtype(value: torch.Tensor | np.ndarray, what: str) -> None:
    """Refuse a tensor or array of any shape (nested tensors too) whose dtype is not an integer type.

    Args:
        value: The ids.
        what: What ``value`` is, for the message.

    Raises:
        TypeError: For a float (NaN named when the floats hold some), bool, complex or object dtype.

    Example:
        >>> check_id_dtype(np.array([[1, 2]]), "batch")
        >>> check_id_dtype(np.array([1.0, np.nan]), "batch")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: batch must be integer token ids, got float64 holding NaN; ids are never rounded or truncated, ...
    """
    dtype = value.dtype
    if isinstance(value, np.ndarray):
        integer, floating = np.issubdtype(value.dtype, np.integer), np.issubdtype(value.dtype, np.floating)
    else:
        floating = value.dtype.is_floating_point
        integer = not floating and not value.dtype.is_complex and value.dtype != torch.bool
    if integer:
        return
    nan = ""
    if floating:
        nan = " holding NaN" if _holds_nan(value) else ""
    fix = f"{_NEVER_ROUNDED}, pass" if floating else "pass"
    raise TypeError(f"{what} must be integer token ids, got {dtype}{nan}; {fix} an integer (int64) tensor or array")


def _holds_nan(value: torch.Tensor | np.ndarray) -> bool:
    """Whether a float tensor or array (a nested tensor too) holds a NaN."""
    if isinstance(value, np.ndarray):
        return bool(np.isnan(value).any())
    return bool(torch.isnan(value.values() if value.is_nested else value.detach()).any())


def check_vocab(ids: Any, vocab_size: int, what: str, *, owner: str | None = None) -> None:
    """Refuse ids outside ``[0, vocab_size)``, naming the first one and its position.

    Args:
        ids: Integer ids (a list or an integer array), already read (see :func:`token_id_array`).
        vocab_size: Number of ids the vocabulary holds.
        what: What ``ids`` is, for the message.
        owner: Whose vocabulary it is (e.g. ``"the model"``), if worth naming.

    Raises:
        ValueError: For the first id outside the vocabulary.

    Example:
        >>> check_vocab([5, 12], 10, "row 0")
        Traceback (most recent call last):
        ...
        ValueError: token id 12 in row 0 is outside the vocabulary [0, 10) (at position 1)
    """
    arr = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if arr.size == 0:
        return
    bad = (arr < 0) | (arr >= vocab_size)
    if bad.any():
        j = int(bad.argmax())
        of = f" of {owner}" if owner else ""
        raise ValueError(
            f"token id {int(arr[j])} in {what} is outside the vocabulary [0, {vocab_size}){of} (at position {j})"
        )


def _tensor_ids(value: torch.Tensor | np.ndarray, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor) and value.is_nested:
        raise TypeError(f"{what} must be a 1-D sequence of token ids, got a nested tensor")
    check_id_dtype(value, what)
    if value.ndim != 1:
        raise TypeError(f"{what} must be a 1-D sequence of token ids, got shape {tuple(value.shape)}")
    arr = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
        raise ValueError(f"token id {int(arr.max())} in {what} does not fit int64")
    return arr.astype(np.int64, copy=False)


def _element(x: Any, pos: int, what: str) -> int:
    """One element of a sequence of ids, as an int."""
    if isinstance(x, (torch.Tensor, np.ndarray)) and x.ndim == 0:
        x = x.item()  # a Python int, float, bool or complex: checked below like one
    if _is_id(x):
        return int(x)
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{what} must be integer token ids, got the bool {x!r} at position {pos}")
    if isinstance(x, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(x, (str, bytes)):
        raise TypeError(
            f"{what} must be a 1-D sequence of token ids, got a {_kind(x)} at position {pos} (a nested or ragged list)"
        )
    rounded = f"; {_NEVER_ROUNDED}" if isinstance(x, (float, complex, np.number)) else ""
    raise TypeError(f"{what} must be integer token ids, got {x!r:.40} ({type(x).__name__}) at position {pos}{rounded}")


def _sequence_ids(value: Sequence[Any] | np.ndarray, what: str) -> np.ndarray:
    ids = [_element(x, pos, what) for pos, x in enumerate(value)]
    try:
        return np.array(ids, dtype=np.int64)
    except OverflowError:
        bad = next(i for i in ids if not -_INT64_MAX - 1 <= i <= _INT64_MAX)
        raise ValueError(f"token id {bad} in {what} does not fit int64") from None


def token_id_array(value: Any, what: str, *, vocab_size: int | None = None, owner: str | None = None) -> np.ndarray:
    """One sequence of token ids (a list, tuple, 1-D array or 1-D tensor of integers) as a 1-D int64 array.

    Args:
        value: The ids.
        what: What ``value`` is, for messages (e.g. ``"observation 0"``).
        vocab_size: If given, every id must lie in ``[0, vocab_size)``.
        owner: Whose vocabulary it is, for the message (see :func:`check_vocab`).

    Returns:
        The ids (an array given as int64 is returned as is, not copied).

    Raises:
        TypeError: For text, message dicts, floats (never truncated), bools, or values that are not one 1-D
            sequence (2-D arrays, nested or ragged lists, nested tensors, scalars).
        ValueError: For an id outside the vocabulary (or outside int64).
    """
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be token ids, got a {type(value).__name__} ({value[:40]!r}); tokenize text first")
    if isinstance(value, Mapping) or (isinstance(value, Sequence) and len(value) > 0 and isinstance(value[0], Mapping)):
        raise TypeError(f"{what} must be token ids, got message dicts (a chat); tokenize the chat first")
    if isinstance(value, torch.Tensor) or (isinstance(value, np.ndarray) and value.dtype != object):
        arr = _tensor_ids(value, what)
    elif isinstance(value, (Sequence, np.ndarray)):
        if isinstance(value, np.ndarray) and value.ndim != 1:
            raise TypeError(f"{what} must be a 1-D sequence of token ids, got shape {tuple(value.shape)}")
        arr = _sequence_ids(value, what)
    else:
        raise TypeError(f"{what} must be a sequence of integer token ids, got {_kind(value)}")
    if vocab_size is not None:
        check_vocab(arr, vocab_size, what, owner=owner)
    return arr


def token_ids(value: Any, what: str, *, vocab_size: int | None = None, owner: str | None = None) -> list[int]:
    """One sequence of token ids as a list of int (see :func:`token_id_array` for what is accepted and refused).

    Example:
        >>> token_ids(np.array([1, 2, 3]), "observation 0")
        [1, 2, 3]
        >>> token_ids([1, 2.5], "row 0")
        Traceback (most recent call last):
        ...
        TypeError: row 0 must be integer token ids, got 2.5 (float) at position 1; ids are never rounded or truncated
    """
    return cast(list[int], token_id_array(value, what, vocab_size=vocab_size, owner=owner).tolist())
