"""Anthropic's Messages API on the capture endpoint: ``POST /v1/messages`` (also under ``/s/{session}``).

An agent written against the ``anthropic`` client runs unmodified (``anthropic.Anthropic(base_url=server.url)``, or
``server.url + "/s/<session>"``; with API keys, pass the key as ``auth_token``: the endpoint reads
``Authorization: Bearer``). A request becomes the same :class:`~chatenv.serve.request.ChatRequest` a chat-completions
request does and is served by :meth:`~chatenv.serve.service.CaptureService.complete` in the same sessions:

- ``system`` (a string or text blocks) is the first message; ``tool_use`` blocks are assistant tool calls (ids
  kept, arguments as data), ``tool_result`` blocks are ``tool`` messages, ``thinking`` blocks the assistant's
  ``reasoning_content``. A reply sent back as the client returned it is the recorded reply
  (:func:`~chatenv.serve.messages.message_key`), so the session's segment is extended, never re-rendered.
- ``tools`` (``name``, ``description``, ``input_schema``) are function schemas; ``tool_choice`` may be ``auto``,
  ``none``, or by constrained decoding ``any`` / ``{"type": "tool", "name": ...}`` (with
  ``disable_parallel_tool_use``: the reply ends after its first call). ``max_tokens`` (required),
  ``temperature``, ``top_p``, ``top_k`` and ``stop_sequences`` map to
  :class:`~chatenv.sampling.GenerationSettings` through :func:`~chatenv.serve.request.sampling_settings`.
- ``metadata.user_id`` names the session when neither the path nor the ``X-Session-Id`` header does.

Anything else is refused with Anthropic's error body (``{"type": "error", "error": {"type", "message"}}``) and
the status the ``anthropic`` client maps to its exceptions (400: ``BadRequestError``). ``stream: true`` sends
Anthropic's server-sent events as the reply is generated (:mod:`chatenv.serve.anthropic.output`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from chatenv.messages import check_message
from chatenv.serve.errors import APIError
from chatenv.serve.request import ChatRequest, sampling_settings

__all__ = ["convert_messages", "parse_count_request", "parse_messages_request"]

#: request fields read here (any other field is refused)
_FIELDS = {
    "model",
    "max_tokens",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
    "cache_control",  # a caching hint: changes no reply
}
#: fields accepted when they hold one of these values (they then change nothing)
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}),
    "service_tier": (None, "auto", "standard_only"),
    "speed": (None, "standard"),
}
#: the request's sampling fields under the chat-completions names :func:`sampling_settings` reads
_SAMPLING = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
#: block keys that change nothing the endpoint renders (caching hints, fields the client echoes back empty)
_IGNORED_KEYS = {"cache_control", "signature"}
_TOOL_KEYS = {"type", "name", "description", "input_schema", "cache_control"}
_ECHOED_EMPTY = {"citations", "caller", "toolset_name"}


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _check_block(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    """A content block's type, refusing non-objects, other types and keys that would change the rendering."""
    kind = block.get("type") if isinstance(block, Mapping) else None
    if kind not in allowed:
        raise APIError(f"{where}: content blocks of type {kind!r} are not supported here (use {list(allowed)})")
    known = {"type", "text", "id", "name", "input", "tool_use_id", "content", "is_error", "thinking"}
    extra = sorted(
        str(k) for k in block if k not in known | _IGNORED_KEYS and not (k in _ECHOED_EMPTY and not block[k])
    )
    if extra:
        raise APIError(f"{where}: unsupported block fields {extra}")
    return str(kind)


def _text_of(value: Any, where: str) -> str:
    """A string, or the joined text of a list of text blocks."""
    if isinstance(value, str):
        return value
    if not _is_list(value):
        raise APIError(f"{where} must be a string or a list of text blocks")
    parts = []
    for k, block in enumerate(value):
        _check_block(block, f"{where}[{k}]", ("text",))
        if not isinstance(block.get("text"), str):
            raise APIError(f"{where}[{k}].text must be a string")
        parts.append(block["text"])
    return "".join(parts)


def _assistant(content: Any, where: str) -> dict[str, Any]:
    """An assistant message: text blocks as content, thinking as reasoning, tool_use blocks as tool calls."""
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not _is_list(blocks):
        raise APIError(f"{where}.content must be a string or a list of content blocks")
    text: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(blocks):
        at = f"{where}.content[{k}]"
        kind = _check_block(block, at, ("text", "thinking", "tool_use"))
        if kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), Mapping):
                raise APIError(f"{at}: a tool_use block needs a 'name' (string) and an 'input' (object)")
            call = {"type": "function", "function": {"name": block["name"], "arguments": dict(block["input"])}}
            calls.append({"id": str(block["id"]), **call} if block.get("id") else call)
        elif calls:
            raise APIError(f"{at}: text and thinking must come before the tool_use blocks")
        else:
            value = block.get(kind)
            if not isinstance(value, str):
                raise APIError(f"{at}.{kind} must be a string")
            (thinking if kind == "thinking" else text).append(value)
    out: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        out["reasoning_content"] = "".join(thinking)
    if calls:
        out["tool_calls"] = calls
    return out


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    """A user message: runs of text blocks as user messages, each tool_result block as a tool message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not _is_list(content) or not content:
        raise APIError(f"{where}.content must be a string or a non-empty list of content blocks")
    out: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        if _check_block(block, at, ("text", "tool_result")) == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(f"{at}.tool_use_id must be a string")
            result = block.get("content")
            text = "" if result is None else _text_of(result, f"{at}.content")
            text = f"Error: {text}" if block.get("is_error") is True else text  # templates have no error field
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif not isinstance(block.get("text"), str):
            raise APIError(f"{at}.text must be a string")
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += block["text"]
        else:
            out.append({"role": "user", "content": block["text"]})
    return out


def convert_messages(messages: Any, system: Any = None) -> list[dict[str, Any]]:
    """A Messages request's ``system`` and ``messages`` as chatenv messages.

    Raises:
        APIError: For anything but a non-empty list of user/assistant messages whose blocks can be rendered.
    """
    if not _is_list(messages) or not messages:
        raise APIError("messages: must be a non-empty list of {'role', 'content'} objects")
    out = [] if system is None else [{"role": "system", "content": _text_of(system, "system")}]
    for k, message in enumerate(messages):
        where = f"messages.{k}"
        if not isinstance(message, Mapping) or set(message) - {"role", "content"} or "content" not in message:
            raise APIError(f"{where}: a message is an object with 'role' and 'content' only")
        if message.get("role") == "user":
            out += _user(message["content"], where)
        elif message.get("role") == "assistant":
            out.append(_assistant(message["content"], where))
        else:
            raise APIError(f"{where}.role must be 'user' or 'assistant', got {message.get('role')!r}")
    if out[-1]["role"] == "assistant":  # the API would continue it; this endpoint starts a new turn
        raise APIError("messages: a last assistant message (a prefill to continue) is not supported")
    try:
        return [check_message(m, f"messages[{k}]") for k, m in enumerate(out)]
    except (TypeError, ValueError) as e:
        raise APIError(str(e)) from None


def _forced(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[tuple[str, ...] | None, bool]:
    """``tool_choice``'s forced functions and whether a reply may make several calls.

    ``any``: all the tools, ``tool``: the one named, else None (not forced); ``disable_parallel_tool_use: true``:
    one call.
    """
    kind = choice.get("type") if isinstance(choice, Mapping) else choice
    if kind not in (None, "auto", "none", "any", "tool"):
        raise APIError(f"tool_choice: {choice!r} is not supported (auto, none, any or tool)")
    parallel = not (isinstance(choice, Mapping) and choice.get("disable_parallel_tool_use") is True)
    if kind not in ("any", "tool"):
        return None, parallel
    names = [t["function"]["name"] for t in tools or []]
    if not names:
        raise APIError(f"tool_choice: {kind!r} needs tools to choose from")
    if kind == "any":
        return tuple(names), parallel
    name = choice.get("name") if isinstance(choice, Mapping) else None
    if name not in names:
        raise APIError(f"tool_choice.name: {name!r} is not among the tools {names}")
    return (str(name),), parallel


def _tools(tools: Any, choice: Any) -> tuple[list[dict[str, Any]] | None, bool]:
    """The tools as the function schemas templates render, and whether replies are read for tool calls."""
    kind = choice.get("type") if isinstance(choice, Mapping) else choice
    if tools is None or tools == []:
        return None, False
    if not _is_list(tools):
        raise APIError("tools: must be a list of tools")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type", "custom") not in (None, "custom"):
            raise APIError(f"tools.{k}: only custom tools ({{'name', 'description', 'input_schema'}}) are supported")
        extra = sorted(str(key) for key in tool if key not in _TOOL_KEYS)
        if extra or not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), Mapping):
            raise APIError(f"tools.{k}: a tool is {{'name', 'description', 'input_schema'}} (got fields {extra})")
        function = {"name": tool["name"], "description": tool.get("description"), "parameters": tool["input_schema"]}
        out.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
    return out, kind != "none"


def _settings_body(body: Mapping[str, Any]) -> dict[str, Any]:
    if body.get("max_tokens") is None:
        raise APIError("max_tokens: Field required")
    given = {name: body[key] for key, name in _SAMPLING.items() if body.get(key) is not None}
    stops = body.get("stop_sequences")
    if stops is not None:
        given["stop"] = list(stops) if _is_list(stops) else stops
    return given


def _check_fields(body: Mapping[str, Any]) -> None:
    unknown = sorted(str(k) for k in body if k not in _FIELDS and k not in _DEFAULT_ONLY)
    if unknown:
        raise APIError(f"unsupported parameters: {unknown}")
    for name, allowed in _DEFAULT_ONLY.items():
        if name in body and body[name] not in allowed:
            raise APIError(f"{name}: {body[name]!r} is not supported by this endpoint (it samples the policy as is)")
    if not isinstance(body.get("stream", False), bool):
        raise APIError("stream: must be true or false")


def _user_id(metadata: Any) -> str | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping) or set(metadata) - {"user_id"}:
        raise APIError("metadata: may only hold 'user_id'")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise APIError("metadata.user_id: must be a string")
    return user or None


def parse_messages_request(body: Any) -> ChatRequest:
    """Check a Messages request body and map it to the endpoint's :class:`~chatenv.serve.request.ChatRequest`.

    Raises:
        APIError: For a body that is not an object, a missing or bad field, or an unsupported one.
    """
    if not isinstance(body, Mapping):
        raise APIError("the request body must be a JSON object")
    _check_fields(body)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError("model: Field required (a string; GET /v1/models lists them)")
    given = _settings_body(body)
    try:
        settings = sampling_settings(given)
    except APIError as e:  # the settings' refusal names the chat-completions field: name Anthropic's
        names = {v: k for k, v in _SAMPLING.items()} | {"stop": "stop_sequences"}
        field = names.get(e.param or "", e.param or "")
        raise APIError(f"{field}: " + e.message.replace(f"'{e.param}'", f"'{field}'")) from e
    tools, parse_tools = _tools(body.get("tools"), body.get("tool_choice"))
    forced, parallel = _forced(body.get("tool_choice"), tools)
    return ChatRequest(
        model=model,
        messages=convert_messages(body.get("messages"), body.get("system")),
        tools=tools,
        parse_tools=parse_tools,
        settings=settings,
        stream=bool(body.get("stream", False)),
        user=_user_id(body.get("metadata")),
        forced_tools=forced,
        parallel_tool_calls=parallel,
    )


def parse_count_request(body: Any) -> ChatRequest:
    """Check a ``count_tokens`` body (a Messages request without ``max_tokens``, ``stream`` or ``metadata``).

    Raises:
        APIError: As :func:`parse_messages_request`.
    """
    if not isinstance(body, Mapping):
        raise APIError("the request body must be a JSON object")
    for name in ("max_tokens", "stream", "metadata", "stop_sequences", "temperature", "top_p", "top_k"):
        if name in body:
            raise APIError(f"{name}: Extra inputs are not permitted (count_tokens counts the input only)")
    return parse_messages_request({**body, "max_tokens": 1})
