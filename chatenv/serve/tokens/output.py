"""Replies of the token routes, in vLLM's shapes: ``/inference/v1/generate``, ``/tokenize``, ``/detokenize``.

A generate reply is vLLM's tokens-mode response: per choice its generated ``token_ids`` (the end-of-turn id
included when sampled), ``finish_reason`` (``stop`` or ``length``) and ``logprobs.content``, one entry per
generated id, its token written as ``token_id:<id>`` (with the id also as ``token_id``: older and newer vLLM
clients each read theirs); ``prompt_token_ids`` are the ids the replies were generated after.
"""

from __future__ import annotations

import math
import time
from typing import Any

from chatenv.serve.service import Completion
from chatenv.serve.tokens.extras import token_label
from chatenv.serve.tokens.request import GenerateRequest

__all__ = ["generate_body", "tokenize_body"]


def _entry(token_id: int, log_prob: float) -> dict[str, Any]:
    lp = -9999.0 if math.isnan(log_prob) else float(log_prob)
    return {"token": token_label(token_id), "token_id": token_id, "logprob": lp, "bytes": None, "top_logprobs": []}


def generate_body(request: GenerateRequest, done: Completion) -> dict[str, Any]:
    """The JSON reply of a served generate request."""
    completion = sum(len(c.ids) for c in done.choices)
    return {
        "request_id": request.request_id or done.meta["id"],
        "model": done.meta["model"],
        "created": int(time.time()),
        "output_mode": "tokens",
        "prompt_token_ids": list(request.token_ids),
        "choices": [
            {
                "index": k,
                "finish_reason": "length" if c.finish_reason == "length" else "stop",
                "stop_reason": c.stop_string,
                "token_ids": list(c.ids),
                "logprobs": {"content": [_entry(i, lp) for i, lp in zip(c.ids, c.log_probs)]},
            }
            for k, c in enumerate(done.choices)
        ],
        "usage": {
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": done.prompt_tokens + completion,
        },
    }


def tokenize_body(ids: list[int], max_model_len: int, token_strs: list[str] | None) -> dict[str, Any]:
    """The ``/tokenize`` reply, in vLLM's shape."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}
