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

__all__ = [
    "EFFORTS",
    "SAMPLING_FIELDS",
    "ChatRequest",
    "flag",
    "forced_tools",
    "reasoning_effort",
    "request_model",
    "sampling_settings",
    "switches",
    "tool_choice",
]

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
    "top_logprobs": "top_logprobs",
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
        return_token_ids: Return the prompt's and each reply's token ids (vLLM's ``return_token_ids``).
        tokens_as_ids: Write log-prob tokens as ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``).
        prompt_ids: The prompt's ids as the client gives them (token routes; checked against the ids the session
            plans, see :func:`chatenv.serve.tokens.prompt.served_prompt`); once planned, the ids served.
        forced_tools: The functions a reply must call (``tool_choice`` ``required`` or a named function: constrained
            decoding, :mod:`chatenv.templates.forced_calls`), or None.
        parallel_tool_calls: Whether a forced reply may make several calls (False: it ends after the first).
        template_kwargs: ``chat_template_kwargs``: the template's own variables (see :mod:`chatenv.serve.switches`).
        reasoning_effort: The reasoning effort asked for, mapped to the template's switch.
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
    return_token_ids: bool = False
    tokens_as_ids: bool = False
    prompt_ids: list[int] | None = None
    forced_tools: tuple[str, ...] | None = None
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None

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
    forced_tools(choice, tools)
    return True


def forced_tools(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[str, ...] | None:
    """The functions a reply must call: all for ``"required"``, one for a named function; None when not forced.

    Takes OpenAI's named forms: ``{"type": "function", "function": {"name": ...}}`` (chat completions) and
    ``{"type": "function", "name": ...}`` (Responses).

    Raises:
        APIError: For a choice without tools, a name not among them, or another form.
    """
    if choice in (None, "auto", "none"):
        return None
    names = [t["function"]["name"] for t in tools or []]
    named = choice.get("type") == "function" if isinstance(choice, Mapping) else False
    if choice != "required" and not named:
        raise APIError(
            f"tool_choice={choice!r} is not supported; use 'auto', 'none', 'required' or a named function",
            param="tool_choice",
            code="unsupported_parameter",
        )
    if not names:
        raise APIError(f"tool_choice={choice!r} needs 'tools' to choose from", param="tool_choice")
    if choice == "required":
        return tuple(names)
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else choice.get("name")
    if name not in names:
        raise APIError(f"tool_choice names {name!r}, which is not among the tools {names}", param="tool_choice")
    return (str(name),)


def switches(body: Mapping[str, Any]) -> dict[str, Any]:
    """``chat_template_kwargs`` and ``parallel_tool_calls`` of a body, checked (the ChatRequest fields they set)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise APIError("'chat_template_kwargs' must be an object of template variables", param="chat_template_kwargs")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise APIError(f"'parallel_tool_calls' must be true or false, got {parallel!r}", param="parallel_tool_calls")
    return {"template_kwargs": dict(kwargs) if kwargs else None, "parallel_tool_calls": parallel is not False}


#: reasoning efforts the APIs name
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def reasoning_effort(value: Any, param: str = "reasoning_effort") -> str | None:
    """A reasoning effort, checked (None: not given)."""
    if value is not None and value not in EFFORTS:
        raise APIError(f"'{param}' must be one of {list(EFFORTS)}, got {value!r}", param=param)
    return None if value is None else str(value)


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
