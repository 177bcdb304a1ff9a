"""Running an ASGI app with uvicorn on a background thread of this process, its socket bound first."""

from __future__ import annotations

import socket
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["ThreadedServer"]


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
