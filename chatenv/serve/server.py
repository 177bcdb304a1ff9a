"""Running the capture endpoint: in a background thread of this process, or in the foreground (``chatenv serve``).

:class:`CaptureServer` binds a socket (port 0: a free port) before uvicorn starts, so its URL is known at once and
no other process can take the port in between; ``with CaptureServer(policy) as server:`` starts it and stops it
(the socket closed, the policy worker stopped).

Example:
    ``with CaptureServer(policy) as server: openai.OpenAI(base_url=server.base_url("s1"), api_key="x")`` gives an
    OpenAI client whose requests are recorded in session ``s1`` (``server.session("s1")``).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chatenv.serve.app import check_binding, create_app, require_serve_extra
from chatenv.serve.service import CaptureService

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["CaptureServer", "ThreadedServer", "serve_forever"]


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


class ThreadedServer:
    """An ASGI app served by uvicorn on a background thread of this process (the socket bound first).

    The capture endpoint (:class:`CaptureServer`) and the env server (:class:`chatenv.envserver.EnvServer`) run
    this way. ``start()``/``stop()`` (or ``with``) run and stop it; ``stop`` also closes the service.

    Args:
        app: The ASGI app.
        service: What the app serves (closed by :meth:`stop`).
        host: Interface to listen on.
        port: Port (0: a free one, bound before the server starts so :attr:`url` is known at once).
        log_level: uvicorn's log level.
    """

    #: what the server is, in errors
    kind = "server"

    def __init__(self, app: Any, service: Any, *, host: str, port: int, log_level: str):
        self.app, self.service = app, service
        self.host, self._port_asked, self.log_level = host, port, log_level
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` of the running server."""
        if self.port is None:
            raise RuntimeError("the server is not running; call start() or use it as a context manager")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> Self:
        """Start serving (returns once the server accepts connections).

        Raises:
            RuntimeError: If it is already running, or does not start within ``timeout`` seconds.
        """
        import uvicorn

        if self._thread is not None:
            raise RuntimeError(f"the {self.kind} is already running")
        self._socket = _bind(self.host, self._port_asked)
        self.port = self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, log_level=self.log_level, lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="chatenv-serve", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the {self.kind} did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and release the socket and the service (safe to call twice)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._socket is not None:
            self._socket.close()
        self.service.close()
        self._server = self._thread = self._socket = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class CaptureServer(ThreadedServer):
    """The capture endpoint on a background thread.

    Args:
        policy: A generating policy (or a :class:`~chatenv.serve.service.CaptureService`).
        host: Interface to listen on (default loopback only; any other needs ``api_key``).
        port: Port (0: a free one).
        api_key: Clients must send ``Authorization: Bearer <api_key>`` (the OpenAI client's ``api_key``); a list of
            keys gives each key its own sessions.
        log_level: uvicorn's log level.
        **options: :class:`~chatenv.serve.service.CaptureService` options (``model_name``, ``max_context``, ...).

    Raises:
        MissingDependencyError: Without the ``serve`` extra.
    """

    kind = "capture server"

    def __init__(
        self,
        policy: Any,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        api_key: str | Sequence[str] | None = None,
        **options: Any,
    ):
        require_serve_extra()
        check_binding(host, api_key)
        service = policy if isinstance(policy, CaptureService) else CaptureService(policy, **options)
        super().__init__(create_app(service, api_key=api_key), service, host=host, port=port, log_level=log_level)
        self.service: CaptureService = service

    def base_url(self, session: str | None = None) -> str:
        """The OpenAI base URL: ``/v1``, or ``/s/{session}/v1`` to record every request in ``session``."""
        return f"{self.url}/v1" if session is None else f"{self.url}/s/{session}/v1"

    @property
    def store(self) -> Any:
        """The sessions (:class:`~chatenv.serve.sessions.SessionStore`)."""
        return self.service.store

    def session(self, session_id: str) -> dict[str, Any]:
        """A session's trajectory data (as ``GET /v1/sessions/{id}`` returns it).

        Raises:
            KeyError: For an unknown session.
        """
        found = self.service.store.get(session_id, create=False)
        if found is None:
            raise KeyError(f"no session {session_id!r}")
        return found.snapshot()


def serve_forever(
    policy: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    api_key: str | Sequence[str] | None = None,
    **options: Any,
) -> None:
    """Serve ``policy`` in the foreground until interrupted (what ``chatenv serve`` runs).

    Raises:
        MissingDependencyError: Without the ``serve`` extra.
        ValueError: For a non-loopback ``host`` without ``api_key``.
    """
    require_serve_extra()
    check_binding(host, api_key)
    import uvicorn

    service = CaptureService(policy, **options)
    try:
        app = create_app(service, api_key=api_key)
        uvicorn.run(app, host=host, port=port, log_level=log_level, lifespan="off")
    finally:
        service.close()
