"""The HTTP layer both servers stand on (the capture endpoint and the env server): one set of rules.

- Sessions: a request names its session with the :data:`SESSION_HEADER` header (or a path segment or field the
  server documents); an id is 1 to 128 letters, digits or ``._:@-`` (:func:`check_session_id`), refused with 400
  before anything is created.
- API keys (:func:`api_keys`, :func:`install_key_check`): with keys, every route but ``/health`` needs
  ``Authorization: Bearer <key>``; with several keys each key is a *scope* with its own sessions. The one
  session-scope rule (:func:`scope_refusal`): another key's session is unknown to reads (404) and refused to anything
  that would create or change it (403 ``session_forbidden``), so an id never leaks nor is taken over.
- Binding (:func:`check_binding`): listening beyond loopback needs a key. The command-line servers make a key at
  start when none is given (:func:`make_local_key`, written to a file only the user who started them can read), so
  another user of the same machine cannot read, reward or delete sessions on loopback either; ``--no-api-key`` opts
  out.
- Bodies (:func:`read_json_body`): JSON, at most :data:`MAX_BODY_BYTES` (413 past it, read in chunks), anything the
  parser refuses 400 ``invalid_json``.

fastapi and uvicorn (the ``serve`` extra) are imported only by :func:`require_serve_extra` and the servers.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import re
import secrets
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from chatenv.errors import APIError, MissingDependencyError

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = [
    "MAX_BODY_BYTES",
    "SESSION_HEADER",
    "SESSION_ID",
    "api_keys",
    "check_binding",
    "check_session_id",
    "install_key_check",
    "is_loopback",
    "key_folder",
    "key_scope",
    "make_local_key",
    "loads",
    "read_json_body",
    "require_serve_extra",
    "scope_of",
    "scope_refusal",
]

#: the request header naming a session (the response repeats it)
SESSION_HEADER = "X-Session-Id"
#: what a session id may be: 1 to 128 of letters, digits and ``._:@-`` (no control or unpaired characters)
SESSION_ID = re.compile(r"[A-Za-z0-9._:@\-]{1,128}")
#: the largest request body read (bytes); larger ones are refused with 413 before anything changes
MAX_BODY_BYTES = 8 * 1024 * 1024


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (``localhost`` or a loopback address)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_binding(host: str, api_key: str | Sequence[str] | None) -> None:
    """Refuse to listen beyond loopback without an API key (any process or host could read and reward sessions).

    Raises:
        ValueError: For a non-loopback ``host`` and no ``api_key``.
    """
    if not api_key and not is_loopback(host):
        raise ValueError(
            f"listening on {host!r} reaches beyond this machine: give an API key (--api-key or CHATENV_API_KEY), "
            "or listen on 127.0.0.1"
        )


def check_session_id(value: str, where: str) -> str:
    """``value`` if it is a valid session id, else a 400 naming where it came from (nothing is created)."""
    if not SESSION_ID.fullmatch(value):
        raise APIError(
            f"{where} {value[:40]!r}{'...' if len(value) > 40 else ''} is not a valid session id: use 1 to 128 "
            "letters, digits or ._:@-",
            param="session",
            code="invalid_session_id",
        )
    return value


def require_serve_extra(what: str = "the server") -> Any:
    """Import fastapi (and check uvicorn is there); a missing one raises naming the ``serve`` extra."""
    try:
        import fastapi
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            f"{what} needs fastapi and uvicorn ({e.name} is missing); install the 'serve' extra: "
            "pip install 'chatenv-gym[serve]'"
        ) from e
    return fastapi


def too_large() -> APIError:
    """The 413 for a body over :data:`MAX_BODY_BYTES`."""
    return APIError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413, code="request_too_large")


def loads(raw: str | bytes) -> Any:
    """Parse JSON; anything the parser refuses (bad UTF-8, deep nesting, huge integers) is 400 ``invalid_json``."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None


async def read_json_body(request: Any, *, empty: Any = ...) -> Any:
    """A request's JSON body, read in chunks and refused past :data:`MAX_BODY_BYTES` (413) before it is all read.

    Args:
        request: The starlette request.
        empty: What an empty body is (default: refused as invalid JSON, as any other non-JSON body).
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large()
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise too_large()
    if not raw.strip() and empty is not ...:
        return empty
    return loads(bytes(raw))


def api_keys(api_key: str | Sequence[str] | None) -> list[str]:
    """The endpoint's API keys (none, one, or several with a session scope each), checked.

    Raises:
        ValueError: For a key shorter than 8 characters, a key given twice, or something that is not a str.
    """
    keys = [] if api_key is None else [api_key] if isinstance(api_key, str) else list(api_key)
    if not all(isinstance(k, str) and len(k) >= 8 for k in keys) or len(set(keys)) != len(keys):
        raise ValueError("api_key must be a str of at least 8 characters, or a list of distinct such keys")
    return keys


def key_folder() -> str:
    """Where :func:`make_local_key` writes keys: ``$XDG_RUNTIME_DIR/chatenv`` if set, else ``~/.cache/chatenv/keys``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "chatenv")
    return os.path.join(os.path.expanduser("~"), ".cache", "chatenv", "keys")


def make_local_key(name: str, host: str, port: int) -> tuple[str, str]:
    """A fresh random API key for a server started without one, and the file it was written to.

    The file (``<key_folder()>/<name>-<host>-<port>.key``) is created with mode 0600 in a folder of mode 0700, so
    only the user who started the server (and root) can read it; the key itself is 32 random URL-safe characters.

    Raises:
        OSError: When the folder or the file cannot be made private (a folder of another user, say).
    """
    folder = key_folder()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.stat(folder)
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        os.chmod(folder, 0o700)  # raises for a folder of another user: never write a key where others can read
    key = secrets.token_urlsafe(24)
    path = os.path.join(folder, f"{name}-{host.strip('[]').replace(':', '_')}-{port}.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), 0o600)  # an older file keeps its mode through O_TRUNC
        f.write(key + "\n")
    return key, path


def scope_refusal(session_id: str) -> APIError:
    """The 403 for a request that would create or change another API key's session (the one session-scope rule)."""
    return APIError(
        f"session {session_id!r} belongs to another API key; use another session id",
        status=403,
        code="session_forbidden",
        param="session",
    )


def scope_of(request: Any) -> int | None:
    """Which of several API keys a request came with (None with one key or none): its sessions' scope."""
    return getattr(request.state, "scope", None)


def key_scope(authorization: str, keys: Sequence[str]) -> tuple[bool, int | None]:
    """Whether an ``Authorization`` header carries one of ``keys`` (always, with none), and which key's scope.

    Each key is compared in constant time; the scope is the key's index with several keys, else None.
    """
    if not keys:
        return True, None
    given = authorization.encode()
    matches = [hmac.compare_digest(given, f"Bearer {key}".encode()) for key in keys]
    return any(matches), (matches.index(True) if len(keys) > 1 and any(matches) else None)


def install_key_check(app: FastAPI, keys: Sequence[str], refuse: Callable[[Any, APIError], Any] | None = None) -> None:
    """Require one of ``keys`` (``Authorization: Bearer <key>``) on every route of ``app`` but ``/health``.

    Sets ``request.state.scope`` (:func:`scope_of`) to the key's index when there are several keys. ``refuse(request,
    error)`` makes the 401 response (default: the error's OpenAI-shaped body), so a server can answer each API
    dialect in its own shape.
    """
    if not keys:
        return
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def _authorize(request: Any, call_next: Any) -> Any:
        allowed, request.state.scope = key_scope(request.headers.get("authorization", ""), keys)
        if request.url.path != "/health" and not allowed:
            error = APIError(
                "missing or wrong API key (send Authorization: Bearer <key>)", status=401, code="invalid_api_key"
            )
            return refuse(request, error) if refuse is not None else JSONResponse(error.body(), status_code=401)
        return await call_next(request)
