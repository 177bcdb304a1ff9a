"""Running the capture endpoint: in a background thread of this process, or in the foreground (``chatenv serve``).

:class:`CaptureServer` binds a socket (port 0: a free port) before uvicorn starts, so its URL is known at once and
no other process can take the port in between; ``with CaptureServer(policy) as server:`` starts it and stops it
(the socket closed, the policy worker stopped).

Example:
    ``with CaptureServer(policy) as server: openai.OpenAI(base_url=server.base_url("s1"), api_key="x")`` gives an
    OpenAI client whose requests are recorded in session ``s1`` (``server.session("s1")``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chatenv.serve.app import create_app
from chatenv.serve.service import CaptureService
from chatenv.web import ThreadedServer, check_binding, require_serve_extra

if TYPE_CHECKING:
    pass

__all__ = ["CaptureServer", "ThreadedServer", "serve_forever"]


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
        """The sessions (:class:`~chatenv.serve.store.SessionStore`)."""
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
