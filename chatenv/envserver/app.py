"""The FastAPI app of the env server (extra ``serve``: fastapi and uvicorn, imported when an app is built).

Routes (OpenEnv's HTTP env server's, plus sessions):

- ``POST /reset`` ``{"seed": int?, "options": {...}?}`` and ``POST /step`` ``{"action": ...}`` answer
  ``{"observation", "reward", "done", "terminated", "truncated", "info"}`` (reset: reward null, plus
  ``session_id``);
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
"code"}}``: a bad action 400 (``type_error``, ``value_error``), a step before reset or after the episode ended 409
(``env_state``), an unknown session 404, an evicted one 409 (``session_evicted``); the env is left unchanged.

(No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations.)
"""

import hmac
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chatenv.envserver.sessions import EnvService
from chatenv.errors import APIError, error_body
from chatenv.serve.app import (
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


async def _json_body(request: Any) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413, code="request_too_large")
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_request") from None


def _authorized(given: str, expected: list[bytes]) -> bool:
    matches = [hmac.compare_digest(given.encode(), e) for e in expected]  # each compared, in constant time
    return any(matches)


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
            if request.url.path != "/health" and not _authorized(request.headers.get("authorization", ""), expected):
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
        result = await run_in_threadpool(service.reset, sid, body)
        return responses.JSONResponse(result, headers={SESSION_HEADER: sid})

    async def step(request: fastapi.Request) -> Any:
        body, sid = await _json_body(request), sid_of(request)
        return await run_in_threadpool(service.step, sid, body)

    async def state(request: fastapi.Request) -> Any:
        return await run_in_threadpool(service.state, sid_of(request))

    async def fork(request: fastapi.Request) -> Any:
        body, sid = await _json_body(request), sid_of(request)
        if isinstance(body, dict) and isinstance(body.get("session_id"), str):
            check_session_id(body["session_id"], "'session_id'")
        return await run_in_threadpool(service.fork, sid, body)

    async def delete(request: fastapi.Request) -> Any:
        return await run_in_threadpool(service.delete, sid_of(request))

    async def delete_named(session: str) -> Any:
        return await run_in_threadpool(service.delete, _session(session, "the session path"))

    async def sessions() -> Any:
        return {"sessions": service.ids(), "max_sessions": service.max_sessions}

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


def _ws_call(service: EnvService, sid: str, kind: Any, data: Any) -> Any:
    """One WebSocket message's call (run on the event loop: no thread hop for the lowest latency)."""
    if kind == "reset":
        return service.reset(sid, data)
    if kind == "step":
        return service.step(sid, data)
    if kind == "state":
        return service.state(sid)
    if kind == "fork":
        if isinstance(data, dict) and isinstance(data.get("session_id"), str):
            check_session_id(data["session_id"], "'session_id'")
        return service.fork(sid, data)
    if kind == "info":
        return service.info
    if kind == "close":
        return service.delete(sid)
    raise APIError(
        f"unknown message type {kind!r}: use reset, step, state, fork, info or close", code="invalid_request"
    )


def _add_websocket(app: Any, service: EnvService, fastapi: Any, expected: list[bytes]) -> None:
    async def ws(websocket: fastapi.WebSocket) -> None:
        if expected and not _authorized(websocket.headers.get("authorization", ""), expected):
            await websocket.close(code=1008, reason="missing or wrong API key")
            return
        try:
            sid = _session(
                websocket.headers.get(SESSION_HEADER) or websocket.query_params.get("session"), SESSION_HEADER
            )
        except APIError as e:
            await websocket.close(code=1008, reason=e.message[:120])
            return
        await websocket.accept()
        try:
            while True:
                raw = await websocket.receive_text()
                try:
                    message = json.loads(raw)
                    if not isinstance(message, dict):
                        raise APIError("a message must be {'type': ..., 'data': {...}}", code="invalid_request")
                    reply = {"type": "result", "data": _ws_call(service, sid, message.get("type"), message.get("data"))}
                except json.JSONDecodeError as e:
                    body = error_body(f"not JSON: {e}", type="invalid_request_error", code="invalid_request")
                    reply = {"type": "error", "status": 400, "data": body}
                except APIError as e:
                    reply = {"type": "error", "status": e.status, "data": e.body()}
                await websocket.send_text(json.dumps(reply))
        except fastapi.WebSocketDisconnect:
            return

    app.websocket("/ws")(ws)
