"""Output assembly: generated or scored rows written into the :mod:`chatenv.containers`.

Whatever the backend, outputs satisfy ``prompt + response == full``; masks and log-probs have the shape of
``tokens.full``; positions without a log-prob hold NaN. With ``num_samples`` every container has batch shape
``(B, num_samples)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, lazy_stack

from chatenv.containers import LogProbs, Masks, Tokens
from chatenv.modes import ViewRow, get_mode
from chatenv.tokenization import ChatTokenizer
from wrappers.policies.config import PolicyConfig
from wrappers.policies.inputs import Row

__all__ = ["TOP_LOG_PROBS_KEY", "OutputWriter", "Sample"]

#: the output key of the top log-probs (``generate_kwargs["top_logprobs"]``): ``ids`` and ``log_probs``, each
#: ``(*batch, R, k)`` padded right over the response (id -1, log-prob NaN past a reply's end)
TOP_LOG_PROBS_KEY = "top_log_probs"


@dataclass
class Sample:
    """One generated response.

    Attributes:
        ids: The generated ids (the stop token included, padding excluded).
        log_probs: ``(len(ids),)`` float32 log-probs of those ids, or None when not requested.
        finished: Whether the response stopped by itself (stop token or string) rather than at the token limit.
        top: With ``top_logprobs``: ``((len(ids), k) ids, (len(ids), k) log-probs)`` of the k most likely tokens at
            each step, under the distribution the log-probs are reported for (id -1, log-prob -inf: none there).
    """

    ids: list[int]
    log_probs: torch.Tensor | None
    finished: bool
    top: tuple[torch.Tensor, torch.Tensor] | None = None


class OutputWriter:
    """Builds a policy's output containers, as its config says.

    Args:
        config: The policy's options (output keys, padding, ``num_samples``, input mode).
        chat_tokenizer: The policy's chat tokenizer (decodes text, parses replies in history mode).
        pad_token_id: The pad id of padded token tensors.
    """

    def __init__(self, config: PolicyConfig, chat_tokenizer: ChatTokenizer, pad_token_id: int):
        self.config = config
        self.chat_tokenizer = chat_tokenizer
        self.pad_token_id = pad_token_id

    def tokens(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> Tokens:
        """A :class:`Tokens` of the rows (padded or nested as configured)."""
        p = [torch.as_tensor(x, dtype=torch.long) for x in prompts]
        r = [torch.as_tensor(x, dtype=torch.long) for x in responses]
        return Tokens.from_sequences(p, r, padded=self.config.pad_output, pad_value=self.pad_token_id)

    def scored(self, rows: Sequence[Row], log_probs: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], dict]:
        """Outputs of scoring: ``(batch shape, {key: container})``; ``log_probs`` holds one ``(T,)`` per row."""
        c = self.config
        splits = [r.split for r in rows]
        tokens = self.tokens([r.ids[: r.split] for r in rows], [r.ids[r.split :] for r in rows])
        out: dict[Any, Any] = {c.tokens_key: tokens}
        if c.masks_key is not None:
            out[c.masks_key] = Masks.from_tokens(tokens, [torch.tensor(r.assistant, dtype=torch.bool) for r in rows])
        if c.log_probs_key is not None:
            out[c.log_probs_key] = LogProbs.from_sequences(
                [lp[:s] for lp, s in zip(log_probs, splits)],
                [lp[s:] for lp, s in zip(log_probs, splits)],
                padded=c.pad_output,
            )
        return (len(rows),), out

    def generated(self, rows: Sequence[Row], samples: Sequence[Sequence[Sample]]) -> tuple[tuple[int, ...], dict]:
        """Outputs of generation: ``(batch shape, {key: container})``; ``samples`` holds the responses per row.

        Raises:
            RuntimeError: If the backend returned another number of samples than asked for.
        """
        c = self.config
        n = c.settings.num_samples
        flat_rows = [r for r in rows for _ in range(n)]
        flat = [s for per_row in samples for s in per_row]
        if len(flat) != len(flat_rows):
            raise RuntimeError(f"the backend returned {len(flat)} samples for {len(rows)} prompts x {n}")
        built: dict[tuple[int, int], Tokens] = {}

        def tokens(sl: slice) -> Tokens:
            # built once per slice: the masks describe the same containers
            if (sl.start, sl.stop) not in built:
                built[sl.start, sl.stop] = self.tokens([r.ids for r in flat_rows[sl]], [s.ids for s in flat[sl]])
            return built[sl.start, sl.stop]

        def masks(sl: slice) -> Masks:
            assist = [
                torch.tensor(r.assistant + [True] * len(s.ids), dtype=torch.bool)
                for r, s in zip(flat_rows[sl], flat[sl])
            ]
            return Masks.from_tokens(tokens(sl), assist)

        def log_probs(sl: slice) -> LogProbs:
            # prompt positions were not scored during generation: NaN, never 0
            p = [torch.full((len(r.ids),), math.nan) for r in flat_rows[sl]]
            return LogProbs.from_sequences(p, [s.log_probs for s in flat[sl]], padded=c.pad_output)

        out: dict[Any, Any] = {c.tokens_key: self._group(tokens, len(flat))}
        if c.masks_key is not None:
            out[c.masks_key] = self._group(masks, len(flat))
        if c.return_log_probs and c.log_probs_key is not None:
            out[c.log_probs_key] = self._group(log_probs, len(flat))
        if c.settings.top_logprobs and c.return_log_probs:
            out[TOP_LOG_PROBS_KEY] = self._top(flat, len(rows))
        views = self._views(flat_rows, flat)
        for name, key in (("text", c.text_key), ("history", c.history_key)):
            if name in views and key is not None:
                out[key] = self._reshape(views[name], len(rows))
        return ((len(rows),) if c.num_samples is None else (len(rows), n)), out

    def _top(self, samples: Sequence[Sample], n_prompts: int) -> TensorDict:
        """The samples' top log-probs, padded right to the longest reply."""
        k = self.config.settings.top_logprobs
        width = max((len(s.ids) for s in samples), default=0)
        ids = torch.full((len(samples), width, k), -1, dtype=torch.long)
        lps = torch.full((len(samples), width, k), math.nan)
        for b, s in enumerate(samples):
            if s.top is not None:
                ids[b, : len(s.ids)], lps[b, : len(s.ids)] = s.top[0], s.top[1]
        top = TensorDict(ids=ids, log_probs=lps, batch_size=[len(samples)])
        return top if self.config.num_samples is None else top.reshape(n_prompts, self.config.num_samples)

    def _views(self, rows: Sequence[Row], samples: Sequence[Sample]) -> dict[str, Any]:
        """The input mode's text/chat views of the rows (see :meth:`chatenv.modes.InputMode.build_views`)."""
        mode = get_mode(self.config.input_mode)
        if not mode.views:
            return {}
        ct = self.chat_tokenizer
        history = "history" in mode.views
        return mode.build_views(
            [
                ViewRow(
                    prompt_text=r.text,
                    response_text=ct.decode(s.ids),
                    prompt_chat=r.chat,
                    reply=ct.parse_response(s.ids) if history else None,
                )
                for r, s in zip(rows, samples)
            ]
        )

    def _group(self, build: Callable[[slice], Any], n_rows: int) -> Any:
        """Build a container over all rows, shaped ``(B,)`` or ``(B, num_samples)``."""
        n = self.config.num_samples
        if n is None:
            return build(slice(0, n_rows))
        if self.config.pad_output:
            return build(slice(0, n_rows)).reshape(n_rows // n, n)
        return lazy_stack([build(slice(b, b + n)) for b in range(0, n_rows, n)])

    def _reshape(self, container: Any, n_prompts: int) -> Any:
        n = self.config.num_samples
        return container if n is None else container.reshape(n_prompts, n)
