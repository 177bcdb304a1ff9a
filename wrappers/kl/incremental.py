"""Incremental reference scoring: a sequence that extends one scored before costs a forward over its new tokens only.

The token-level env asks for the reference log-probs of ``context + [token]`` at every step, and the turn-level env
for ``context + reply`` at every turn, where each context extends the sequence scored one step before. A full
forward per step makes a reply of ``T`` tokens cost O(T²); :class:`IncrementalScorer` keeps the KV cache (and the
last position's log-probs) of the last few sequences it scored and runs the model over the new tokens only.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["IncrementalScorer"]


@dataclass
class _Entry:
    """One scored sequence: its ids, log-prob row, KV cache and the log-probs of the token after it."""

    ids: list[int]
    row: torch.Tensor  # (T,) float32, NaN at 0
    cache: Any  # the model's KV cache over ``ids``
    next_log_probs: torch.Tensor  # (V,) float32: log p(x_T = v | ids)


def _extends(seq: list[int], ids: list[int]) -> bool:
    return len(ids) <= len(seq) and seq[: len(ids)] == ids


class IncrementalScorer:
    """Log-probs of single sequences, reusing the KV cache of a sequence they extend.

    Gives the numbers of a full forward pass (to float rounding) of ``model`` at ``temperature``.

    Args:
        model: A transformers causal LM (in eval mode; its weights must not change while entries are kept: call
            :meth:`clear` after changing them).
        temperature: The reference temperature (logits are divided by it).
        size: How many sequences keep their cache (least recently used first out); each costs the memory of its
            KV cache.

    Example:
        A step of the token-level env scores the previous step's sequence plus one token: one position of
        forward work instead of the whole context.
    """

    def __init__(self, model: Any, temperature: float, size: int):
        self.model = model
        self.temperature = float(temperature)
        self.size = int(size)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_key = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles carry the model and settings, not the kept caches or the lock."""
        return {"model": self.model, "temperature": self.temperature, "size": self.size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["model"], state["temperature"], state["size"])

    def clear(self) -> None:
        """Drop every kept cache (frees their memory)."""
        with self._lock:
            self._entries.clear()

    def score(self, seq: list[int]) -> torch.Tensor:
        """The ``(T,)`` float32 log-probs of ``seq`` (position 0 is NaN), from a kept cache where one fits.

        Safe to call from several threads (calls run one at a time).
        """
        with self._lock:
            for key, entry in self._entries.items():
                if _extends(entry.ids, seq):  # scored already, alone or as the start of a longer sequence
                    self._entries.move_to_end(key)
                    return entry.row[: len(seq)].clone()
            key, entry = self._longest_prefix(seq)
            if entry is not None:
                del self._entries[key]  # the cache is extended in place: it now belongs to ``seq``
            new = self._extend(entry, seq)
            self._keep(new)
            return new.row.clone()

    def _longest_prefix(self, seq: list[int]) -> tuple[int | None, _Entry | None]:
        """The kept entry with the longest ids that ``seq`` extends, if any."""
        best: tuple[int | None, _Entry | None] = (None, None)
        for key, entry in self._entries.items():
            if _extends(seq, entry.ids) and (best[1] is None or len(entry.ids) > len(best[1].ids)):
                best = (key, entry)
        return best

    def _keep(self, entry: _Entry) -> None:
        if self.size < 1 or not hasattr(entry.cache, "get_seq_length"):
            return
        self._entries[self._next_key] = entry
        self._next_key += 1
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def _extend(self, entry: _Entry | None, seq: list[int]) -> _Entry:
        """Score ``seq`` from ``entry`` (a prefix of it with its cache), or from scratch."""
        start = 0 if entry is None else len(entry.ids)
        device = next(self.model.parameters()).device
        ids = torch.tensor([seq[start:]], dtype=torch.long, device=device)  # (1, n) the new tokens
        with torch.inference_mode():
            out = self.model(input_ids=ids, past_key_values=None if entry is None else entry.cache, use_cache=True)
            logits = out.logits[0].float() / self.temperature  # (n, V): row j predicts seq[start + j + 1]
            norm = logits.logsumexp(-1, keepdim=True)  # (n, 1)
            targets = ids[0, 1:].unsqueeze(-1)  # (n - 1, 1)
            new = (logits[:-1].gather(-1, targets) - norm[:-1]).squeeze(-1).cpu()  # (n - 1,)
            last = (logits[-1] - norm[-1]).cpu()  # (V,)
        if entry is None:
            head = torch.tensor([math.nan])
        else:
            head = torch.cat([entry.row, entry.next_log_probs[seq[start]].reshape(1)])
        row = torch.cat([head, new.float()])  # (T,)
        return _Entry(list(seq), row, out.past_key_values, last.float())
