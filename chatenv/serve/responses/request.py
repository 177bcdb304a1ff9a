"""OpenAI's Responses API on the capture endpoint: ``POST /v1/responses`` (and ``/s/{session}/v1/responses``).

A Responses request is mapped onto the same :class:`~chatenv.serve.request.ChatRequest` as a chat completion, and
served by the same :meth:`~chatenv.serve.service.CaptureService.complete` into the same sessions, so an agent written
against ``client.responses.create(...)`` records token-exact trajectories too.

The request's ``input`` (a string, or a list of items) becomes chat messages: ``instructions`` a system message first;
``message`` items (roles user, system, developer, assistant; text parts ``input_text`` / ``output_text``) messages;
``function_call`` items the ``tool_calls`` of the assistant message they follow (or of an assistant message of their
own), arguments read as data and call ids kept; ``function_call_output`` items tool messages; ``reasoning`` items
(their ``content`` text, else their ``summary`` text) the ``reasoning_content`` of the next assistant message. So a
follow-up whose input is the previous input + ``response.output`` + new items extends the session's segment.

The response's ``output`` is an assistant ``message`` item (``output_text``; left out when the reply only calls
tools), then one ``function_call`` item per call; a reply cut by its token budget has status ``incomplete``
(``incomplete_details.reason``: ``max_output_tokens``). The reply's reasoning, where the template writes one, stays in
the text as the model wrote it (as in chat completions). With ``stream: true`` the same response comes as the API's
server-sent events while the reply is generated (:mod:`chatenv.serve.responses.output`).

Supported: ``model``, ``input``, ``instructions``, ``tools`` (function tools; ``strict`` is accepted: a forced call's
arguments match the schema, other replies are not constrained), ``tool_choice`` (``auto``, ``none``, and by
constrained decoding ``required`` or ``{"type": "function", "name": ...}``), ``parallel_tool_calls``,
``temperature``, ``top_p``, ``top_logprobs``, ``max_output_tokens``, ``reasoning`` (``effort``: the template's switch,
:mod:`chatenv.serve.switches`; ``summary``: the reasoning comes back whole as the item's content), ``include``
(``message.output_text.logprobs``; ``reasoning.encrypted_content``: the reasoning text itself, sealed, read back
from ``reasoning`` input items that carry only it), ``stream``, ``user`` (the session id when neither the path nor a
header names one), ``store`` (nothing is stored); fields that only restate a default (``metadata: {}``,
``truncation: "disabled"``,
``text: {"format": {"type": "text"}}``, ...) are accepted. Anything else (``previous_response_id``, ``background``,
built-in tools such as ``web_search``, ...) is refused with ``unsupported_parameter`` naming it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.messages import chat_message, check_tools
from chatenv.serve.request import (
    ChatRequest,
    forced_tools,
    reasoning_effort,
    request_model,
    sampling_settings,
    switches,
    tool_choice,
)
from chatenv.serve.responses.output import ResponsesRequest, open_reasoning

__all__ = ["ResponsesRequest", "parse_responses_request"]

#: the Responses sampling fields -> the chat-completions fields whose mapping to the settings they share
_SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_output_tokens": "max_completion_tokens",
    "top_logprobs": "top_logprobs",
}
_HANDLED = {"model", "input", "instructions", "tools", "tool_choice", "stream", "user", "store", *_SAMPLING} | {
    "include",
    "parallel_tool_calls",
    "reasoning",
}
#: what ``include`` may ask for: reasoning items carry ``encrypted_content``; output text carries its log-probs
INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")
#: fields accepted when they hold one of these values (they then change nothing)
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "background": (None, False),
    "metadata": (None, {}),
    "truncation": (None, "disabled"),
    "text": (None, {"format": {"type": "text"}}),
    "service_tier": (None, "auto", "default"),
    **{name: (None,) for name in ("conversation", "prompt", "max_tool_calls", "stream_options")},
}
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _unsupported(name: str, why: str) -> APIError:
    return APIError(f"'{name}' is not supported by this endpoint: {why}", param=name, code="unsupported_parameter")


def _check_fields(body: Mapping[str, Any]) -> None:
    if body.get("previous_response_id") is not None:
        raise _unsupported(
            "previous_response_id",
            "it stores no responses; send the whole conversation in 'input' (the previous input, then "
            "response.output, then the new items)",
        )
    unknown = sorted(
        str(k) for k in body if k not in _HANDLED and k not in _DEFAULT_ONLY and k != "previous_response_id"
    )
    if unknown:
        raise APIError(f"unsupported parameters: {unknown}", param=unknown[0], code="unsupported_parameter")
    for name, allowed in _DEFAULT_ONLY.items():
        if name in body and body[name] not in allowed:
            raise _unsupported(name, f"{body[name]!r} is not accepted (it samples the policy as is)")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise APIError(f"'store' must be true or false, got {store!r}", param="store")


def _text(value: Any, where: str, kinds: tuple[str, ...] = _TEXT_PARTS) -> str:
    """Item content as text: a str, or a list of text parts (of ``kinds``: ``input_text``, ``output_text``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray)):
        raise APIError(f"{where} must be a string or a list of text parts", param=where)
    parts = []
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        if kind not in kinds or not isinstance(part.get("text"), str) or part.get("annotations"):
            raise APIError(
                f"{where}[{k}]: only text parts ({', '.join(kinds)}) are supported, got {kind!r}",
                param=where,
                code="unsupported_content",
            )
        parts.append(part["text"])
    return "".join(parts)


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    sealed = item.get("encrypted_content")
    if sealed:  # ours (see seal_reasoning): the reasoning as written; any text sent with it must agree
        text = open_reasoning(sealed)
        if text is None:
            raise _unsupported(
                f"{where}.encrypted_content", "it was not returned by this endpoint (send the reasoning as text)"
            )
        if item.get("content") and _text(item["content"], f"{where}.content", ("reasoning_text",)) != text:
            raise APIError(f"{where}: content and encrypted_content hold different reasoning", param=where)
        return text
    content = item.get("content")
    if content:
        return _text(content, f"{where}.content", ("reasoning_text",))
    return _text(item.get("summary") or [], f"{where}.summary", ("summary_text",))


@dataclass
class _Draft:
    """A chat message being assembled from items: where it came from, the message, its reasoning."""

    where: str
    message: dict[str, Any]
    reasoning: str = ""


def _check_keys(item: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(str(k) for k in item if k not in allowed and item[k] is not None)
    if extra:
        raise APIError(f"{where}: unsupported item fields {extra}", param=where, code="unsupported_parameter")


def _call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A ``function_call`` item as a chat tool call (arguments still the JSON string; read as data later)."""
    _check_keys(item, {"type", "call_id", "name", "arguments", "id", "status"}, where)
    if not isinstance(item.get("arguments"), str):
        raise APIError(f"{where}.arguments must be a JSON string", param=f"{where}.arguments")
    call: dict[str, Any] = {"type": "function", "function": {"name": item.get("name"), "arguments": item["arguments"]}}
    if item.get("call_id"):
        call["id"] = item["call_id"]
    return call


def _draft(kind: Any, item: Mapping[str, Any], where: str) -> _Draft:
    """A ``message``, ``function_call`` or ``function_call_output`` item as a chat message of its own."""
    if kind == "message":
        _check_keys(item, {"type", "role", "content", "id", "status", "phase"}, where)
        role = item.get("role")
        if role not in _ROLES:
            raise APIError(f"{where}.role {role!r} is not supported ({', '.join(_ROLES)})", param=f"{where}.role")
        return _Draft(where, {"role": role, "content": _text(item.get("content"), f"{where}.content")})
    if kind == "function_call":
        return _Draft(where, {"role": "assistant", "content": "", "tool_calls": [_call(item, where)]})
    if kind == "function_call_output":
        _check_keys(item, {"type", "call_id", "output", "id", "status"}, where)
        output = _text(item.get("output"), f"{where}.output")
        return _Draft(where, {"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
    raise APIError(
        f"{where}: items of type {kind!r} are not supported (message, function_call, function_call_output, reasoning)",
        param=f"{where}.type",
        code="unsupported_parameter",
    )


def _drafts(items: Any) -> list[_Draft]:
    """The input items as chat-completions messages (in order), function calls joined to their assistant message."""
    if isinstance(items, str):
        return [_Draft("input", {"role": "user", "content": items})]
    if not isinstance(items, Sequence) or isinstance(items, (bytes, bytearray)) or not items:
        raise APIError("'input' must be a string or a non-empty list of items", param="input")
    out: list[_Draft] = []
    reasoning: list[str] = []
    calls_to: _Draft | None = None  # the assistant message function calls join
    for k, item in enumerate(items):
        where = f"input[{k}]"
        kind = item.get("type", "message") if isinstance(item, Mapping) else None
        if kind == "reasoning":
            _check_keys(item, {"type", "id", "summary", "content", "encrypted_content", "status"}, where)
            reasoning.append(_reasoning_text(item, where))
            calls_to = None  # the calls after it belong to the next assistant message
            continue
        if kind == "function_call" and calls_to is not None:
            calls_to.message.setdefault("tool_calls", []).append(_call(item, where))
            continue
        draft = _draft(kind, item, where)
        calls_to = draft if draft.message["role"] == "assistant" else None
        if reasoning and calls_to is None:
            raise APIError(
                f"{where}: a reasoning item must come before an assistant message or function call", param=where
            )
        draft.reasoning, reasoning = "".join(reasoning), []
        out.append(draft)
    if reasoning:
        raise APIError("'input' ends with a reasoning item (it belongs to an assistant message)", param="input")
    return out


def input_messages(items: Any, instructions: Any = None) -> list[dict[str, Any]]:
    """``instructions`` and the ``input`` items as chatenv messages (what the endpoint renders and matches).

    Raises:
        APIError: For an item or part this endpoint cannot render (``param`` names it).
    """
    if instructions is not None and not isinstance(instructions, str):
        raise APIError("'instructions' must be a string", param="instructions")
    drafts = ([_Draft("instructions", {"role": "system", "content": instructions})] if instructions else []) + _drafts(
        items
    )
    out = []
    for d in drafts:
        message = chat_message(d.message, d.where)
        if d.reasoning:
            message["reasoning_content"] = d.reasoning
        out.append(message)
    return out


def _tools(value: Any) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """The request's tools as the chat schemas templates render, and as the response echoes them."""
    if value is None or value == []:
        return None, []
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise APIError("'tools' must be a list of function tools", param="tools")
    chat, echo = [], []
    for k, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise APIError(
                f"tools[{k}]: only function tools are supported, not {kind!r} (built-in tools do not run here)",
                param=f"tools[{k}].type",
                code="unsupported_parameter",
            )
        _check_keys(tool, {"type", "name", "description", "parameters", "strict"}, f"tools[{k}]")
        fn = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        chat.append({"type": "function", "function": fn})
        echo.append({**fn, "type": "function", "strict": tool.get("strict")})
    return check_tools(chat), echo


def _include(value: Any) -> tuple[str, ...]:
    """``include``: what the response adds (nothing it adds changes what is sampled)."""
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise APIError("'include' must be a list of strings", param="include")
    other = [v for v in value if v not in INCLUDES]
    if other:
        raise _unsupported("include", f"{other} cannot be included here (supported: {list(INCLUDES)})")
    return tuple(value)


def _effort(reasoning: Any) -> str | None:
    """``reasoning.effort`` (``summary``, ``generate_summary``: the reasoning comes back whole as its content)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, Mapping) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise _unsupported("reasoning", f"{reasoning!r}: only 'effort' and 'summary' are read")
    return reasoning_effort(reasoning.get("effort"), "reasoning.effort")


def _settings(body: Mapping[str, Any]) -> Any:
    """The sampling fields as the core's settings, through the chat-completions mapping (errors name our fields)."""
    try:
        return sampling_settings({chat: body.get(ours) for ours, chat in _SAMPLING.items()})
    except APIError as e:
        ours = next((o for o, c in _SAMPLING.items() if c == e.param), e.param)
        raise APIError(e.message.replace(f"'{e.param}'", f"'{ours}'"), param=ours, code=e.code) from None


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Check a Responses request body and map it to the chat request it is served as.

    Raises:
        APIError: For a body that is not an object, a missing or bad field, or an unsupported one.
    """
    model = request_model(body, _check_fields)
    include = _include(body.get("include"))
    messages = input_messages(body.get("input"), body.get("instructions"))
    tools, echo_tools = _tools(body.get("tools"))
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError("'user' must be a string", param="user")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise APIError(f"'stream' must be true or false, got {stream!r}", param="stream")
    chat = ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        parse_tools=tool_choice(body, tools),
        settings=_settings(body),
        stream=bool(stream),
        user=user or None,
        forced_tools=forced_tools(body.get("tool_choice"), tools),
        reasoning_effort=_effort(body.get("reasoning")),
        logprobs="message.output_text.logprobs" in include,
        **switches(body),
    )
    echo = {
        "instructions": body.get("instructions"),
        "tools": echo_tools,
        "tool_choice": body.get("tool_choice") or "auto",
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "store": False,  # nothing is kept, whatever the request asks
        "user": user,
    }
    echo["parallel_tool_calls"] = chat.parallel_tool_calls
    echo["top_logprobs"] = chat.settings.top_logprobs
    echo["reasoning"] = body.get("reasoning")
    return ResponsesRequest(chat, echo, include)
