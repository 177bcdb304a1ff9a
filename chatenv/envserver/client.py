"""``EnvClient``: a served env as a Gymnasium env, over HTTP or a WebSocket.

Each client is one session of the server (its own env there): ``reset``/``step`` run on the server's env, and
the spaces are the server's (``GET /info``). The chat views that :func:`chatenv.check` and policies read
(``token_ids``, ``token_view()``, ``messages``, ``turn``, ``episode``) come from ``GET /state``; ``tokenizer`` and
``chat_tokenizer`` are built here, the embedded tokenizer or ``AutoTokenizer`` of the server's path (or pass
``tokenizer=``). ``fork()`` asks the server for a copy of the session (:func:`chatenv.fork` works on a client).
Actions are sent as the server's OpenEnv action objects (:mod:`chatenv.envserver.protocol`: text or a message dict
as ``{"message": ...}``, ids as ``{"tokens": [...]}``, a token-level env's id as ``{"token": id}``) and observations
read back from its observation objects, so a client steps as the env in process does.
A refused call raises what the env raised (``TypeError``/``ValueError`` for a bad action, ``RuntimeError`` for
a step before reset or after the episode ended) and leaves the server's env unchanged. An error that is not the
server's JSON error body raises :class:`~chatenv.errors.APIError` with its status and text. A WebSocket that times
out or closes is closed here and the client is then broken: every later call raises ``APIError``.
"""

from __future__ import annotations

import json
import types
import uuid
from collections.abc import Mapping
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from chatenv.envserver.protocol import observation_key
from chatenv.envserver.wire import raise_error, space_from_spec, to_json
from chatenv.errors import APIError
from chatenv.web import SESSION_HEADER

__all__ = ["EnvClient"]

_PATHS = {"reset": ("POST", "/reset"), "step": ("POST", "/step"), "state": ("GET", "/state"),
          "fork": ("POST", "/fork"), "info": ("GET", "/info"), "close": ("DELETE", "/session")}  # fmt: skip


class _RemoteTools:
    """The served env's tools, as far as a client needs them: their schemas (what the prompt renders)."""

    def __init__(self, schemas: list[dict[str, Any]]):
        self._schemas = schemas

    def schemas(self) -> list[dict[str, Any]]:
        """The tool schemas (a copy)."""
        return json.loads(json.dumps(self._schemas))  # type: ignore[no-any-return]


class EnvClient(gym.Env[Any, Any]):
    """A session of an env server (``chatenv serve-env``) as a Gymnasium env.

    Args:
        base_url: The server, ``http://host:port``.
        env_id: The env id the server must serve (checked against ``/info``; None: any).
        transport: ``"http"`` (a request per call) or ``"ws"`` (one WebSocket, lower latency).
        api_key: Sent as ``Authorization: Bearer <api_key>``.
        session_id: This client's session (default: a fresh random id).
        timeout: Seconds to wait for an answer.
        tokenizer: The served env's tokenizer, if it is neither the embedded one nor loadable from its path.

    Raises:
        ValueError: If the server serves another env id.
        APIError: If the server cannot be reached or refuses the client (its status and code).
    """

    metadata = {"render_modes": [], "render_fps": 1}

    def __init__(
        self,
        base_url: str,
        env_id: str | None = None,
        *,
        transport: str = "http",
        api_key: str | None = None,
        session_id: str | None = None,
        timeout: float = 60.0,
        tokenizer: Any = None,
        _info: Mapping[str, Any] | None = None,
    ):
        import httpx

        if transport not in ("http", "ws"):
            raise ValueError(f"transport must be 'http' or 'ws', got {transport!r}")
        self.base_url, self.transport, self.timeout = base_url.rstrip("/"), transport, timeout
        self.session_id = session_id or uuid.uuid4().hex
        self._api_key, self._tokenizer = api_key, tokenizer
        self._headers = {SESSION_HEADER: self.session_id}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._http: Any = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=timeout)
        self._ws: Any = None
        self._broken: str | None = None  # why the WebSocket was closed under this client
        self._closed = False
        try:
            self.info: dict[str, Any] = dict(_info) if _info is not None else self._request("GET", "/info", None)
        except BaseException:
            self._http.close()
            raise
        if env_id is not None and env_id != self.info["env_id"]:
            self._http.close()
            raise ValueError(f"the server at {self.base_url} serves {self.info['env_id']!r}, not {env_id!r}")
        self.observation_space = space_from_spec(self.info["observation_space"])
        self.action_space = space_from_spec(self.info["action_space"])
        self.input_mode: str = self.info["input_mode"]
        self._obs_key = observation_key(self.info)
        self.vocab_size: int = int(self.info["vocab_size"])
        schemas = self.info.get("tools")
        self.tools = None if schemas is None else _RemoteTools(schemas)
        if transport == "ws":
            self._connect()

    # ------------------------------------------------------------------------------------------ transport

    def _request(self, method: str, path: str, body: Any) -> Any:
        import httpx

        try:
            response = (
                self._http.request(method, path, json=body) if body is not None else self._http.request(method, path)
            )
        except httpx.HTTPError as e:
            raise APIError(
                f"the env server at {self.base_url} cannot be reached: {e}", status=0, type="connection_error"
            ) from e
        try:
            data = response.json() if response.content else None
        except ValueError:  # not JSON: a proxy's or the server's plain-text error page
            raise APIError(
                f"the env server answered {response.status_code}: {response.text[:300]}",
                status=response.status_code,
                type="server_error",
            ) from None
        if response.status_code >= 400:
            raise_error(response.status_code, data)
        return data

    def _connect(self) -> None:
        from websockets.sync.client import connect

        url = "ws" + self.base_url[len("http") :] + "/ws"
        try:
            # entered as a context manager (what websockets asks of a direct connection); left in close()
            self._ws = connect(
                url, additional_headers=self._headers, open_timeout=self.timeout, max_size=None
            ).__enter__()
        except Exception as e:
            self._http.close()
            raise APIError(f"no WebSocket to the env server at {url}: {e}", status=0, type="connection_error") from e

    def _call(self, kind: str, body: Any = None) -> Any:
        if self._closed:
            raise RuntimeError("this EnvClient is closed")
        if self.transport == "http":
            method, path = _PATHS[kind]
            return self._request(method, path, body)
        if self._broken is not None:
            raise APIError(f"the WebSocket to the env server is closed: {self._broken}", status=0,
                           type="connection_error")  # fmt: skip
        reply = json.loads(self._ws_exchange(json.dumps({"type": kind, "data": body})))
        if reply.get("type") == "error":
            data = reply.get("data")
            raise_error(int(data.get("status", 500)) if isinstance(data, Mapping) else 500, data)
        return reply.get("data")

    def _ws_exchange(self, message: str) -> Any:
        """Send one message and wait for its reply.

        A timeout or a closed connection closes the socket for good: a late reply must never be read as the next
        call's.
        """
        from websockets.exceptions import ConnectionClosed

        try:
            self._ws.send(message)
            return self._ws.recv(timeout=self.timeout)
        except (TimeoutError, ConnectionClosed) as e:
            self._broken = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            self._ws.close()
            raise APIError(
                f"the WebSocket to the env server failed ({self._broken}); make a new EnvClient",
                status=0,
                type="connection_error",
            ) from e

    # ------------------------------------------------------------------------------------------ the env

    def _obs(self, observation: Mapping[str, Any]) -> Any:
        """The env's observation from the server's observation object (its one field)."""
        value = observation[self._obs_key]
        if self._obs_key == "tokens":
            return np.asarray(value, dtype=np.int64)
        return value

    def _action(self, action: Any) -> dict[str, Any]:
        """The OpenEnv action object for ``action`` (text or a message dict, ids, or one token id)."""
        if isinstance(self.action_space, gym.spaces.Discrete):
            return {"token": to_json(action)}
        if isinstance(action, (str, Mapping)) and not hasattr(action, "batch_size"):
            return {"message": action}
        return {"tokens": to_json(action)}

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Start an episode in this client's session (made on the server by its first reset)."""
        super().reset(seed=seed)
        data = self._call("reset", {"seed": seed, "options": None if options is None else to_json(options)})
        return self._obs(data["observation"]), data["info"]

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """One step of the server's env (arrays, tensors and a ScoredAction's ids are sent as lists of ints)."""
        typed = self._action(action)
        data = self._call("step", {"action": typed} if self.transport == "http" else typed)
        return (
            self._obs(data["observation"]),
            float(data["reward"]),
            data["terminated"],
            data["truncated"],
            data["info"],
        )

    def state(self) -> dict[str, Any]:
        """The session's episode as the server sees it (``GET /state``)."""
        state: dict[str, Any] = self._call("state")
        return state

    def fork(self, *, episode: bool = True) -> EnvClient:
        """A new session on the server with a copy of this one's env (``episode=False``: a fresh env like it)."""
        new_id = uuid.uuid4().hex
        self._call("fork", {"session_id": new_id, "episode": episode})
        return EnvClient(
            self.base_url,
            transport=self.transport,
            api_key=self._api_key,
            session_id=new_id,
            timeout=self.timeout,
            tokenizer=self._tokenizer,
            _info=self.info,
        )

    def close(self) -> None:
        """Close the session on the server and the connection (safe to call twice)."""
        if self._closed:
            return
        try:
            self._call("close")
        except (APIError, RuntimeError):
            pass  # never reset, evicted or already gone: nothing left to close
        finally:
            self._closed = True
            if self._ws is not None:
                self._ws.__exit__(None, None, None)
            self._http.close()

    # ------------------------------------------------------------------------------------------ chat views

    @property
    def tokenizer(self) -> Any:
        """The served env's tokenizer (loaded here on first use)."""
        if self._tokenizer is None:
            described = self.info["tokenizer"]
            if described["embedded"]:
                from chatenv.envs.base import shared_default_tokenizer

                self._tokenizer = shared_default_tokenizer()
            else:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(described["name_or_path"])
        return self._tokenizer

    @property
    def chat_tokenizer(self) -> Any:
        """The served env's :class:`~chatenv.tokenization.ChatTokenizer` (its tokenizer and template)."""
        from chatenv.tokenization import chat_tokenizer

        return chat_tokenizer(self.tokenizer, self.info["template"])

    @property
    def token_ids(self) -> npt.NDArray[np.int64]:
        """The ids of the current observation."""
        return np.asarray(self.state()["token_ids"], dtype=np.int64)

    def token_view(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """The current observation as ids with their assistant mask."""
        state = self.state()
        return np.asarray(state["token_ids"], dtype=np.int64), np.asarray(state["assistant_mask"], dtype=bool)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat so far."""
        messages: list[dict[str, Any]] = self.state()["messages"]
        return messages

    @property
    def turn(self) -> int:
        """Assistant turns finished in the current episode."""
        return int(self.state()["turn"])

    @property
    def done(self) -> bool:
        """Whether the current episode has ended."""
        return bool(self.state()["done"])

    @property
    def episode(self) -> Any:
        """The current episode's ``assistant_mask`` and task ``state`` (None before the first reset)."""
        state = self.state()
        if state["episode_id"] is None:
            return None
        return types.SimpleNamespace(
            assistant_mask=np.asarray(state["assistant_mask"], dtype=bool), state=state["task_state"]
        )

    def __repr__(self) -> str:
        return f"EnvClient({self.base_url!r}, {self.info['env_id']!r}, session={self.session_id!r})"
