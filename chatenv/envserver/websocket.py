"""The env server's WebSocket, ``WS /ws``: OpenEnv's messages, one env per connection.

A connection that names no session (OpenEnv's clients) gets a session of its own, opened at connect (a full server
sends a ``CAPACITY_REACHED`` error frame and closes) and closed when the connection ends. One that names a session
(the ``X-Session-Id`` header or ``?session=``: :class:`~chatenv.envserver.EnvClient` and its forks) works on that
session, which outlives the connection (closed by ``close``, ``DELETE /session``, or eviction).

Messages are ``{"type": ..., "data": {...}}``:

- ``reset`` (data: ``seed``, ``episode_id``, ``options``) and ``step`` (data: the action object) answer
  ``{"type": "observation", "data": {"observation", "reward", "done", ...}}``;
- ``state`` answers ``{"type": "state", "data": {...}}``; ``mcp`` (data: a JSON-RPC request) ``{"type": "mcp", ...}``;
- ``fork`` and ``info`` (chatenv's) answer ``{"type": "result", "data": {...}}``;
- ``close`` closes the session, answers ``{"type": "result", ...}`` and ends the connection.

A failed call is answered with OpenEnv's error frame (:func:`~chatenv.envserver.wire.error_frame`) and the connection
stays open, as it does for a binary frame or a message that is not JSON. Env work runs in worker threads.

(No ``from __future__ import annotations`` here: FastAPI reads the handler's annotations.)
"""

import json
import uuid
from collections.abc import Sequence
from typing import Any

from chatenv.envserver.protocol import mcp_reply
from chatenv.envserver.sessions import EnvService
from chatenv.envserver.wire import error_frame
from chatenv.errors import APIError
from chatenv.web import SESSION_HEADER, check_session_id, key_scope, loads

__all__ = ["add_websocket"]

#: the answer type of each message type
_ANSWERS = {"reset": "observation", "step": "observation", "state": "state", "mcp": "mcp", "fork": "result",
            "info": "result", "close": "result"}  # fmt: skip


def _call(service: EnvService, sid: str, scope: int | None, kind: Any, data: Any) -> Any:
    """One message's call (run in a worker thread: env work never stalls the event loop)."""
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
    if kind == "mcp":
        return mcp_reply(data, service.info)
    return service.delete(sid, scope)  # close


async def _reply(service: EnvService, sid: str, scope: int | None, frame: Any) -> tuple[dict[str, Any], bool]:
    """The answer to one received frame (a result or an error frame) and whether the connection ends."""
    from starlette.concurrency import run_in_threadpool

    kind: Any = None
    try:
        if frame.get("text") is None:
            raise APIError("send text frames of JSON; binary frames are not read", code="invalid_json")
        message = loads(frame["text"])
        if not isinstance(message, dict):
            raise APIError("a message must be {'type': ..., 'data': {...}}", code="invalid_request")
        kind = message.get("type")
        if kind not in _ANSWERS:
            raise APIError(f"unknown message type {kind!r}: use one of {sorted(_ANSWERS)}", code="unknown_type")
        data = await run_in_threadpool(_call, service, sid, scope, kind, message.get("data"))
        return {"type": _ANSWERS[kind], "data": data}, kind == "close"
    except APIError as e:
        return error_frame(e), kind == "close"
    except Exception as e:  # a server fault: reported, and the connection kept
        error = APIError(f"{type(e).__name__}: {e}"[:300], status=500, code="internal_error", type="server_error")
        return error_frame(error), kind == "close"


def add_websocket(app: Any, service: EnvService, fastapi: Any, keys: Sequence[str]) -> None:
    """Add ``WS /ws`` to ``app`` (see the module docstring); ``keys``: the API keys (none: open)."""
    from starlette.concurrency import run_in_threadpool

    async def ws(websocket: fastapi.WebSocket) -> None:
        allowed, scope = key_scope(websocket.headers.get("authorization", ""), keys)
        if not allowed:
            await websocket.close(code=1008, reason="missing or wrong API key")
            return
        named = websocket.headers.get(SESSION_HEADER) or websocket.query_params.get("session")
        try:
            sid = check_session_id(named, SESSION_HEADER) if named else f"ws-{uuid.uuid4().hex}"
        except APIError as e:
            await websocket.close(code=1008, reason=e.message[:120])
            return
        await websocket.accept()
        own = not named
        try:
            if own:
                try:
                    await run_in_threadpool(service.open, sid, scope)
                except APIError as e:
                    own = False
                    await websocket.send_text(json.dumps(error_frame(e)))
                    await websocket.close()
                    return
            await _serve(websocket, service, sid, scope, fastapi)
        finally:
            if own:
                await run_in_threadpool(service.discard, sid)

    app.websocket("/ws")(ws)


async def _serve(websocket: Any, service: EnvService, sid: str, scope: int | None, fastapi: Any) -> None:
    while True:
        frame = await websocket.receive()
        if frame["type"] == "websocket.disconnect":
            return
        reply, last = await _reply(service, sid, scope, frame)
        try:
            await websocket.send_text(json.dumps(reply))
            if last:
                await websocket.close()
                return
        except (fastapi.WebSocketDisconnect, RuntimeError):
            return  # the client went away meanwhile
