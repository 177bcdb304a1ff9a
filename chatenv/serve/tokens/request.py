"""Requests of the token routes, checked: vLLM's field names and shapes; what is supported, what is refused.

- ``POST /v1/chat/completions/tokens`` (the route prime-rl adds to vLLM, verifiers' token client calls it): a chat
  completions body (:func:`chatenv.serve.chat.request.parse_request`) plus ``tokens``, the prompt's ids.
- ``POST /inference/v1/generate`` (vLLM's tokens-in/tokens-out route, verifiers 0.4's train client): ``token_ids``,
  ``sampling_params`` (vLLM's ``SamplingParams`` names), optional ``model``, ``request_id``, ``return_token_ids``,
  ``cache_salt`` (no effect here: there is no shared prefix cache to salt) and ``priority`` (0).
- ``POST /tokenize``: ``messages`` (rendered with the policy's template, ``tools`` and ``add_generation_prompt``)
  or ``prompt`` (text, ``add_special_tokens``); ``return_token_strs``. ``POST /detokenize``: ``tokens``.

Any other field, or a value this endpoint cannot honour (``stream``, multimodal inputs, ``output_mode: "text"``,
constrained decoding, stop ids that are not the template's end of a reply, ...), is refused with 400 naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from chatenv.ids import token_ids
from chatenv.sampling import GenerationSettings
from chatenv.serve.chat.request import parse_request
from chatenv.serve.errors import APIError
from chatenv.serve.messages import chat_messages, check_tools
from chatenv.serve.request import ChatRequest, flag, sampling_settings

__all__ = [
    "GenerateRequest",
    "TokenizeRequest",
    "ids_field",
    "parse_chat_tokens",
    "parse_detokenize",
    "parse_generate",
    "parse_tokenize",
]

#: ``sampling_params`` fields read as the chat route's sampling fields of the same name
_SAMPLING = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "stop",
)
#: ``sampling_params`` fields accepted at these values only (vLLM's defaults, or values that change nothing here)
_SAMPLING_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, 0, 1),  # the sampled token's log-prob is always returned
    "skip_special_tokens": (None, True, False),  # tokens out: there is no text to skip them from
    "spaces_between_special_tokens": (None, True, False),
    "detokenize": (None, True, False),
    "include_stop_str_in_output": (None, False),
    "ignore_eos": (None, False),
    "prompt_logprobs": (None,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "structured_outputs": (None,),
    "guided_decoding": (None,),
    "truncate_prompt_tokens": (None,),
    "extra_args": (None, {}),
    "output_kind": (None,),
}
#: top-level generate fields accepted at these values only
_GENERATE_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "stream_options": (None,),
    "output_mode": (None, "tokens"),
    "priority": (None, 0),
    "features": (None,),
    "content_parts": (None, []),
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
    "reasoning_ended": (None,),
    "reasoning_parser_kwargs": (None,),
    "token_offsets": (None,),
}
_GENERATE_FIELDS = {"model", "token_ids", "sampling_params", "request_id", "return_token_ids", "cache_salt"}
_TOKENIZE_FIELDS = {
    "model",
    "messages",
    "prompt",
    "tools",
    "add_generation_prompt",
    "add_special_tokens",
    "return_token_strs",
}
_TOKENIZE_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "continue_final_message": (None, False),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
    "tool_choice": (None, "auto", "none"),
}


def _check_fields(body: Any, what: str, handled: set[str], defaults: Mapping[str, tuple[Any, ...]]) -> None:
    if not isinstance(body, Mapping):
        raise APIError(f"{what} must be a JSON object", param=what)
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


def ids_field(value: Any, name: str, *, empty: bool = False) -> list[int]:
    """A request field holding token ids, checked (integers; non-empty unless ``empty``).

    Raises:
        APIError: Naming the field and what is wrong with it.
    """
    try:
        ids = token_ids(value if value is not None else [], f"'{name}'")
    except (TypeError, ValueError) as e:
        raise APIError(str(e), param=name) from None
    if not ids and not empty:
        raise APIError(f"'{name}' must hold at least one token id", param=name)
    if any(i < 0 for i in ids):
        raise APIError(f"'{name}' must not hold negative ids", param=name)
    return ids


def parse_chat_tokens(body: Any) -> ChatRequest:
    """A ``/v1/chat/completions/tokens`` body: the chat completions request whose prompt ids are ``tokens``.

    Raises:
        APIError: For a missing or bad ``tokens``, or whatever the chat route refuses.
    """
    if not isinstance(body, Mapping):
        raise APIError("the request body must be a JSON object")
    if "tokens" not in body:
        raise APIError("'tokens' (the prompt's token ids) is required on this route", param="tokens")
    request = parse_request({k: v for k, v in body.items() if k != "tokens"})
    request.prompt_ids = ids_field(body["tokens"], "tokens")
    return request


@dataclass
class GenerateRequest:
    """A checked ``/inference/v1/generate`` request (its chat is read from ``token_ids`` when it is served)."""

    model: str | None
    token_ids: list[int]
    settings: GenerationSettings
    request_id: str
    return_token_ids: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def chat_request(self, model: str, messages: list[dict[str, Any]]) -> ChatRequest:
        """The request as every route's :class:`ChatRequest`: the ids are its prompt, log-probs returned."""
        return ChatRequest(
            model=model,
            messages=messages,
            settings=self.settings,
            logprobs=True,
            return_token_ids=True,
            prompt_ids=list(self.token_ids),
        )


def parse_generate(body: Any) -> GenerateRequest:
    """Check a ``/inference/v1/generate`` body.

    Raises:
        APIError: For a bad or unsupported field (named).
    """
    _check_fields(body, "the request body", _GENERATE_FIELDS, _GENERATE_DEFAULTS)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise APIError("'model' must be a non-empty string (or left out)", param="model")
    request_id = body.get("request_id")
    if request_id is not None and not isinstance(request_id, str):
        raise APIError("'request_id' must be a string", param="request_id")
    params = body.get("sampling_params")
    if params is None:
        params = {}
    _check_fields(params, "sampling_params", {*_SAMPLING, "stop_token_ids"}, _SAMPLING_DEFAULTS)
    stops = ids_field(params.get("stop_token_ids"), "sampling_params.stop_token_ids", empty=True)
    try:
        settings = sampling_settings({k: params[k] for k in _SAMPLING if k in params})
    except APIError as e:
        raise APIError(str(e), param=f"sampling_params.{e.param}") from None
    return GenerateRequest(
        model,
        ids_field(body.get("token_ids"), "token_ids"),
        settings,
        request_id or "",
        flag(body, "return_token_ids"),
        stops,
    )


@dataclass
class TokenizeRequest:
    """A checked ``/tokenize`` request: ``messages`` (a chat) or ``prompt`` (text)."""

    model: str | None
    messages: list[dict[str, Any]] | None
    prompt: str | None
    tools: list[dict[str, Any]] | None
    add_generation_prompt: bool
    add_special_tokens: bool
    return_token_strs: bool


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    return default if body.get(name) is None else flag(body, name)


def parse_tokenize(body: Any) -> TokenizeRequest:
    """Check a ``/tokenize`` body (vLLM's chat form, with ``messages``, or completion form, with ``prompt``).

    Raises:
        APIError: For a bad or unsupported field (named), or neither or both of ``messages`` and ``prompt``.
    """
    _check_fields(body, "the request body", _TOKENIZE_FIELDS, _TOKENIZE_DEFAULTS)
    has_messages, has_prompt = body.get("messages") is not None, body.get("prompt") is not None
    if has_messages == has_prompt:
        raise APIError("give either 'messages' (a chat) or 'prompt' (text) to tokenize", param="messages")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError("'model' must be a string", param="model")
    prompt = body.get("prompt")
    if has_prompt and not isinstance(prompt, str):
        raise APIError("'prompt' must be a string", param="prompt")
    return TokenizeRequest(
        model=model,
        messages=chat_messages(body["messages"]) if has_messages else None,
        prompt=prompt,
        tools=check_tools(body.get("tools")),
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        add_special_tokens=_bool(body, "add_special_tokens", has_prompt),  # vLLM: True for text, False for chats
        return_token_strs=_bool(body, "return_token_strs", False),
    )


def parse_detokenize(body: Any) -> tuple[str | None, list[int]]:
    """Check a ``/detokenize`` body: ``(model, tokens)``.

    Raises:
        APIError: For a bad or unsupported field (named).
    """
    _check_fields(body, "the request body", {"model", "tokens"}, {})
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError("'model' must be a string", param="model")
    return model, ids_field(body.get("tokens"), "tokens", empty=True)
