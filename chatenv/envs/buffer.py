"""The token view of an episode as growing arrays, so a step costs what it adds, not the length of the chat.

:class:`TokenBuffer` keeps the ids, the assistant mask and the generation log-probs (NaN where none) in numpy
arrays whose capacity doubles when full:
appending ``k`` tokens costs O(k) (amortised); reading the view is one contiguous copy (a ``memcpy``, no Python
objects per token). The text view, when kept, is a list of pieces joined once per change.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["TokenBuffer"]


class TokenBuffer:
    """Append-only token ids with their assistant mask and log-probs (and optionally their text).

    Args:
        ids: The first ids.
        mask: Their assistant mask.
        text: Their text, or None to keep no text view.
    """

    def __init__(
        self,
        ids: Sequence[int] | npt.NDArray[np.int64],
        mask: Sequence[bool] | npt.NDArray[np.bool_],
        text: str | None = None,
    ):
        capacity = max(256, 2 * len(ids))
        self._ids: npt.NDArray[np.int64] = np.empty(capacity, dtype=np.int64)
        self._mask: npt.NDArray[np.bool_] = np.empty(capacity, dtype=bool)
        self._lps: npt.NDArray[np.float64] = np.empty(capacity, dtype=np.float64)
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
        for name in ("_ids", "_mask", "_lps"):
            old = getattr(self, name)
            new = np.empty(capacity, dtype=old.dtype)
            new[: self._n] = old[: self._n]
            setattr(self, name, new)

    def extend(
        self,
        ids: Sequence[int] | npt.NDArray[np.int64],
        mask: Sequence[bool] | npt.NDArray[np.bool_],
        text: str = "",
        log_probs: Sequence[float] | None = None,
    ) -> None:
        """Append ids with their mask, their log-probs (NaN when None) and text (when a text view is kept)."""
        k = len(ids)
        if len(mask) != k or (log_probs is not None and len(log_probs) != k):
            given = "" if log_probs is None else f", {len(log_probs)} log-probs"
            raise ValueError(f"ids, mask and log-probs differ in length ({k} ids, {len(mask)} mask values{given})")
        self._reserve(self._n + k)
        self._ids[self._n : self._n + k] = ids
        self._mask[self._n : self._n + k] = mask
        self._lps[self._n : self._n + k] = np.nan if log_probs is None else log_probs
        self._n += k
        if self._pieces is not None and text:
            self._pieces.append(text)
            self._joined = None

    def ids(self, extra: Sequence[int] = ()) -> npt.NDArray[np.int64]:
        """A copy of the ids, followed by ``extra`` ids (a reply in progress) if given."""
        if not len(extra):
            view: npt.NDArray[np.int64] = self._ids[: self._n].copy()
            return view
        out = np.empty(self._n + len(extra), dtype=np.int64)
        out[: self._n] = self._ids[: self._n]
        out[self._n :] = extra
        return out

    def mask(self, extra: int = 0) -> npt.NDArray[np.bool_]:
        """A copy of the assistant mask, followed by ``extra`` True values (a reply in progress)."""
        if not extra:
            view: npt.NDArray[np.bool_] = self._mask[: self._n].copy()
            return view
        out = np.ones(self._n + extra, dtype=bool)
        out[: self._n] = self._mask[: self._n]
        return out

    def log_probs(self) -> npt.NDArray[np.float64]:
        """A copy of the log-probs (NaN on ids with none: prompts, markup, replies given without them)."""
        view: npt.NDArray[np.float64] = self._lps[: self._n].copy()
        return view

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
