"""Constrained decoding and reported alternatives for the transformers backend.

:class:`GrammarProcessor` is a ``generate`` logits processor that removes, at every step and for every row, the
tokens a grammar (``grammar`` in :class:`~chatenv.sampling.GenerationSettings`, e.g. a forced tool call from
:mod:`chatenv.templates.forced_calls`) forbids after the row's tokens so far; once the grammar is complete only the
stop ids remain. It runs before the temperature and the top-k/top-p/min-p filters (``generate`` applies custom
processors first), as vLLM applies its grammar bitmask before its sampler: the distribution sampled from is the
policy's, restricted to the allowed tokens and renormalized. It keeps each step's bitmask, so log-probs reported
from the model's own logits (greedy decoding, ``raw_log_probs=True``) are restricted the same way
(:func:`step_log_probs`): on either backend a forced token's log-prob is its log-prob under the restricted
distribution (0 where the grammar allows one token only).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["GrammarProcessor", "step_log_probs"]


@functools.lru_cache(maxsize=8)
def _tokenizer_info(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...]) -> Any:
    import xgrammar as xg

    return xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))


@functools.lru_cache(maxsize=32)
def _compiled(tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...], grammar: str) -> Any:
    try:
        import xgrammar as xg
    except ImportError as e:
        from chatenv.errors import MissingDependencyError

        raise MissingDependencyError(
            "constrained decoding (generate_kwargs['grammar'], forced tool calls) needs xgrammar: pip install xgrammar"
        ) from e
    return xg.GrammarCompiler(_tokenizer_info(tokenizer, vocab_size, stop_ids)).compile_grammar(grammar)


class GrammarProcessor:
    """``generate`` logits processor: each row's next token restricted to what the grammar allows after its tokens.

    Args:
        tokenizer: The policy's Hugging Face tokenizer.
        vocab_size: The model's vocabulary size (the logits' last dimension).
        stop_ids: The ids that end a reply (allowed once the grammar is complete).
        grammar: The EBNF grammar (xgrammar's dialect).

    Attributes:
        masks: Per step, the ``(rows, words)`` bitmask applied (for log-probs of the raw logits).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int], grammar: str):
        self.compiled = _compiled(tokenizer, vocab_size, tuple(stop_ids), grammar)
        self.vocab_size = vocab_size
        self.matchers: list[Any] = []
        self.masks: list[torch.Tensor] = []
        self.prompt_width = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # noqa: D102
        import xgrammar as xg

        rows = scores.shape[0]
        if not self.matchers:
            self.matchers = [xg.GrammarMatcher(self.compiled) for _ in range(rows)]
            self.prompt_width = input_ids.shape[1]
        elif input_ids.shape[1] > self.prompt_width:
            for row, token in enumerate(input_ids[:, -1].tolist()):
                matcher = self.matchers[row]
                if not matcher.is_terminated() and not matcher.accept_token(int(token)):
                    raise RuntimeError(f"the grammar refused token {token} it allowed (row {row})")
        bitmask = xg.allocate_token_bitmask(rows, self.vocab_size)
        for row, matcher in enumerate(self.matchers):
            if not matcher.is_terminated():  # a finished row's padding is not the grammar's
                matcher.fill_next_token_bitmask(bitmask, row)
        self.masks.append(bitmask)
        out = scores.clone()
        xg.apply_token_bitmask_inplace(out, bitmask.to(out.device))
        return out

    def allowed(self, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``(rows, vocab)`` bool: the tokens allowed at ``step``."""
        bits = self.masks[step]
        shifts = torch.arange(32, dtype=torch.int32)
        unpacked = (bits.unsqueeze(-1) >> shifts).bitwise_and(1).bool().reshape(bits.shape[0], -1)
        return unpacked[:, : self.vocab_size].to(device)


def step_log_probs(
    steps: Sequence[torch.Tensor], generated: torch.Tensor, top: int = 0, grammar: GrammarProcessor | None = None
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Log-probs of the generated ids under the per-step logits ``generate`` returned, and the ``top`` best.

    Args:
        steps: Per step, ``(N, V)`` logits.
        generated: ``(N, R)`` generated ids.
        top: How many most likely tokens to report per step (0: none).
        grammar: The grammar processor that restricted the steps (its masks are applied to logits it did not see).

    Returns:
        ``(N, R)`` log-probs, and for ``top > 0`` ``((N, R, top) ids, (N, R, top) log-probs)`` in decreasing order
        (alternatives the distribution excludes hold id -1 and log-prob -inf).
    """
    chosen, top_ids, top_lps = [], [], []
    for t, step in enumerate(steps):
        step = step.float()
        if grammar is not None and t < len(grammar.masks):
            step = step.masked_fill(~grammar.allowed(t, step.device), -torch.inf)
        lp = step - step.logsumexp(-1, keepdim=True)
        chosen.append(lp.gather(-1, generated[:, t : t + 1].to(lp.device)).squeeze(-1).cpu())
        if top:
            values, ids = lp.topk(min(top, lp.shape[-1]), dim=-1)
            top_ids.append(torch.where(values.isfinite(), ids, -1).cpu())
            top_lps.append(values.cpu())
    n = generated.shape[0]
    log_probs = torch.stack(chosen, dim=1) if chosen else torch.zeros(n, 0)
    if not top:
        return log_probs, None
    if not top_ids:
        return log_probs, (torch.zeros(n, 0, top, dtype=torch.long), torch.zeros(n, 0, top))
    return log_probs, (torch.stack(top_ids, dim=1), torch.stack(top_lps, dim=1))
