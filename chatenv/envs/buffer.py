"""The token view of an episode as growing arrays, so a step costs what it adds, not the length of the chat.

:class:`TokenBuffer` keeps the ids and the assistant mask in numpy arrays whose capacity doubles when full:
appending ``k`` tokens costs O(k) (amortised); reading the view is one contiguous copy (a ``memcpy``, no Python
objects per token). The text view, when kept, is a list of pieces joined once per change.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["TokenBuffer"]


class TokenBuffer:
    """Append-only token ids with their assistant mask (and optionally their text).

    Args:
        ids: The first ids.
        mask: Their assistant mask.
        text: Their text, or None to keep no text view.
    """

    def __init__(self, ids: Sequence[int], mask: Sequence[bool], text: str | None = None):
        capacity = max(256, 2 * len(ids))
        self._ids = np.empty(capacity, dtype=np.int64)
        self._mask = np.empty(capacity, dtype=bool)
        self._n = 0
        self._pieces: list[str] | None = None if text is None else [text]
        self._joined: str | None = text
        self.extend(ids, mask)

    def __len__(self) -> int:
        return self._n

    def _reserve(self, total: int) -> None:
        if total <= len(self._ids):
            return
        capacity = max(total, 2 * len(self._ids))
        for name in ("_ids", "_mask"):
            old = getattr(self, name)
            new = np.empty(capacity, dtype=old.dtype)
            new[: self._n] = old[: self._n]
            setattr(self, name, new)

    def extend(self, ids: Sequence[int], mask: Sequence[bool], text: str = "") -> None:
        """Append ids with their mask (and text, when a text view is kept)."""
        k = len(ids)
        if len(mask) != k:
            raise ValueError(f"ids and mask differ in length ({k} vs {len(mask)})")
        self._reserve(self._n + k)
        self._ids[self._n : self._n + k] = ids
        self._mask[self._n : self._n + k] = mask
        self._n += k
        if self._pieces is not None and text:
            self._pieces.append(text)
            self._joined = None

    def ids(self, extra: Sequence[int] = ()) -> np.ndarray:
        """A copy of the ids, followed by ``extra`` ids (a reply in progress) if given."""
        if not len(extra):
            return self._ids[: self._n].copy()
        out = np.empty(self._n + len(extra), dtype=np.int64)
        out[: self._n] = self._ids[: self._n]
        out[self._n :] = extra
        return out

    def mask(self, extra: int = 0) -> np.ndarray:
        """A copy of the assistant mask, followed by ``extra`` True values (a reply in progress)."""
        if not extra:
            return self._mask[: self._n].copy()
        out = np.ones(self._n + extra, dtype=bool)
        out[: self._n] = self._mask[: self._n]
        return out

    @property
    def has_text(self) -> bool:
        """Whether a text view is kept."""
        return self._pieces is not None

    @property
    def text(self) -> str:
        """The text view (joined once per change)."""
        if self._pieces is None:
            raise RuntimeError("this episode keeps no text view (keep_text=False)")
        if self._joined is None:
            self._joined = "".join(self._pieces)
            self._pieces = [self._joined]
        return self._joined
