"""What the env server and its client exchange: JSON values, spaces as JSON, and errors.

Values travel as JSON: token ids as lists of ints, chats as lists of message dicts, text as a string (the shapes
OpenEnv's clients read are :mod:`chatenv.envserver.protocol`'s). An HTTP error body is
``{"detail": ..., "error": {"message", "type", "param", "code"}}`` (:func:`http_error_body`: ``detail`` is what
FastAPI and OpenEnv's servers send, ``error`` what OpenAI-style clients read); a WebSocket error frame is OpenEnv's
``{"type": "error", "data": {"message", "code", "reason", "status", "param"}}`` (:func:`error_frame`). chatenv's
``code`` (``reason`` in a frame) names what went wrong and :class:`~chatenv.envserver.EnvClient` raises the matching
exception (:data:`ERRORS`): ``TypeError``/``ValueError`` for a bad action, ``RuntimeError`` for a call the env's state
refuses, :class:`~chatenv.errors.APIError` (status and code) for the rest.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from chatenv.errors import APIError, TemplateError
from chatenv.spaces import ChatText, MessagesSpace, TokenIds

__all__ = [
    "ERRORS",
    "error_code",
    "error_frame",
    "http_error_body",
    "raise_error",
    "space_from_spec",
    "space_spec",
    "to_json",
]


#: error code -> (HTTP status, the exception the client raises; None: :class:`~chatenv.errors.APIError`)
ERRORS: dict[str, tuple[int, type[Exception] | None]] = {
    "invalid_action": (422, TypeError),
    "type_error": (400, TypeError),
    "value_error": (400, ValueError),
    "template_error": (400, TemplateError),
    "invalid_request": (400, ValueError),
    "unknown_type": (400, ValueError),
    "env_state": (409, RuntimeError),
    "session_evicted": (409, None),
    "session_busy": (409, None),
    "session_not_found": (404, None),
    "session_forbidden": (403, None),
    "too_many_sessions": (503, None),
}


def error_code(exc: BaseException) -> str | None:
    """The error code of an exception an env raised refusing a call (None: a server fault, answered 500)."""
    if isinstance(exc, TemplateError):
        return "template_error"
    if isinstance(exc, TypeError):
        return "type_error"
    if isinstance(exc, (ValueError, KeyError)):
        return "value_error"
    if isinstance(exc, (RuntimeError, gym.error.ResetNeeded)):
        return "env_state"
    return None


def http_error_body(error: APIError) -> dict[str, Any]:
    """An HTTP error response's body: FastAPI's and OpenEnv's ``detail`` beside chatenv's ``error`` object.

    A 422 (an action of the wrong shape) has ``detail`` as FastAPI writes validation errors: a list of
    ``{"type", "loc", "msg"}``; every other error's ``detail`` is its message.
    """
    detail: Any = error.message
    if error.status == 422:
        loc = ["body", *(error.param or "action").split(".")]
        detail = [{"type": error.code or "invalid", "loc": loc, "msg": error.message}]
    return {"detail": detail, **error.body()}


def error_frame(error: APIError) -> dict[str, Any]:
    """A WebSocket error frame, as OpenEnv's clients read it (``data.message``, ``data.code``), plus chatenv's."""
    from chatenv.envserver.protocol import openenv_code

    data = {"message": error.message, "code": openenv_code(error.code), "reason": error.code, "status": error.status,
            "param": error.param, "type": error.type}  # fmt: skip
    return {"type": "error", "data": data}


def raise_error(status: int, body: Any) -> None:
    """Raise what an error says (an HTTP body or a frame's data): the exception of its code, else ``APIError``.

    ``APIError`` carries the status and code (``session_evicted``, ``session_not_found``, ``invalid_api_key``...).
    """
    error = body.get("error") if isinstance(body, Mapping) else None
    if isinstance(body, Mapping) and "reason" in body:  # a WebSocket error frame's data
        error = {**body, "code": body["reason"]}
    if not isinstance(error, Mapping):
        raise APIError(f"the env server answered {status}: {str(body)[:300]}", status=status, type="server_error")
    message, code, param = str(error.get("message", "")), error.get("code"), error.get("param")
    kind = ERRORS.get(code, (status, None))[1] if isinstance(code, str) else None
    if kind is not None:
        raise kind(message)
    raise APIError(
        message,
        status=status,
        code=code if isinstance(code, str) else None,
        param=param if isinstance(param, str) else None,
        type=str(error.get("type") or "invalid_request_error"),
    )


def to_json(value: Any) -> Any:
    """``value`` as JSON values: arrays and tensors as lists, numpy scalars as Python numbers, tuples as lists.

    Anything else that JSON cannot hold becomes its ``repr`` (task state of custom types is shown, not kept).
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value if type(value) in (bool, int, str) or value is None else _plain(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, np.generic):
        return to_json(value.item())
    if isinstance(value, np.ndarray):
        return to_json(value.tolist())
    if hasattr(value, "detach") and hasattr(value, "tolist"):  # a torch tensor
        return to_json(value.detach().cpu().tolist())
    if hasattr(value, "ids") and hasattr(value, "log_probs"):  # a ScoredAction: its ids are the reply
        return to_json(value.ids)
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json(v) for v in value]
    return repr(value)


def _plain(value: Any) -> Any:
    """A str/int/bool subclass (a PromptText, an IntEnum) as the plain value."""
    for kind in (bool, int, str):
        if isinstance(value, kind):
            return kind(value)
    return value


def space_spec(space: gym.spaces.Space[Any]) -> dict[str, Any]:
    """A chat env's observation or action space as JSON (:func:`space_from_spec` builds it back).

    Raises:
        TypeError: For a space that is not one of the chat envs' spaces.
    """
    if isinstance(space, TokenIds):
        return {"type": "TokenIds", "vocab_size": space.vocab_size, "min_length": space.min_length,
                "max_length": space.max_length}  # fmt: skip
    if isinstance(space, ChatText):
        return {"type": "ChatText", "min_length": space.min_length, "max_length": space.max_length}
    if isinstance(space, MessagesSpace):
        return {"type": "MessagesSpace", "max_messages": space.max_messages, "max_length": space.max_length,
                "roles": list(space.roles)}  # fmt: skip
    if isinstance(space, gym.spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    raise TypeError(f"the env server serves chat envs; their spaces are chatenv's, got {space!r}")


def space_from_spec(spec: Mapping[str, Any]) -> gym.spaces.Space[Any]:
    """The space :func:`space_spec` described.

    Raises:
        ValueError: For an unknown space type.
    """
    kind = spec.get("type")
    if kind == "TokenIds":
        return TokenIds(int(spec["vocab_size"]), min_length=int(spec["min_length"]), max_length=spec["max_length"])
    if kind == "ChatText":
        return ChatText(int(spec["max_length"]), min_length=int(spec["min_length"]))
    if kind == "MessagesSpace":
        return MessagesSpace(spec["max_messages"], int(spec["max_length"]), tuple(spec["roles"]))
    if kind == "Discrete":
        return gym.spaces.Discrete(int(spec["n"]), start=int(spec["start"]))
    raise ValueError(f"unknown space type {kind!r} in the server's /info")
