"""What every API dialect's request becomes: :class:`ChatRequest`, and the checks the dialects share.

Each dialect (``chat``, ``responses``, ``anthropic``, ``tokens``) maps its own fields to a :class:`ChatRequest`; the
sampling fields go through :func:`sampling_settings` to the core's :class:`~chatenv.sampling.GenerationSettings`
(as inference servers map a request to their sampling parameters): one set of bounds, whose refusals name the
request's fields. A field no dialect handles is refused by that dialect, naming it (nothing is silently dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from chatenv.sampling import GenerationSettings, SettingError, normalize_generate_kwargs
from chatenv.serve.errors import APIError

__all__ = ["SAMPLING_FIELDS", "ChatRequest", "flag", "request_model", "sampling_settings", "tool_choice"]

#: the request's sampling fields -> the settings they set (OpenAI's names, and vLLM's server extras)
SAMPLING_FIELDS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "max_tokens": "max_new_tokens",  # read when max_completion_tokens is not given
    "stop": "stop",
    "seed": "seed",
    "n": "num_samples",
}
#: the API's own limits, narrower than the settings' bounds: OpenAI's temperature range and number of stop strings,
#: and the most replies one request may ask for
_API_LIMITS: dict[str, tuple[float, str]] = {
    "temperature": (2.0, "must be in [0, 2]"),
    "stop": (4, "may hold at most 4 strings"),
    "n": (16, "must be in [1, 16]"),
}
#: settings the endpoint passes on by themselves (reply budget, stop strings, seed, replies per prompt), not in
#: :attr:`ChatRequest.generate_kwargs`
_OWN_FIELDS = frozenset({"max_new_tokens", "stop", "seed", "num_samples"})
#: settings left out of :attr:`ChatRequest.generate_kwargs` at 0, their default (not every backend has them)
_UNASKED_AT_ZERO = frozenset({"presence_penalty", "frequency_penalty"})


@dataclass
class ChatRequest:
    """A checked chat-completions request.

    Attributes:
        model: The model asked for.
        messages: The messages, as chatenv messages.
        tools: Tool schemas (None: no tools).
        parse_tools: Whether replies are read for tool calls (tools given and ``tool_choice`` is not ``none``).
        settings: The request's sampling settings (those it does not set hold their defaults; see
            :func:`sampling_settings`).
        stream: Answer as server-sent events.
        include_usage: Send a last chunk with the token counts (streaming).
        logprobs: Return each generated token's log-prob.
        user: The ``user`` field (a session id when no header names one).
    """

    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    parse_tools: bool = False
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    user: str | None = None

    @property
    def n(self) -> int:
        """Replies to generate."""
        return self.settings.num_samples

    @property
    def max_tokens(self) -> int | None:
        """The most tokens per reply, if the request gives it."""
        return self.settings.max_new_tokens if "max_new_tokens" in self.settings.explicit else None

    @property
    def stop(self) -> tuple[str, ...]:
        """Strings that end a reply (cut from the returned content, kept in the recorded ids)."""
        return self.settings.stop

    @property
    def seed(self) -> int | None:
        """Sampling seed (the same seed and prompt give the same replies)."""
        return self.settings.seed

    @property
    def generate_kwargs(self) -> dict[str, Any]:
        """The policy's generation settings this request sets, besides those above (max tokens are added later).

        Presence and frequency penalties at their default (0) are left out: a backend without them is not asked
        for them.
        """
        kwargs = self.settings.as_kwargs()
        return {k: v for k, v in kwargs.items() if k not in _OWN_FIELDS and not (k in _UNASKED_AT_ZERO and v == 0)}


def flag(body: Mapping[str, Any], name: str) -> bool:
    """A boolean field of a request body (absent or null: False); anything but a bool is refused naming it."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(f"'{name}' must be true or false, got {value!r}", param=name)
    return value


def tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> bool:
    """Whether replies are read for tool calls."""
    choice = body.get("tool_choice")
    if choice in (None, "auto"):
        return tools is not None
    if choice == "none":
        return False
    raise APIError(
        f"tool_choice={choice!r} is not supported: the endpoint samples the model without constrained decoding, so "
        "it cannot force a call; use 'auto' or 'none'",
        param="tool_choice",
        code="unsupported_parameter",
    )


def sampling_settings(body: Mapping[str, Any]) -> GenerationSettings:
    """The request's sampling fields as the core's settings: each field under its setting's name, checked there.

    ``max_completion_tokens`` wins over ``max_tokens``; ``null`` is a field not given. The reply budget is the
    endpoint's when the request gives none, so ``min_tokens`` is then bounded by it later, not here.

    Raises:
        APIError: For a value the settings refuse, or one over the API's own limits (``param``: the field at fault).
    """
    given = {name: body[name] for name in SAMPLING_FIELDS if body.get(name) is not None}
    if "max_completion_tokens" in given:
        given.pop("max_tokens", None)
    field_of = {SAMPLING_FIELDS[name]: name for name in given}
    try:
        settings = normalize_generate_kwargs({SAMPLING_FIELDS[k]: v for k, v in given.items()}, budget_elsewhere=True)
    except SettingError as e:
        param = field_of.get(e.setting or "")
        raise APIError(e.describe(f"'{param}'"), param=param) from e
    for name, (limit, rule) in _API_LIMITS.items():
        value = getattr(settings, SAMPLING_FIELDS[name])
        if (len(value) if isinstance(value, tuple) else value) > limit:
            raise APIError(f"'{name}' {rule}, got {given[name]!r}", param=name)
    return settings


def request_model(body: Any, check_fields: Callable[[Mapping[str, Any]], None]) -> str:
    """A request body's ``model`` once the body is an object whose fields ``check_fields`` accepts.

    Raises:
        APIError: For a body that is not an object, a field refused, or a missing model.
    """
    if not isinstance(body, Mapping):
        raise APIError("the request body must be a JSON object")
    check_fields(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError("'model' is required (a string; GET /v1/models lists them)", param="model")
    return model
