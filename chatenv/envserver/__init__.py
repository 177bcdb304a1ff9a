"""Registered envs over HTTP and WebSocket with OpenEnv's protocol, and Gymnasium envs on such servers.

``chatenv serve-env chatenv/Arithmetic-v0 --env-kwargs '{"input_mode": "tokens"}'`` (or :class:`EnvServer` in a
thread) serves an env id as openenv-core's clients and ``openenv validate`` expect (typed actions, observations as
objects, ``/schema``, ``/metadata``, ``/mcp``, OpenEnv's error frames, one env per WebSocket connection; see
:mod:`chatenv.envserver.protocol`), plus sessions, forks, ``GET /info`` and API keys (:mod:`chatenv.envserver.app`).
:class:`EnvClient` is a session of it as a ``gymnasium.Env`` (spaces and chat views from the server,
``transport="http"`` or ``"ws"``); :class:`RemoteEnv` is an env on any OpenEnv server as a ``gymnasium.Env``
(:mod:`chatenv.envserver.remote`, no openenv-core needed).

fastapi and uvicorn (the ``serve`` extra) are imported when a server is built; the clients need httpx (and
websockets for a WebSocket).
"""

from chatenv.envserver.client import EnvClient
from chatenv.envserver.remote import RemoteEnv
from chatenv.envserver.server import EnvServer, make_service, serve_env_forever
from chatenv.envserver.sessions import EnvService

__all__ = [
    "EnvClient",
    "EnvServer",
    "EnvService",
    "RemoteEnv",
    "make_service",
    "serve_env_forever",
]
