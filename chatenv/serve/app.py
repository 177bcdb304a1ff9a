"""The FastAPI app of the capture endpoint (extra ``serve``: fastapi and uvicorn, imported when an app is built).

Routes:

- ``POST /v1/chat/completions`` (streaming or not) and ``GET /v1/models``, ``GET /v1/models/{model}``;
- ``POST /v1/messages``: Anthropic's Messages API over the same sessions (:mod:`chatenv.serve.anthropic_api`), and
  ``POST /v1/messages/count_tokens``; ``/v1/models`` answers in Anthropic's shape to the ``anthropic`` client (it
  sends ``anthropic-version``);
- ``POST /v1/responses``: OpenAI's Responses API over the same sessions (:mod:`chatenv.serve.responses_api`);
- the same under ``/s/{session}/v1/...``: a base URL that names the session, for agents that cannot set a header;
- ``GET /v1/sessions`` (ids), ``GET /v1/sessions/{id}`` (the trajectory: segments with ids, assistant mask,
  log-probs, turns and messages; ``?format=jsonl`` gives one episode record per segment: the schema of
  :mod:`chatenv.rollout.records`),
  ``POST /v1/sessions/{id}/reward`` (``{"reward": 1.0, "name": "judge"}``; also ``POST /s/{id}/v1/reward``),
  ``DELETE /v1/sessions/{id}``; ``GET /health``.

A request's session is the ``/s/{session}`` path, else the ``X-Session-Id`` header, else the ``user`` field, else a
fresh session; the response's ``X-Session-Id`` header names it. A session id is 1 to 128 letters, digits or ``._:@-``
(anything else is refused with 400 before a session is made); request bodies over 8 MiB get 413. With several API
keys, each key has its own sessions. A request whose client hangs up is cancelled (answered 499 to nobody; nothing
recorded). Errors come as OpenAI error bodies
(``{"error": {"message", "type", "param", "code"}}``) with the matching status: malformed JSON and bad or
unsupported parameters 400, an oversize context 400 ``context_length_exceeded``, an unknown model or session 404.

(No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations, which name classes of the
lazily imported fastapi.)
"""

import asyncio
import contextlib
import datetime
import hmac
import ipaddress
import json
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chatenv.errors import MissingDependencyError
from chatenv.serve.anthropic_api import add_messages_routes
from chatenv.serve.chat_output import ChatStreamWriter, completion_body
from chatenv.serve.errors import APIError, error_body
from chatenv.serve.params import ChatRequest, parse_request
from chatenv.serve.responses_api import add_responses_routes
from chatenv.serve.service import CaptureService, Completion
from chatenv.serve.streaming import LiveCompletion, sse
from chatenv.serve.trajectory import session_records

if TYPE_CHECKING:  # the serve extra is imported when an app is made
    from fastapi import FastAPI

__all__ = [
    "MAX_BODY_BYTES",
    "SESSION_HEADER",
    "SESSION_ID",
    "check_binding",
    "check_session_id",
    "create_app",
    "is_loopback",
    "require_serve_extra",
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


def require_serve_extra() -> Any:
    """Import fastapi (and check uvicorn is there); a missing one raises naming the ``serve`` extra."""
    try:
        import fastapi
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            f"the capture endpoint needs fastapi and uvicorn ({e.name} is missing); install the 'serve' extra: "
            "pip install 'chatenv-gym[serve]'"
        ) from e
    return fastapi


async def _json_body(request: Any) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413, code="request_too_large")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(f"the request body is over {MAX_BODY_BYTES} bytes", status=413, code="request_too_large")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, a number of too many digits, deep nesting
        raise APIError(f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None


def api_keys(api_key: str | Sequence[str] | None) -> list[str]:
    """The endpoint's API keys (none, one, or several with a session scope each), checked.

    Raises:
        ValueError: For a key shorter than 8 characters, a key given twice, or something that is not a str.
    """
    keys = [] if api_key is None else [api_key] if isinstance(api_key, str) else list(api_key)
    if not all(isinstance(k, str) and len(k) >= 8 for k in keys) or len(set(keys)) != len(keys):
        raise ValueError("api_key must be a str of at least 8 characters, or a list of distinct such keys")
    return keys


def create_app(policy: Any, *, api_key: str | Sequence[str] | None = None, **options: Any) -> "FastAPI":
    """The FastAPI app serving ``policy`` (or an existing :class:`CaptureService`).

    Args:
        policy: A generating policy, or a :class:`CaptureService` to serve.
        api_key: When given, every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (what OpenAI
            clients send as their API key); others get 401. With a list of keys, each key has its own sessions:
            another key's sessions are not listed, read, rewarded or deleted (404), nor extended (403).
        **options: :class:`CaptureService` options (``model_name``, ``aliases``, ``max_context``, ``max_batch``).

    Raises:
        MissingDependencyError: Without fastapi or uvicorn (the ``serve`` extra).
    """
    fastapi = require_serve_extra()
    from starlette.exceptions import HTTPException

    service = policy if isinstance(policy, CaptureService) else CaptureService(policy, **options)
    app: FastAPI = fastapi.FastAPI(title="chatenv capture endpoint", docs_url=None, redoc_url=None)
    app.state.service = service

    @app.exception_handler(APIError)
    async def _api_error(request: Any, exc: APIError) -> Any:
        return fastapi.responses.JSONResponse(exc.body(), status_code=exc.status)

    keys = api_keys(api_key)
    if keys:
        expected = [f"Bearer {key}".encode() for key in keys]

        @app.middleware("http")
        async def _authorize(request: Any, call_next: Any) -> Any:
            given = request.headers.get("authorization", "").encode()
            matches = [hmac.compare_digest(given, e) for e in expected]  # each compared, in constant time
            request.state.scope = matches.index(True) if len(keys) > 1 and any(matches) else None
            if request.url.path != "/health" and not any(matches):
                body = error_body(
                    "missing or wrong API key (send Authorization: Bearer <key>)",
                    type="invalid_request_error",
                    code="invalid_api_key",
                )
                return fastapi.responses.JSONResponse(body, status_code=401)
            return await call_next(request)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Any, exc: HTTPException) -> Any:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        body = error_body(str(exc.detail), type=kind, code=str(exc.status_code))
        return fastapi.responses.JSONResponse(body, status_code=exc.status_code)

    complete = _completer(service)
    _add_completion_routes(app, service, fastapi, complete)
    add_messages_routes(app, fastapi, _json_body, complete, service.count_tokens)
    add_responses_routes(app, fastapi, _json_body, complete)
    _add_session_routes(app, service, fastapi)
    return app


def _completer(service: CaptureService) -> Any:
    """What every API dialect's route does once it has parsed its request: find the session, then generate."""

    async def complete(
        request: Any, req: ChatRequest, session: str | None, user_field: str
    ) -> Completion | LiveCompletion | None:
        """The request's session (the ``/s/`` path, the header, else the API's user field) and its completion.

        None when the client hung up before it was done (nothing is recorded then). A streaming request gives a
        :class:`LiveCompletion` once the policy has begun its replies (a refusal, the policy's included, raises
        here, before anything is sent).
        """
        sid = None
        for where, value in (("the /s/ path", session), (SESSION_HEADER, request.headers.get(SESSION_HEADER))):
            if value:
                sid = sid or check_session_id(value, where)
        if sid is None and req.user:
            sid = check_session_id(req.user, user_field)
        scope = _scope(request)
        if req.stream:
            ct = service.chat_tokenizer(req.tools)

            def run(on_delta: Any, ready: Any) -> Any:
                return service.complete(req, sid, scope, on_delta=on_delta, ready=ready)

            return await LiveCompletion.start(ct, run, lambda work: _unless_disconnected(request, work))
        done: Completion | None = await _unless_disconnected(request, service.complete(req, sid, scope))
        return done

    return complete


def _add_completion_routes(app: Any, service: CaptureService, fastapi: Any, complete: Any) -> None:
    responses = fastapi.responses

    async def chat(request: fastapi.Request, session: str | None = None) -> Any:
        req = parse_request(await _json_body(request))
        done = await complete(request, req, session, "'user'")
        if done is None:
            return responses.Response(status_code=499)  # nobody is listening; nothing was recorded
        if isinstance(done, LiveCompletion):
            headers = {SESSION_HEADER: done.session_id}
            events = sse(done, ChatStreamWriter(req))
            return responses.StreamingResponse(events, media_type="text/event-stream", headers=headers)
        headers = {SESSION_HEADER: done.session.id}
        body = completion_body(done.meta, done.chat_tokenizer, done.choices, done.prompt_tokens, req.logprobs)
        return responses.JSONResponse(body, headers=headers)

    def model_card(name: str, anthropic: bool) -> dict[str, Any]:
        if anthropic:  # the anthropic client's shape (it sends anthropic-version with every request)
            created = datetime.datetime.fromtimestamp(service.started, datetime.timezone.utc)
            return {"id": name, "type": "model", "display_name": name, "created_at": created.isoformat()}
        return {"id": name, "object": "model", "created": service.started, "owned_by": "chatenv"}

    async def models(request: fastapi.Request, session: str | None = None) -> Any:
        anthropic = "anthropic-version" in request.headers
        cards = [model_card(n, anthropic) for n in service.model_names]
        if anthropic:
            return {"data": cards, "has_more": False, "first_id": cards[0]["id"], "last_id": cards[-1]["id"]}
        return {"object": "list", "data": cards}

    async def model(request: fastapi.Request, model: str, session: str | None = None) -> Any:
        service.check_model(model)
        return model_card(model, "anthropic-version" in request.headers)

    for prefix in ("", "/s/{session}"):
        app.post(prefix + "/v1/chat/completions")(chat)
        app.get(prefix + "/v1/models")(models)
        app.get(prefix + "/v1/models/{model:path}")(model)

    async def health() -> Any:
        return {"status": "ok", "sessions": len(service.store.ids()), "policy_calls": service.runner.calls}

    app.get("/health")(health)


def _scope(request: Any) -> int | None:
    """Which of several API keys the request came with (None with one key or none)."""
    return getattr(request.state, "scope", None)


async def _unless_disconnected(request: Any, work: Any, poll_s: float = 0.25) -> Any:
    """Await ``work``, cancelling it if the client hangs up first (then None)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=poll_s)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None


def _reward(body: Any) -> tuple[float, str]:
    if not isinstance(body, dict) or set(body) - {"reward", "name"}:
        raise APIError("the body must be {'reward': <number>, 'name': <optional string>}", param="reward")
    reward, name = body.get("reward"), body.get("name", "agent")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise APIError(f"'reward' must be a finite number, got {reward!r}", param="reward")
    if not isinstance(name, str) or not name:
        raise APIError("'name' must be a non-empty string", param="name")
    return float(reward), name


def _add_session_routes(app: Any, service: CaptureService, fastapi: Any) -> None:
    responses = fastapi.responses

    def find(session: str, scope: int | None) -> Any:
        found = service.store.get(session, create=False, scope=scope)
        if found is None:
            if service.store.spilled(session, scope) is not None:
                raise APIError(
                    f"session {session!r} was evicted from memory; it can be read and deleted, not changed",
                    status=409,
                    code="session_evicted",
                    param="session",
                )
            raise APIError(f"no session {session!r}", status=404, code="session_not_found", param="session")
        return found

    def snapshot_of(session: str, scope: int | None) -> dict[str, Any]:
        spilled = service.store.spilled(session, scope)
        return spilled if spilled is not None else find(session, scope).snapshot()

    async def sessions(request: fastapi.Request) -> Any:
        return {"object": "list", "data": service.store.ids(_scope(request))}

    app.get("/v1/sessions")(sessions)

    async def session_data(request: fastapi.Request, session: str, format: str = "json") -> Any:  # noqa: A002
        snapshot = snapshot_of(session, _scope(request))
        if format == "json":
            return responses.JSONResponse(snapshot)
        if format != "jsonl":
            raise APIError(f"format must be 'json' or 'jsonl', got {format!r}", param="format")
        rows = session_records(snapshot, pad_token_id=int(service.policy.pad_token_id))
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        return responses.PlainTextResponse(text, media_type="application/x-ndjson")

    app.get("/v1/sessions/{session}")(session_data)

    async def post_reward(session: str, request: fastapi.Request) -> Any:
        reward, name = _reward(await _json_body(request))
        target = find(session, _scope(request))
        target.add_reward(reward, name)
        return {"id": target.id, "rewards": target.snapshot()["rewards"]}

    app.post("/v1/sessions/{session}/reward")(post_reward)
    app.post("/s/{session}/v1/reward")(post_reward)

    async def delete(request: fastapi.Request, session: str) -> Any:
        if service.store.pop(session, _scope(request)) is None:
            raise APIError(f"no session {session!r}", status=404, code="session_not_found", param="session")
        return {"id": session, "deleted": True}

    app.delete("/v1/sessions/{session}")(delete)
