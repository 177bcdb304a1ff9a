"""OpenEnv's protocol for a served chat env: typed actions, observations as dicts, schemas, metadata, errors, MCP.

What OpenEnv's clients and ``openenv validate`` read (tested with openenv-core 0.3.0), for one served env id:

- **Actions** are objects with one field, by the env's kind (:func:`action_fields`): a turn-level env in ``history``
  or ``text`` mode takes ``{"message": <reply text or assistant message dict>}`` or ``{"tokens": [ids]}``; in
  ``tokens`` mode ``{"tokens": [ids]}`` (the generated ids, kept verbatim); a token-level env ``{"token": id}``.
  OpenEnv's ``metadata`` object may come along (its ``Action`` models always send it); the env does not read it.
  Any other shape is refused with 422 ``invalid_action`` naming the field and the shape (:func:`parse_action`).
- **Observations** are objects with one field (:func:`observation_dict`): ``{"messages": [...]}`` (history mode),
  ``{"text": "..."}`` (text mode) or ``{"tokens": [ids]}`` (tokens mode and token-level envs).
- ``GET /schema`` gives the JSON schemas of the action, the observation and the state (:func:`schemas`);
  ``GET /metadata`` the env's name and description (:func:`metadata`).
- WebSocket error frames are ``{"type": "error", "data": {"message", "code"}}`` with OpenEnv's codes
  (:func:`openenv_code`: ``VALIDATION_ERROR``, ``EXECUTION_ERROR``, ``SESSION_ERROR``...); chatenv's finer code
  travels beside them as ``reason``, with ``status`` and ``param``.
- ``POST /mcp`` answers JSON-RPC 2.0 (:func:`mcp_reply`): ``tools/list`` lists the env's tools (those a reply may
  call); the env calls them itself when a reply does, so ``tools/call`` is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatenv.errors import APIError

__all__ = [
    "OPENENV_API_VERSION",
    "action_fields",
    "metadata",
    "mcp_reply",
    "observation_dict",
    "observation_key",
    "openenv_code",
    "parse_action",
    "schemas",
]

#: the version of OpenEnv's HTTP API the env server speaks (``info.version`` of its OpenAPI document)
OPENENV_API_VERSION = "1.0.0"

#: chatenv error code -> OpenEnv's WebSocket error code
_OPENENV_CODES = {
    "invalid_json": "INVALID_JSON",
    "request_too_large": "INVALID_JSON",
    "unknown_type": "UNKNOWN_TYPE",
    "invalid_action": "VALIDATION_ERROR",
    "invalid_request": "VALIDATION_ERROR",
    "invalid_session_id": "VALIDATION_ERROR",
    "type_error": "EXECUTION_ERROR",
    "value_error": "EXECUTION_ERROR",
    "template_error": "EXECUTION_ERROR",
    "env_state": "EXECUTION_ERROR",
    "internal_error": "EXECUTION_ERROR",
    "too_many_sessions": "CAPACITY_REACHED",
    "session_not_found": "SESSION_ERROR",
    "session_evicted": "SESSION_ERROR",
    "session_busy": "SESSION_ERROR",
    "session_forbidden": "SESSION_ERROR",
}


def openenv_code(code: str | None) -> str:
    """OpenEnv's WebSocket error code for a chatenv error code (``EXECUTION_ERROR`` for anything else)."""
    return _OPENENV_CODES.get(code or "", "EXECUTION_ERROR")


def _token_level(info: Mapping[str, Any]) -> bool:
    return bool(info["action_space"]["type"] == "Discrete")


def action_fields(info: Mapping[str, Any]) -> tuple[str, ...]:
    """The action fields the served env takes (exactly one is sent): by its kind and input mode."""
    if _token_level(info):
        return ("token",)
    if info["input_mode"] == "tokens":
        return ("tokens",)
    return ("message", "tokens")


def observation_key(info: Mapping[str, Any]) -> str:
    """The one field of the served env's observations: ``messages``, ``text`` or ``tokens``."""
    if _token_level(info) or info["input_mode"] == "tokens":
        return "tokens"
    return "messages" if info["input_mode"] == "history" else "text"


def observation_dict(observation: Any, info: Mapping[str, Any]) -> dict[str, Any]:
    """The observation as OpenEnv sends it: an object (its one field holds the JSON value, see the module)."""
    return {observation_key(info): observation}


def _shape(info: Mapping[str, Any]) -> str:
    examples = {"token": "{'token': <id>}", "tokens": "{'tokens': [<id>, ...]}", "message": "{'message': <reply>}"}
    return " or ".join(examples[f] for f in action_fields(info))


def _invalid(message: str, field: str | None = None) -> APIError:
    param = "action" if field is None else f"action.{field}"
    return APIError(message, status=422, code="invalid_action", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_action(data: Any, info: Mapping[str, Any]) -> Any:
    """The env's action from an OpenEnv action object (see the module docstring); checked for shape only.

    The env checks the values (ids in the vocabulary, a message's role) and raises its own errors.

    Raises:
        APIError: 422 ``invalid_action`` naming what was wrong, for an action that is not of the env's shape.
    """
    fields = action_fields(info)
    if not isinstance(data, Mapping):
        raise _invalid(f"an action is an object, {_shape(info)}; got {type(data).__name__} {str(data)[:60]}")
    unknown = sorted(str(k) for k in data if k not in fields and k != "metadata")
    if unknown:
        hint = ""
        if "message" in unknown and info["input_mode"] == "tokens":
            hint = (
                "; tokens mode takes the generated token ids (kept verbatim), not text: serve the env with "
                "input_mode 'text' or 'history' to send text"
            )
        raise _invalid(f"unknown action field(s) {unknown}: this env takes {_shape(info)}{hint}", unknown[0])
    given = [f for f in fields if f in data]
    if len(given) != 1:
        raise _invalid(f"an action has exactly one of the fields {list(fields)} ({_shape(info)}), got {given}")
    if not isinstance(data.get("metadata", {}), Mapping):
        raise _invalid("'metadata' must be an object", "metadata")
    field = given[0]
    value = data[field]
    if field == "token" and not _is_int(value):
        raise _invalid(f"'token' is one token id (an integer), got {type(value).__name__} {value!r:.40}", field)
    if field == "tokens" and not (isinstance(value, list) and all(_is_int(v) for v in value)):
        raise _invalid(f"'tokens' is a list of token ids (integers), got {str(value)[:60]}", field)
    if field == "message" and not isinstance(value, (str, Mapping)):
        raise _invalid(f"'message' is the reply's text or an assistant message object, got {type(value).__name__}",
                       field)  # fmt: skip
    return value


# ---------------------------------------------------------------------------------------------- schemas


def _ids_schema(vocab_size: int, description: str) -> dict[str, Any]:
    item = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    return {"type": "array", "items": item, "description": description}


_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"type": "string", "enum": ["assistant"]},
        "content": {"type": "string"},
        "reasoning_content": {"type": "string"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
    },
    "required": ["content"],
}
_METADATA = {"type": "object", "description": "OpenEnv's action metadata (not read by the env)"}


def _action_schema(info: Mapping[str, Any]) -> dict[str, Any]:
    vocab = int(info["vocab_size"])
    properties: dict[str, Any] = {
        "message": {
            "anyOf": [{"type": "string"}, _MESSAGE],
            "description": "the assistant's reply: its text, or an assistant message",
        },
        "tokens": _ids_schema(vocab, "the reply's generated token ids, kept verbatim (ending with end-of-turn)"),
        "token": {"type": "integer", "minimum": 0, "maximum": vocab - 1, "description": "one generated token id"},
    }
    fields = action_fields(info)
    title = {"token": "TokenAction", "tokens": "TokensAction", "message": "ChatAction"}[fields[0]]
    schema: dict[str, Any] = {
        "title": title,
        "type": "object",
        "properties": {**{f: properties[f] for f in fields}, "metadata": _METADATA},
        "additionalProperties": False,
    }
    if len(fields) == 1:
        schema["required"] = list(fields)
    else:
        schema["oneOf"] = [{"required": [f]} for f in fields]
    return schema


def _observation_schema(info: Mapping[str, Any]) -> dict[str, Any]:
    key = observation_key(info)
    value: dict[str, Any]
    if key == "tokens":
        value = _ids_schema(int(info["vocab_size"]), "the chat's token ids, ending with what the policy continues")
    elif key == "text":
        value = {"type": "string", "description": "the rendered chat, ending with the next assistant header"}
    else:
        value = {"type": "array", "items": {"type": "object"}, "description": "the chat's messages"}
    return {"title": "ChatObservation", "type": "object", "properties": {key: value}, "required": [key]}


_STATE = {
    "title": "ChatState",
    "type": "object",
    "properties": {
        "episode_id": {"type": ["string", "null"]},
        "step_count": {"type": "integer", "minimum": 0},
        "session_id": {"type": "string"},
        "turn": {"type": "integer"},
        "done": {"type": "boolean"},
        "num_tokens": {"type": "integer"},
        "token_ids": {"type": "array", "items": {"type": "integer"}},
        "assistant_mask": {"type": "array", "items": {"type": "boolean"}},
        "messages": {"type": "array", "items": {"type": "object"}},
        "task_state": {},
    },
    "required": ["episode_id", "step_count"],
    "additionalProperties": True,
}


def schemas(info: Mapping[str, Any]) -> dict[str, Any]:
    """What ``GET /schema`` answers: ``{"action", "observation", "state"}`` JSON schemas of the served env."""
    return {"action": _action_schema(info), "observation": _observation_schema(info), "state": dict(_STATE)}


def metadata(info: Mapping[str, Any]) -> dict[str, Any]:
    """What ``GET /metadata`` answers: OpenEnv's ``EnvironmentMetadata`` of the served env."""
    from chatenv._version import __version__

    unit = "one generated token" if _token_level(info) else "one assistant turn"
    description = (
        f"chatenv {info['kind']} ({info['input_mode']} mode): a chat as an RL environment, one step is {unit}. "
        f"Actions: {_shape(info)}; observations: {{'{observation_key(info)}': ...}}."
    )
    return {
        "name": str(info["env_id"]),
        "description": description,
        "readme_content": None,
        "version": __version__,
        "author": None,
        "documentation_url": None,
    }


# ---------------------------------------------------------------------------------------------- MCP


def _rpc_error(code: int, message: str, request_id: Any = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message, "data": None}}


def mcp_reply(body: Any, info: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-RPC 2.0 answer of ``POST /mcp`` to ``body`` (already parsed; see the module docstring)."""
    if not isinstance(body, Mapping) or body.get("jsonrpc") != "2.0" or not isinstance(body.get("method"), str):
        return _rpc_error(-32600, "Invalid Request: send {'jsonrpc': '2.0', 'method': ..., 'params': {...}, 'id': ...}")
    request_id, method = body.get("id"), body["method"]
    if method == "tools/list":
        tools = [
            {
                "name": s["function"]["name"],
                "description": s["function"].get("description", ""),
                "inputSchema": s["function"].get("parameters", {"type": "object"}),
            }
            for s in info.get("tools") or []
        ]
        return {"jsonrpc": "2.0", "id": request_id, "result": {"tools": tools}}
    if method == "tools/call":
        return _rpc_error(
            -32601,
            "tools/call is not served: the env calls its tools itself when the assistant's reply calls them (step "
            "with that reply)",
            request_id,
        )
    return _rpc_error(-32601, f"Method not found: {method!r} (this server answers tools/list)", request_id)
