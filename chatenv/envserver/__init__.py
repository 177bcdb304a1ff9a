"""Registered envs over HTTP and WebSocket: one env per client session, and a client that is a Gymnasium env.

``chatenv serve-env chatenv/Arithmetic-v0 --env-kwargs '{"input_mode": "tokens"}'`` (or :class:`EnvServer` in a
thread) serves an env id with OpenEnv's routes (``POST /reset``, ``POST /step``, ``GET /state``, ``GET /health``)
plus sessions, ``GET /info`` and ``WS /ws`` (:mod:`chatenv.envserver.app`); :class:`EnvClient` is a session of it
as a ``gymnasium.Env`` (spaces from the server, ``transport="http"`` or ``"ws"``).

fastapi and uvicorn (the ``serve`` extra) are imported when a server is built; the client needs httpx (and
websockets for ``transport="ws"``).
"""

from chatenv.envserver.client import EnvClient
from chatenv.envserver.server import EnvServer, make_service, serve_env_forever
from chatenv.envserver.sessions import EnvService

__all__ = [
    "EnvClient",
    "EnvServer",
    "EnvService",
    "make_service",
    "serve_env_forever",
]
