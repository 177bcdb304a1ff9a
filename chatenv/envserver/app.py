"""The FastAPI app of the env server (extra ``serve``: fastapi and uvicorn, imported when an app is built).

Routes (OpenEnv's HTTP env server's, plus sessions):

- ``POST /reset`` ``{"seed": int?, "options": {...}?}`` and ``POST /step`` ``{"action": ...}`` answer
  ``{"observation", "reward", "done", "terminated", "truncated", "info"}`` (reset: reward null, plus
  ``session_id``); values go through :func:`~chatenv.envserver.wire.to_json`, so a non-finite reward is the string
  ``"nan"``, ``"inf"`` or ``"-inf"`` (standard JSON; ``float()`` reads it back);
- ``GET /state``: the session's episode (``episode_id``, ``step_count``, ``turn``, ``done``, ``token_ids``,
  ``assistant_mask``, ``messages``, ``task_state``);
- ``POST /fork`` ``{"session_id": new, "episode": true}``: a new session with a copy of this one's env;
- ``DELETE /session`` (or ``DELETE /sessions/{id}``) closes a session; ``GET /sessions`` lists them;
- ``GET /info``: env id, kwargs, kind, input mode, spaces, tokenizer, template, tools; ``GET /health``;
- ``WS /ws``: the same calls over one connection, ``{"type": "reset" | "step" | "state" | "fork" | "info" |
  "close", "data": {...}}``, answered ``{"type": "result", "data": {...}}`` or ``{"type": "error", "status",
  "data": {"error": {...}}}``.

The session is the ``X-Session-Id`` header (a WebSocket's, at connect, or its ``?session=`` query), else
``default`` (what an OpenEnv client without sessions uses). Errors are ``{"error": {"message", "type", "param",
"code"}}``: a bad action 400 (``type_error``, ``value_error``), a body that is not JSON 400 (``invalid_json``), one
over ``MAX_BODY_BYTES`` 413, a step before reset or after the episode ended 409 (``env_state``), an unknown session
404, an evicted one 409 (``session_evicted``), a session running another call 409 (``session_busy``); the env is
left unchanged.

With several API keys, each key has its own sessions (see :mod:`chatenv.envserver.sessions`): ``GET /sessions``
lists the caller's, and another key's session id is unknown (404). Env work runs in worker threads, over HTTP and
the WebSocket alike. A WebSocket answers a binary frame, a message that is not JSON, or a call that fails with an
error frame and stays open; the sessions it used stay open when it disconnects (closed by ``close``, or evicted).

(No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations.)
"""

import hmac
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chatenv.envserver.sessions import EnvService
from chatenv.errors import APIError, error_body
from chatenv.web import (
    MAX_BODY_BYTES,
    SESSION_HEADER,
    api_keys,
    check_session_id,
    require_serve_extra,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["DEFAULT_SESSION", "create_env_app"]

#: the session of requests that name none
DEFAULT_SESSION = "default"


def _session(value: str | None, where: str) -> str:
    return DEFAULT_SESSION if not value else check_session_id(value, where)


def _too_large() -> APIError:
    return APIError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413, code="request_too_large")


def _loads(raw: str | bytes) -> Any:
    """Parse JSON; anything the parser refuses (deep nesting, huge integers included) is 400 ``invalid_json``."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None


async def _json_body(request: Any) -> Any:
    """The request's JSON body (None if empty), read in chunks and refused past ``MAX_BODY_BYTES``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise _too_large()
    return _loads(bytes(raw)) if raw.strip() else None


def _scope(request: Any) -> int | None:
    """The caller's session scope: the index of its API key when there are several (else None)."""
    return getattr(request.state, "scope", None)


def _key_index(given: str, expected: list[bytes]) -> int | None:
    """The index of the matching key (each compared, in constant time), or None."""
    matches = [hmac.compare_digest(given.encode(), e) for e in expected]
    return matches.index(True) if any(matches) else None


def create_env_app(service: EnvService, *, api_key: str | Sequence[str] | None = None) -> "FastAPI":
    """The FastAPI app serving ``service``'s sessions (see the module docstring).

    Args:
        service: The sessions and the env they are made of.
        api_key: When given, every route but ``/health`` (and the WebSocket) needs ``Authorization: Bearer <key>``;
            others get 401 (a WebSocket is closed with code 1008).

    Raises:
        MissingDependencyError: Without fastapi or uvicorn (the ``serve`` extra).
    """
    fastapi = require_serve_extra()
    from starlette.exceptions import HTTPException

    app: FastAPI = fastapi.FastAPI(title="chatenv env server", docs_url=None, redoc_url=None)
    app.state.service = service
    responses = fastapi.responses
    expected = [f"Bearer {key}".encode() for key in api_keys(api_key)]

    @app.exception_handler(APIError)
    async def _api_error(request: Any, exc: APIError) -> Any:
        return responses.JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Any, exc: HTTPException) -> Any:
        body = error_body(str(exc.detail), type="invalid_request_error", code=str(exc.status_code))
        return responses.JSONResponse(body, status_code=exc.status_code)

    if expected:

        @app.middleware("http")
        async def _authorize(request: Any, call_next: Any) -> Any:
            index = _key_index(request.headers.get("authorization", ""), expected)
            request.state.scope = index if len(expected) > 1 else None
            if request.url.path != "/health" and index is None:
                body = error_body("missing or wrong API key (send Authorization: Bearer <key>)",
                                  type="invalid_request_error", code="invalid_api_key")  # fmt: skip
                return responses.JSONResponse(body, status_code=401)
            return await call_next(request)

    _add_routes(app, service, fastapi)
    _add_websocket(app, service, fastapi, expected)
    return app


def _add_routes(app: Any, service: EnvService, fastapi: Any) -> None:
    from starlette.concurrency import run_in_threadpool

    responses = fastapi.responses

    def sid_of(request: Any) -> str:
        return _session(request.headers.get(SESSION_HEADER), SESSION_HEADER)

    async def reset(request: fastapi.Request) -> Any:
        body, sid = await _json_body(request), sid_of(request)
        result = await run_in_threadpool(service.reset, sid, body, _scope(request))
        return responses.JSONResponse(result, headers={SESSION_HEADER: sid})

    async def step(request: fastapi.Request) -> Any:
        body, sid = await _json_body(request), sid_of(request)
        return await run_in_threadpool(service.step, sid, body, _scope(request))

    async def state(request: fastapi.Request) -> Any:
        return await run_in_threadpool(service.state, sid_of(request), _scope(request))

    async def fork(request: fastapi.Request) -> Any:
        body, sid = await _json_body(request), sid_of(request)
        if isinstance(body, dict) and isinstance(body.get("session_id"), str):
            check_session_id(body["session_id"], "'session_id'")
        return await run_in_threadpool(service.fork, sid, body, _scope(request))

    async def delete(request: fastapi.Request) -> Any:
        return await run_in_threadpool(service.delete, sid_of(request), _scope(request))

    async def delete_named(session: str, request: fastapi.Request) -> Any:
        sid = _session(session, "the session path")
        return await run_in_threadpool(service.delete, sid, _scope(request))

    async def sessions(request: fastapi.Request) -> Any:
        return {"sessions": service.ids(_scope(request)), "max_sessions": service.max_sessions}

    async def info() -> Any:
        return service.info

    async def health() -> Any:
        return {"status": "healthy", "sessions": len(service)}

    app.post("/reset")(reset)
    app.post("/step")(step)
    app.get("/state")(state)
    app.post("/fork")(fork)
    app.delete("/session")(delete)
    app.delete("/sessions/{session}")(delete_named)
    app.get("/sessions")(sessions)
    app.get("/info")(info)
    app.get("/health")(health)


def _ws_call(service: EnvService, sid: str, scope: int | None, kind: Any, data: Any) -> Any:
    """One WebSocket message's call (run in a worker thread: env work never stalls the event loop)."""
    if kind == "reset":
        return service.reset(sid, data, scope)
    if kind == "step":
        return service.step(sid, data, scope)
    if kind == "state":
        return service.state(sid, scope)
    if kind == "fork":
        if isinstance(data, dict) and isinstance(data.get("session_id"), str):
            check_session_id(data["session_id"], "'session_id'")
        return service.fork(sid, data, scope)
    if kind == "info":
        return service.info
    if kind == "close":
        return service.delete(sid, scope)
    raise APIError(
        f"unknown message type {kind!r}: use reset, step, state, fork, info or close", code="invalid_request"
    )


async def _ws_reply(service: EnvService, sid: str, scope: int | None, frame: Any) -> dict[str, Any]:
    """The reply to one received frame: a result, or an error frame (the connection stays open)."""
    from starlette.concurrency import run_in_threadpool

    try:
        if frame.get("text") is None:
            raise APIError("send text frames of JSON; binary frames are not read", code="invalid_request")
        message = _loads(frame["text"])
        if not isinstance(message, dict):
            raise APIError("a message must be {'type': ..., 'data': {...}}", code="invalid_request")
        data = await run_in_threadpool(_ws_call, service, sid, scope, message.get("type"), message.get("data"))
        return {"type": "result", "data": data}
    except APIError as e:
        return {"type": "error", "status": e.status, "data": e.body()}
    except Exception as e:  # a server fault: reported, and the connection kept
        body = error_body(f"{type(e).__name__}: {e}"[:300], type="server_error", code="internal_error")
        return {"type": "error", "status": 500, "data": body}


def _add_websocket(app: Any, service: EnvService, fastapi: Any, expected: list[bytes]) -> None:
    async def ws(websocket: fastapi.WebSocket) -> None:
        index = _key_index(websocket.headers.get("authorization", ""), expected) if expected else None
        if expected and index is None:
            await websocket.close(code=1008, reason="missing or wrong API key")
            return
        scope = index if len(expected) > 1 else None
        try:
            sid = _session(
                websocket.headers.get(SESSION_HEADER) or websocket.query_params.get("session"), SESSION_HEADER
            )
        except APIError as e:
            await websocket.close(code=1008, reason=e.message[:120])
            return
        await websocket.accept()
        while True:
            frame = await websocket.receive()
            if frame["type"] == "websocket.disconnect":
                return
            reply = await _ws_reply(service, sid, scope, frame)
            try:
                await websocket.send_text(json.dumps(reply))
            except (fastapi.WebSocketDisconnect, RuntimeError):
                return  # the client went away meanwhile

    app.websocket("/ws")(ws)
