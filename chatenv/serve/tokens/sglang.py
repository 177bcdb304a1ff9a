"""``POST /generate`` in SGLang's native shape: ids in (``input_ids``), ids and log-probs out (``meta_info``).

What slime's rollout sends to SGLang (and SkyRL's SGLang engine): ``input_ids`` (one prompt, or a batch of them),
``sampling_params`` with SGLang's names (``max_new_tokens``, ``min_new_tokens``, ``temperature``, ``top_p``,
``top_k`` (-1: off), ``min_p``, penalties, ``stop``, ``stop_token_ids`` (the template's end-of-reply ids only),
``n``, ``sampling_seed``; ``skip_special_tokens``, ``spaces_between_special_tokens`` and ``no_stop_trim`` change
nothing here) and ``return_logprob``. Each prompt is read as a chat and checked against its session like every
token route (:mod:`chatenv.serve.tokens.prompt`). The reply per prompt: ``text``, ``output_ids`` (the sampled ids,
the end-of-turn id included) and ``meta_info`` (``id``, ``finish_reason`` ``{"type": "stop" | "length", ...}``,
``prompt_tokens``, ``completion_tokens``, and with ``return_logprob`` ``output_token_logprobs``: one
``[logprob, id, null]`` per sampled id); a batch gets a list, one entry per prompt and reply.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.request import ChatRequest, flag, sampling_settings
from chatenv.serve.tokens.request import ids_field

__all__ = ["SGLangRequest", "parse_sglang", "sglang_body"]

#: SGLang's sampling names -> the chat route's
_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "n": "n",
    "sampling_seed": "seed",
}
_PARAM_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "skip_special_tokens": (None, True, False),
    "spaces_between_special_tokens": (None, True, False),
    "no_stop_trim": (None, True, False),  # the ids are never trimmed; the text is cut at a stop string
    "ignore_eos": (None, False),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "logit_bias": (None, {}),
    "custom_params": (None, {}),
}
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "text": (None,),
    "image_data": (None, []),
    "top_logprobs_num": (None, 0),
    "logprob_start_len": (None, -1),
    "return_text_in_logprobs": (None, False),
    "return_hidden_states": (None, False),
    "return_routed_experts": (None, False),
    "lora_path": (None,),
}
_HANDLED = {"input_ids", "sampling_params", "return_logprob", "rid", "model"}


@dataclass
class SGLangRequest:
    """A checked SGLang ``/generate`` request."""

    prompts: list[list[int]]
    batch: bool
    request: ChatRequest
    stop_token_ids: list[int] = field(default_factory=list)

    def for_prompt(self, messages: list[dict[str, Any]], ids: list[int]) -> ChatRequest:
        """The chat request of one prompt (its chat read from its ids)."""
        r = self.request
        return ChatRequest(
            model=r.model,
            messages=messages,
            settings=r.settings,
            logprobs=True,
            return_token_ids=True,
            prompt_ids=list(ids),
        )


def _check(body: Mapping[str, Any], what: str, handled: set[str], defaults: Mapping[str, tuple[Any, ...]]) -> None:
    unknown = sorted(k for k in body if k not in handled and k not in defaults)
    if unknown:
        raise APIError(f"unsupported parameters in {what}: {unknown}", param=unknown[0], code="unsupported_parameter")
    for name, allowed in defaults.items():
        if body.get(name) not in allowed:
            raise APIError(
                f"{name}={body[name]!r} is not supported by this endpoint (accepted: {list(allowed)})",
                param=name,
                code="unsupported_parameter",
            )


def parse_sglang(body: Any, model: str) -> SGLangRequest:
    """Check an SGLang ``/generate`` body (``model``: the served model, for the replies).

    Raises:
        APIError: For a bad or unsupported field (named).
    """
    if not isinstance(body, Mapping):
        raise APIError("the request body must be a JSON object")
    _check(body, "the request body", _HANDLED, _DEFAULTS)
    params = body.get("sampling_params") or {}
    if not isinstance(params, Mapping):
        raise APIError("'sampling_params' must be an object", param="sampling_params")
    _check(params, "sampling_params", {*_NAMES, "stop_token_ids"}, _PARAM_DEFAULTS)
    value = body.get("input_ids")
    batch = isinstance(value, list) and bool(value) and all(isinstance(p, list) for p in value)
    if batch:
        prompts = [ids_field(p, f"input_ids[{k}]") for k, p in enumerate(value or [])]
    else:
        prompts = [ids_field(value, "input_ids")]
    try:
        settings = sampling_settings({_NAMES[k]: v for k, v in params.items() if k in _NAMES})
    except APIError as e:
        name = next((k for k, v in _NAMES.items() if v == e.param), e.param)
        raise APIError(str(e), param=f"sampling_params.{name}") from None
    request = ChatRequest(model=model, messages=[], settings=settings, logprobs=flag(body, "return_logprob"))
    stops = ids_field(params.get("stop_token_ids"), "sampling_params.stop_token_ids", empty=True)
    return SGLangRequest(prompts, batch, request, stops)


def _reply(parsed: SGLangRequest, completion: Any, choice: Any) -> dict[str, Any]:
    ct = completion.chat_tokenizer
    end, _ = ct.reply_end(choice.ids)
    text = ct.decode(choice.ids if end is None else choice.ids[:end])
    if choice.stop_string is not None and choice.stop_string in text:
        text = text[: text.find(choice.stop_string)]
    if choice.finish_reason == "length":
        finish: dict[str, Any] = {"type": "length", "length": len(choice.ids)}
    else:
        finish = {"type": "stop", "matched": choice.stop_string or (choice.ids[-1] if choice.ids else None)}
    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "finish_reason": finish,
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": len(choice.ids),
        "cached_tokens": 0,
    }
    if parsed.request.logprobs:
        meta["output_token_logprobs"] = [
            [-9999.0 if math.isnan(lp) else float(lp), i, None] for i, lp in zip(choice.ids, choice.log_probs)
        ]
    return {"text": text, "output_ids": list(choice.ids), "meta_info": meta}


def sglang_body(parsed: SGLangRequest, done: list[Any]) -> Any:
    """The reply: one object for one prompt and one reply, else a list (per prompt, its ``n`` replies in order)."""
    replies = [_reply(parsed, completion, c) for completion in done for c in completion.choices]
    return replies if parsed.batch or len(replies) > 1 else replies[0]
