"""The FastAPI app of the env server (extra ``serve``: fastapi and uvicorn, imported when an app is built).

It speaks OpenEnv's protocol as openenv-core's clients and ``openenv validate`` use it (tested with openenv-core
0.3.0; shapes in :mod:`chatenv.envserver.protocol`), plus sessions:

- ``POST /reset`` ``{"seed": int?, "episode_id": str?, "options": {...}?}`` and ``POST /step`` ``{"action":
  {<the env's action fields>}, "request_id": str?, "timeout_s": null}`` answer ``{"observation": {...}, "reward",
  "done"}`` plus ``terminated``, ``truncated``, ``info`` (reset: reward null, plus ``session_id``); a non-finite
  reward is the string ``"nan"``, ``"inf"`` or ``"-inf"`` (standard JSON; ``float()`` reads it back);
- ``GET /state``: OpenEnv's ``episode_id`` and ``step_count``, plus ``turn``, ``done``, ``token_ids``,
  ``assistant_mask``, ``messages``, ``task_state``;
- ``GET /schema`` (action, observation and state JSON schemas), ``GET /metadata``, ``GET /health``, ``POST /mcp``
  (JSON-RPC: ``tools/list``), ``GET /openapi.json``;
- ``POST /fork`` ``{"session_id": new, "episode": true}``: a new session with a copy of this one's env;
  ``DELETE /session`` (or ``DELETE /sessions/{id}``) closes a session; ``GET /sessions`` lists them; ``GET /info``:
  env id, kwargs, kind, input mode, spaces, tokenizer, template, tools;
- ``WS /ws``: :mod:`chatenv.envserver.websocket` (one env per connection, as OpenEnv's).

An HTTP request's session is the ``X-Session-Id`` header, else the default session (``default``; with several API
keys, ``default@<key index>``: each key has its own). Errors are ``{"detail": ..., "error": {"message", "type",
"param", "code"}}`` (:func:`~chatenv.envserver.wire.http_error_body`): an action of the wrong shape 422
(``invalid_action``; ``detail`` a list as FastAPI writes it), an action the env refuses 400 (``type_error``,
``value_error``), a body that is not JSON 400 (``invalid_json``), one over ``MAX_BODY_BYTES`` 413, a step before reset
or after the episode ended 409 (``env_state``), an unknown session 404, an evicted one 409 (``session_evicted``), a
session running another call 409 (``session_busy``), another API key's session 404 or 403 (the session-scope rule,
see :mod:`chatenv.envserver.sessions`); the env is left unchanged. Env work runs in worker threads.

(No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations.)
"""

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from chatenv.envserver.protocol import OPENENV_API_VERSION, mcp_reply, metadata, schemas
from chatenv.envserver.sessions import EnvService
from chatenv.envserver.websocket import add_websocket
from chatenv.envserver.wire import http_error_body
from chatenv.errors import APIError
from chatenv.web import (
    SESSION_HEADER,
    api_keys,
    check_session_id,
    install_key_check,
    read_json_body,
    require_serve_extra,
    scope_of,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

__all__ = ["DEFAULT_SESSION", "create_env_app", "default_session"]

#: the session of HTTP requests that name none (one per API key when there are several)
DEFAULT_SESSION = "default"


def default_session(scope: int | None) -> str:
    """The default session of an API key's scope: ``default``, or ``default@<key index>`` with several keys."""
    return DEFAULT_SESSION if scope is None else f"{DEFAULT_SESSION}@{scope}"


def create_env_app(service: EnvService, *, api_key: str | Sequence[str] | None = None) -> "FastAPI":
    """The FastAPI app serving ``service``'s sessions (see the module docstring).

    Args:
        service: The sessions and the env they are made of.
        api_key: When given, every route but ``/health`` (and the WebSocket) needs ``Authorization: Bearer <key>``;
            others get 401 (a WebSocket is closed with code 1008). With several keys, each has its own sessions.

    Raises:
        MissingDependencyError: Without fastapi or uvicorn (the ``serve`` extra).
    """
    fastapi = require_serve_extra()
    from starlette.exceptions import HTTPException

    keys = api_keys(api_key)
    app: FastAPI = fastapi.FastAPI(
        title="chatenv env server", version=OPENENV_API_VERSION, docs_url=None, redoc_url=None
    )
    app.state.service = service
    responses = fastapi.responses

    def refuse(request: Any, exc: APIError) -> Any:
        return responses.JSONResponse(http_error_body(exc), status_code=exc.status)

    @app.exception_handler(APIError)
    async def _api_error(request: Any, exc: APIError) -> Any:
        return refuse(request, exc)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Any, exc: HTTPException) -> Any:
        return refuse(request, APIError(str(exc.detail), status=exc.status_code, code=str(exc.status_code)))

    install_key_check(app, keys, refuse)
    _add_routes(app, service, fastapi)
    add_websocket(app, service, fastapi, keys)
    return app


def _step_action(body: Any) -> Any:
    """The action object of a ``POST /step`` body (OpenEnv's ``{"action": {...}}``)."""
    if not isinstance(body, Mapping) or "action" not in body:
        raise APIError("the body must be {'action': {<the env's action fields>}} (see GET /schema)", status=422,
                       code="invalid_action", param="action")  # fmt: skip
    unknown = sorted(str(k) for k in body if k not in ("action", "request_id", "timeout_s"))
    if unknown:
        raise APIError(f"unknown step field(s) {unknown}: a step takes 'action' (and 'request_id')", status=422,
                       code="invalid_action", param=unknown[0])  # fmt: skip
    if body.get("timeout_s") is not None:
        raise APIError("'timeout_s' is not supported: steps run to completion; send null or leave it out",
                       status=422, code="invalid_action", param="timeout_s")  # fmt: skip
    return body["action"]


def _add_routes(app: Any, service: EnvService, fastapi: Any) -> None:
    from starlette.concurrency import run_in_threadpool

    responses = fastapi.responses

    def sid_of(request: Any) -> str:
        given = request.headers.get(SESSION_HEADER)
        return check_session_id(given, SESSION_HEADER) if given else default_session(scope_of(request))

    async def reset(request: fastapi.Request) -> Any:
        body, sid = await read_json_body(request, empty=None), sid_of(request)
        result = await run_in_threadpool(service.reset, sid, body, scope_of(request))
        return responses.JSONResponse(result, headers={SESSION_HEADER: sid})

    async def step(request: fastapi.Request) -> Any:
        body, sid = await read_json_body(request, empty=None), sid_of(request)
        result = await run_in_threadpool(service.step, sid, _step_action(body), scope_of(request))
        if isinstance(body, Mapping) and "request_id" in body:
            result["request_id"] = body["request_id"]
        return result

    async def state(request: fastapi.Request) -> Any:
        return await run_in_threadpool(service.state, sid_of(request), scope_of(request))

    async def fork(request: fastapi.Request) -> Any:
        body, sid = await read_json_body(request, empty=None), sid_of(request)
        if isinstance(body, dict) and isinstance(body.get("session_id"), str):
            check_session_id(body["session_id"], "'session_id'")
        return await run_in_threadpool(service.fork, sid, body, scope_of(request))

    async def delete(request: fastapi.Request) -> Any:
        return await run_in_threadpool(service.delete, sid_of(request), scope_of(request))

    async def delete_named(session: str, request: fastapi.Request) -> Any:
        sid = check_session_id(session, "the session path")
        return await run_in_threadpool(service.delete, sid, scope_of(request))

    app.post("/reset")(reset)
    app.post("/step")(step)
    app.get("/state")(state)
    app.post("/fork")(fork)
    app.delete("/session")(delete)
    app.delete("/sessions/{session}")(delete_named)
    _add_info_routes(app, service, fastapi)


def _add_info_routes(app: Any, service: EnvService, fastapi: Any) -> None:
    """The routes that describe the server: sessions, info, and OpenEnv's schema, metadata, health and MCP."""

    async def sessions(request: fastapi.Request) -> Any:
        return {"sessions": service.ids(scope_of(request)), "max_sessions": service.max_sessions}

    async def mcp(request: fastapi.Request) -> Any:
        try:
            body = await read_json_body(request)
        except APIError as e:
            if e.code != "invalid_json":
                raise
            return {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": e.message, "data": None}}
        return mcp_reply(body, service.info)

    app.get("/schema")(lambda: schemas(service.info))
    app.get("/metadata")(lambda: metadata(service.info))
    app.get("/health")(lambda: {"status": "healthy", "sessions": len(service)})
    app.post("/mcp")(mcp)
    app.get("/sessions")(sessions)
    app.get("/info")(lambda: service.info)
