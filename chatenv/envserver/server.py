"""Running the env server: in a background thread of this process (:class:`EnvServer`), or in the foreground.

Example:
    ``with EnvServer("chatenv/Arithmetic-v0", input_mode="tokens") as server: EnvClient(server.url)`` gives a
    Gymnasium env whose every call runs on the server's env (one env per client session).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import gymnasium as gym

from chatenv.envserver.app import create_env_app
from chatenv.envserver.sessions import EnvService, env_info
from chatenv.web import ThreadedServer, check_binding, require_serve_extra

__all__ = ["EnvServer", "make_service", "serve_env_forever"]


def make_service(env_id: str, env_kwargs: dict[str, Any] | None = None, *, max_sessions: int = 64) -> EnvService:
    """The sessions of ``env_id`` (made with ``gymnasium.make(env_id, **env_kwargs)``), checked by making one env.

    Raises:
        gymnasium.error.Error: For an unknown env id.
        TypeError, ValueError: For env kwargs the env refuses.
    """
    kwargs = dict(env_kwargs or {})
    make = functools.partial(gym.make, env_id, **kwargs)
    probe = make()
    try:
        info = env_info(probe, env_id, kwargs)
    finally:
        probe.close()
    return EnvService(make, info, max_sessions=max_sessions)


class EnvServer(ThreadedServer):
    """The env server on a background thread (run as the capture endpoint runs: :class:`ThreadedServer`).

    Args:
        env_id: A registered env id (``chatenv envs``), or an :class:`EnvService` to serve.
        host: Interface to listen on (default loopback only; any other needs ``api_key``).
        port: Port (0: a free one, bound before the server starts so its URL is known at once).
        api_key: Clients must send ``Authorization: Bearer <api_key>`` (one key or several).
        max_sessions: Most open sessions (the least recently used idle one is closed for a new one; default 64).
        log_level: uvicorn's log level.
        **env_kwargs: Arguments of ``gymnasium.make(env_id, ...)`` (``input_mode="tokens"``, ``max_turns``...).

    ``url`` is the server's address; ``start()``/``stop()`` (or ``with``) run and stop it, and ``stop`` closes every
    session's env.

    Raises:
        MissingDependencyError: Without the ``serve`` extra.
        ValueError: For a non-loopback ``host`` without ``api_key``.
        TypeError: For an :class:`EnvService` given with ``max_sessions`` or env kwargs (it has its own).
    """

    kind = "env server"

    def __init__(
        self,
        env_id: str | EnvService,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | Sequence[str] | None = None,
        max_sessions: int | None = None,
        log_level: str = "warning",
        **env_kwargs: Any,
    ):
        if isinstance(env_id, EnvService) and (max_sessions is not None or env_kwargs):
            given = ["max_sessions"] * (max_sessions is not None) + sorted(env_kwargs)
            raise TypeError(
                f"an EnvService has its own sessions and env: {', '.join(given)} would be ignored; "
                "pass them to make_service() instead"
            )
        require_serve_extra()
        check_binding(host, api_key)
        service = (
            env_id
            if isinstance(env_id, EnvService)
            else make_service(env_id, env_kwargs, max_sessions=64 if max_sessions is None else max_sessions)
        )
        app = create_env_app(service, api_key=api_key)
        super().__init__(app, service, host=host, port=port, log_level=log_level)
        self.service: EnvService = service


def serve_env_forever(
    env_id: str,
    env_kwargs: dict[str, Any] | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | Sequence[str] | None = None,
    max_sessions: int = 64,
    log_level: str = "info",
) -> None:
    """Serve ``env_id`` in the foreground until interrupted (what ``chatenv serve-env`` runs).

    Raises:
        MissingDependencyError: Without the ``serve`` extra.
        ValueError: For a non-loopback ``host`` without ``api_key``.
    """
    require_serve_extra()
    check_binding(host, api_key)
    import uvicorn

    service = make_service(env_id, env_kwargs, max_sessions=max_sessions)
    try:
        app = create_env_app(service, api_key=api_key)
        uvicorn.run(app, host=host, port=port, log_level=log_level, lifespan="off", ws="websockets-sansio")
    finally:
        service.close()
