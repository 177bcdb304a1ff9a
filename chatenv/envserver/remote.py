"""``RemoteEnv``: any OpenEnv server's env as a Gymnasium env, over OpenEnv's WebSocket protocol.

It speaks the wire protocol itself (httpx for ``GET /schema`` and ``/metadata``, websockets for ``WS /ws``; no
openenv-core): one connection is one env on the server (OpenEnv gives each connection its own), so each
``RemoteEnv`` has its own episode. OpenEnv's HTTP ``/reset`` and ``/step`` make a fresh env per request and keep
no episode, which is why the episode goes over the WebSocket.

Spaces come from the server's JSON schemas (:func:`space_from_schema`): an object with properties is a ``Dict``, a
string :class:`~chatenv.spaces.ChatText`, an integer a scalar int64 ``Box`` (bounded by the schema's
``minimum``/``maximum``, else by JSON's exact integer range, ±2**53), a number a scalar float64 ``Box``, a boolean
``Discrete(2)``, an array a ``Sequence`` (its values as tuples); anything else (unions, nullable fields, free-form
objects) a :class:`JSONValue`, which holds any JSON value as it came. The action space has the action's required
fields; the observation space the observation's fields but ``done``, ``reward`` and ``metadata``, which OpenEnv
sends beside the observation. Observations are converted to those spaces' values (:meth:`RemoteEnv.observe`);
actions are sent as JSON (numpy values as Python ones).

``step`` returns the server's reward (0.0 when it sends none; ``info["reward"]`` has what it sent), and
``terminated = done`` and ``truncated = False`` unless the server says ``terminated``/``truncated`` itself (chatenv's
env server does). An error frame raises: ``ValueError`` for OpenEnv's ``VALIDATION_ERROR`` (an action of the wrong
shape), ``RuntimeError`` for ``EXECUTION_ERROR`` (the env refused the call), :class:`~chatenv.errors.APIError` for
the rest, each with the server's message and code; chatenv's env server's errors raise what its
:class:`~chatenv.envserver.EnvClient` raises. A timeout or a closed connection breaks the env (make a new one).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np

from chatenv.envserver.wire import raise_error, to_json
from chatenv.errors import APIError
from chatenv.spaces import ChatText

__all__ = ["JSONValue", "RemoteEnv", "space_from_schema"]

#: JSON's exact integer range (what an integer field without bounds holds)
_JSON_INT = 2**53
#: the fields of OpenEnv's observations that travel beside the observation, not in it
_BESIDE = ("done", "reward", "metadata")


class JSONValue(gym.spaces.Space[Any]):
    """Any JSON value (a field whose schema has no plainer space); samples are its schema's ``default`` or null.

    Args:
        schema: The field's JSON schema (kept for reference).
    """

    def __init__(self, schema: Mapping[str, Any] | None = None, seed: Any = None):
        super().__init__(None, None, seed)
        self.schema = dict(schema or {})

    @property
    def is_np_flattenable(self) -> bool:
        """JSON values have no fixed shape."""
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> Any:
        """The schema's ``default`` (None without one)."""
        return self.schema.get("default")

    def contains(self, x: Any) -> bool:
        """Whether ``x`` is a JSON value (None, bool, int, finite float, str, or lists and str-keyed dicts of them)."""
        if x is None or isinstance(x, (bool, int, str)):
            return True
        if isinstance(x, float):
            return math.isfinite(x)
        if isinstance(x, (list, tuple)):
            return all(self.contains(v) for v in x)
        return isinstance(x, dict) and all(isinstance(k, str) and self.contains(v) for k, v in x.items())

    def __repr__(self) -> str:
        return "JSONValue()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JSONValue) and self.schema == other.schema


def _resolve(schema: Mapping[str, Any], root: Mapping[str, Any]) -> Mapping[str, Any]:
    """``schema`` with a local ``$ref`` (``#/$defs/Name``, as pydantic writes nested models) followed."""
    seen = 0
    while isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#/") and seen < 32:
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target.get(part, {}) if isinstance(target, Mapping) else {}
        schema, seen = target, seen + 1
    return schema


def space_from_schema(
    schema: Mapping[str, Any], root: Mapping[str, Any] | None = None, *, required_only: bool = False
) -> gym.spaces.Space[Any]:
    """The Gymnasium space of values that a JSON schema describes (see the module docstring for the mapping).

    Args:
        schema: The JSON schema.
        root: The document its ``$ref``s point into (default: ``schema``).
        required_only: For an object, only its required properties (what an action must have).
    """
    root = schema if root is None else root
    schema = _resolve(schema, root)
    kind = schema.get("type")
    if kind == "object" and isinstance(schema.get("properties"), Mapping) and schema["properties"]:
        required = set(schema.get("required", []))
        keys = [k for k in schema["properties"] if not required_only or k in required]
        return gym.spaces.Dict({k: space_from_schema(schema["properties"][k], root) for k in keys})
    if kind == "string":
        return ChatText(int(schema.get("maxLength", 1 << 20)), min_length=int(schema.get("minLength", 0)))
    if kind == "integer":
        low, high = schema.get("minimum", -_JSON_INT), schema.get("maximum", _JSON_INT)
        return gym.spaces.Box(low=int(low), high=int(high), shape=(), dtype=np.int64)
    if kind == "number":
        low, high = schema.get("minimum", -np.inf), schema.get("maximum", np.inf)
        return gym.spaces.Box(low=float(low), high=float(high), shape=(), dtype=np.float64)
    if kind == "boolean":
        return gym.spaces.Discrete(2)
    if kind == "array" and isinstance(schema.get("items"), Mapping):
        return gym.spaces.Sequence(space_from_schema(schema["items"], root))
    return JSONValue(schema)


def _value(space: gym.spaces.Space[Any], value: Any) -> Any:
    """A JSON value as a value of ``space`` (what :func:`space_from_schema` made); left as is where it does not fit."""
    if isinstance(space, gym.spaces.Dict) and isinstance(value, Mapping):
        return {k: _value(space[k], value[k]) if k in space.spaces else value[k] for k in value}
    if isinstance(space, gym.spaces.Box) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return np.asarray(value, dtype=space.dtype)
    if isinstance(space, gym.spaces.Discrete) and isinstance(value, bool):
        return np.int64(value)
    if isinstance(space, gym.spaces.Sequence) and isinstance(value, list):
        return tuple(_value(space.feature_space, v) for v in value)
    return value


class RemoteEnv(gym.Env[Any, Any]):
    """An env on any OpenEnv server, as a Gymnasium env (its own env there: one WebSocket connection).

    Args:
        base_url: The server, ``http://host:port`` (or ``https://``).
        api_key: Sent as ``Authorization: Bearer <api_key>`` (chatenv's env server with keys).
        timeout: Seconds to wait for an answer.

    Attributes:
        schemas: The server's ``GET /schema`` (action, observation, state).
        env_metadata: Its ``GET /metadata`` (None if it has none).

    Raises:
        APIError: If the server cannot be reached, has no ``/schema``, or refuses the connection.
    """

    metadata = {"render_modes": [], "render_fps": 1}

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 60.0):
        import httpx

        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._ws: Any = None
        self._broken: str | None = None
        try:
            with httpx.Client(base_url=self.base_url, headers=self._headers, timeout=timeout) as http:
                response = http.get("/schema")
                meta = http.get("/metadata")
        except httpx.HTTPError as e:
            raise APIError(f"the OpenEnv server at {self.base_url} cannot be reached: {e}", status=0,
                           type="connection_error") from e  # fmt: skip
        if response.status_code != 200:
            raise APIError(f"GET {self.base_url}/schema answered {response.status_code}: {response.text[:200]}",
                           status=response.status_code, type="server_error")  # fmt: skip
        self.schemas: dict[str, Any] = response.json()
        self.env_metadata: dict[str, Any] | None = meta.json() if meta.status_code == 200 else None
        self.action_space = space_from_schema(self.schemas["action"], required_only=True)
        observation = dict(self.schemas["observation"])
        observation["properties"] = {k: v for k, v in observation.get("properties", {}).items() if k not in _BESIDE}
        self.observation_space = space_from_schema(observation, self.schemas["observation"])
        self._connect()

    # ------------------------------------------------------------------------------------------ transport

    def _connect(self) -> None:
        from websockets.sync.client import connect

        url = "ws" + self.base_url[len("http") :] + "/ws" if self.base_url.startswith("http") else self.base_url
        try:
            # entered as a context manager (what websockets asks of a direct connection); left in close()
            self._ws = connect(
                url, additional_headers=self._headers, open_timeout=self.timeout, max_size=None
            ).__enter__()
        except Exception as e:
            raise APIError(f"no WebSocket to the OpenEnv server at {url}: {e}", status=0,
                           type="connection_error") from e  # fmt: skip

    def _send(self, kind: str, data: Any = None) -> Any:
        """Send one message and return its answer's data; an error frame raises (see the module docstring)."""
        from websockets.exceptions import ConnectionClosed

        if self._ws is None or self._broken is not None:
            raise APIError(f"the connection to the OpenEnv server is closed: {self._broken or 'closed'}", status=0,
                           type="connection_error")  # fmt: skip
        message = {"type": kind} if data is None else {"type": kind, "data": data}
        try:
            self._ws.send(json.dumps(message))
            reply = json.loads(self._ws.recv(timeout=self.timeout))
        except (TimeoutError, ConnectionClosed) as e:
            self._broken = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self._ws.close()
            raise APIError(f"the WebSocket to the OpenEnv server failed ({self._broken}); make a new RemoteEnv",
                           status=0, type="connection_error") from e  # fmt: skip
        if reply.get("type") == "error":
            _raise_frame(reply.get("data"))
        return reply.get("data")

    # ------------------------------------------------------------------------------------------ the env

    def observe(self, observation: Any) -> Any:
        """The server's observation as a value of :attr:`observation_space`."""
        return _value(self.observation_space, observation)

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Start an episode; ``options`` are sent as the reset's other arguments (OpenEnv's reset kwargs)."""
        super().reset(seed=seed)
        data = {**to_json(dict(options or {})), **({} if seed is None else {"seed": seed})}
        answer = self._send("reset", data)
        return self.observe(answer.get("observation", {})), self._info(answer)

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """One step with ``action`` (a mapping of the action's fields; numpy values are sent as Python ones)."""
        if not isinstance(action, Mapping):
            raise TypeError(f"an OpenEnv action is a mapping of its fields, got {type(action).__name__}")
        answer = self._send("step", to_json(action))
        done = bool(answer.get("done", False))
        terminated = bool(answer.get("terminated", done))
        truncated = bool(answer.get("truncated", False))
        reward = answer.get("reward")
        return self.observe(answer.get("observation", {})), 0.0 if reward is None else float(reward), terminated, \
            truncated, self._info(answer)  # fmt: skip

    @staticmethod
    def _info(answer: Mapping[str, Any]) -> dict[str, Any]:
        info = dict(answer.get("info") or {})
        info["reward"] = answer.get("reward")
        return info

    def state(self) -> dict[str, Any]:
        """The server's state of this env (OpenEnv's ``episode_id``, ``step_count`` and the env's own fields)."""
        state: dict[str, Any] = self._send("state")
        return state

    def close(self) -> None:
        """End the connection (the server closes this env); safe to call twice."""
        if self._ws is None:
            return
        ws, self._ws = self._ws, None
        try:
            if self._broken is None:
                ws.send(json.dumps({"type": "close"}))
        except Exception:  # noqa: BLE001 - already gone: nothing left to close
            pass
        ws.__exit__(None, None, None)

    def __repr__(self) -> str:
        name = (self.env_metadata or {}).get("name", "?")
        return f"RemoteEnv({self.base_url!r}, {name!r})"


#: OpenEnv's error code -> the exception raised
_RAISES: dict[str, type[Exception]] = {"VALIDATION_ERROR": ValueError, "EXECUTION_ERROR": RuntimeError}


def _raise_frame(data: Any) -> None:
    """Raise what an error frame says (chatenv's frames as its EnvClient does)."""
    if not isinstance(data, Mapping):
        raise APIError(f"the OpenEnv server sent an error frame without data: {data!r:.200}", status=0,
                       type="server_error")  # fmt: skip
    if "reason" in data:  # chatenv's env server
        raise_error(int(data.get("status", 500)), data)
    message, code = str(data.get("message", "")), str(data.get("code", ""))
    kind = _RAISES.get(code)
    if kind is not None:
        raise kind(f"{message} (code: {code})")
    raise APIError(f"{message} (code: {code})", status=0, code=code or None, type="server_error")
