"""The FastAPI app of the capture endpoint (extra ``serve``: fastapi and uvicorn, imported when an app is built).

Routes:

- one generating route per API dialect (:class:`~chatenv.serve.dialect.Dialect`), all through one respond path:
  ``POST /v1/chat/completions`` (:mod:`chatenv.serve.chat`), ``POST /v1/responses`` (:mod:`chatenv.serve.responses`),
  ``POST /v1/messages`` (:mod:`chatenv.serve.anthropic`), streaming or not, over the same sessions;
- vLLM's token routes (:mod:`chatenv.serve.tokens`): ``POST /v1/chat/completions/tokens``,
  ``/inference/v1/generate``, ``/tokenize``, ``/detokenize``;
- ``POST /v1/messages/count_tokens``; ``GET /v1/models``, ``GET /v1/models/{model}`` (in Anthropic's shape to the
  ``anthropic`` client: it sends ``anthropic-version``);
- the same under ``/s/{session}/v1/...``: a base URL that names the session, for agents that cannot set a header;
- ``GET /v1/sessions`` (ids), ``GET /v1/sessions/{id}`` (the trajectory: segments with ids, assistant mask,
  log-probs, turns and messages; ``?format=jsonl`` gives one episode record per segment: the schema of
  :mod:`chatenv.rollout.records`),
  ``POST /v1/sessions/{id}/reward`` (``{"reward": 1.0, "name": "judge"}``; also ``POST /s/{id}/v1/reward``),
  ``DELETE /v1/sessions/{id}``; ``GET /health``.

A request's session is the ``/s/{session}`` path, else the ``X-Session-Id`` header, else the dialect's user field,
else a fresh session; the response's ``X-Session-Id`` header names it. Session ids, API keys, scopes, binding and body
limits are the rules of :mod:`chatenv.web` (shared with the env server). A request whose client hangs up is cancelled
(answered 499 to nobody; nothing recorded). Errors come in the dialect's shape (OpenAI's ``{"error": {"message",
"type", "param", "code"}}``, Anthropic's ``{"type": "error", "error": {...}}`` on its routes, the 401 of a missing key
included) with the matching status: malformed JSON and bad or unsupported parameters 400, an oversize context 400
``context_length_exceeded``, an unknown model or session 404.

(No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations, which name classes of the
lazily imported fastapi.)
"""

import asyncio
import contextlib
import datetime
import json
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from chatenv.serve import anthropic, chat, responses
from chatenv.serve.dialect import Dialect
from chatenv.serve.errors import APIError
from chatenv.serve.request import ChatRequest
from chatenv.serve.service import CaptureService, Completion
from chatenv.serve.streaming import LiveCompletion, sse
from chatenv.serve.switches import request_tokenizer
from chatenv.serve.tokens import routes as tokens
from chatenv.serve.trajectory import session_records
from chatenv.web import (
    SESSION_HEADER,
    api_keys,
    check_session_id,
    install_key_check,
    read_json_body,
    require_serve_extra,
    scope_of,
)

if TYPE_CHECKING:  # the serve extra is imported when an app is made
    from fastapi import FastAPI

__all__ = ["DIALECTS", "create_app"]

#: the API dialects the endpoint serves, each through the one respond path
DIALECTS: tuple[Dialect, ...] = (chat.DIALECT, responses.DIALECT, anthropic.DIALECT, tokens.DIALECT)
#: the path prefixes of each route: plain, and naming the session
PREFIXES = ("", "/s/{session}")


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
        return fastapi.responses.JSONResponse(_dialect_of(request).error(exc), status_code=exc.status)

    def refuse(request: Any, error: APIError) -> Any:
        return fastapi.responses.JSONResponse(_dialect_of(request).error(error), status_code=error.status)

    install_key_check(app, api_keys(api_key), refuse)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Any, exc: HTTPException) -> Any:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(str(exc.detail), status=exc.status_code, code=str(exc.status_code), type=kind)
        return fastapi.responses.JSONResponse(_dialect_of(request).error(error), status_code=exc.status_code)

    complete = _completer(service)
    for dialect in DIALECTS:
        route = _respond(dialect, complete, fastapi)
        for prefix in PREFIXES:
            for path in dialect.paths:
                app.post(prefix + path)(route)
    _add_model_routes(app, service, fastapi)
    tokens.add_token_routes(app, service, complete, fastapi, PREFIXES)
    _add_session_routes(app, service, fastapi)
    return app


def _dialect_of(request: Any) -> Dialect:
    """The dialect whose routes a request's path is under (Chat Completions' for every other route)."""
    path = request.url.path
    for dialect in DIALECTS:
        if any(path.endswith(p) or path.endswith(p + "/count_tokens") for p in dialect.paths):
            return dialect
    return DIALECTS[0]


def _session_of(request: Any, path_session: str | None, req: ChatRequest, user_field: str) -> str | None:
    """A request's session id: the ``/s/`` path, else the header, else the dialect's user field (each checked)."""
    sid = None
    for where, value in (("the /s/ path", path_session), (SESSION_HEADER, request.headers.get(SESSION_HEADER))):
        if value:
            sid = sid or check_session_id(value, where)
    if sid is None and req.user:
        sid = check_session_id(req.user, user_field)
    return sid


def _completer(service: CaptureService) -> Any:
    """What every dialect's route does once it has parsed its request: find the session, then generate."""

    async def complete(
        request: Any, req: ChatRequest, session: str | None, user_field: str
    ) -> Completion | LiveCompletion | None:
        """The request's completion in its session.

        None when the client hung up before it was done (nothing is recorded then). A streaming request gives a
        :class:`LiveCompletion` once the policy has begun its replies (a refusal, the policy's included, raises
        here, before anything is sent).
        """
        sid = _session_of(request, session, req, user_field)
        scope = scope_of(request)
        if req.stream:  # the replies are read with the template the request is served with (its switches set)
            ct = request_tokenizer(service.chat_tokenizer(req.tools), req)

            def run(on_delta: Any, ready: Any) -> Any:
                return service.complete(req, sid, scope, on_delta=on_delta, ready=ready)

            return await LiveCompletion.start(ct, run, lambda work: _unless_disconnected(request, work))
        done: Completion | None = await _unless_disconnected(request, service.complete(req, sid, scope))
        return done

    return complete


def _respond(dialect: Dialect, complete: Any, fastapi: Any) -> Any:
    """The one respond path of a dialect's route: parse, complete, then a JSON body or server-sent events."""
    responses = fastapi.responses

    async def route(request: fastapi.Request, session: str | None = None) -> Any:
        try:
            parsed = dialect.parse(await read_json_body(request))
            done = await complete(request, dialect.chat(parsed), session, dialect.user_field)
        except APIError as e:
            return responses.JSONResponse(dialect.error(e), status_code=e.status)
        if done is None:
            return responses.Response(status_code=499)  # nobody is listening; nothing was recorded
        if isinstance(done, LiveCompletion):
            events = sse(done, dialect.writer(parsed))
            return responses.StreamingResponse(
                events, media_type="text/event-stream", headers={SESSION_HEADER: done.session_id}
            )
        return responses.JSONResponse(dialect.body(parsed, done), headers={SESSION_HEADER: done.session.id})

    return route


def _add_model_routes(app: Any, service: CaptureService, fastapi: Any) -> None:
    def model_card(name: str, anthropic: bool) -> dict[str, Any]:
        if anthropic:  # the anthropic client's shape (it sends anthropic-version with every request)
            created = datetime.datetime.fromtimestamp(service.started, datetime.timezone.utc)
            return {"id": name, "type": "model", "display_name": name, "created_at": created.isoformat()}
        card = {"id": name, "object": "model", "created": service.started, "owned_by": "chatenv"}
        if service.max_context is not None:  # as vLLM's server says it (clients check prompts against it)
            card["max_model_len"] = int(service.max_context)
        return card

    async def models(request: fastapi.Request, session: str | None = None) -> Any:
        anthropic = "anthropic-version" in request.headers
        cards = [model_card(n, anthropic) for n in service.model_names]
        if anthropic:
            return {"data": cards, "has_more": False, "first_id": cards[0]["id"], "last_id": cards[-1]["id"]}
        return {"object": "list", "data": cards}

    async def model(request: fastapi.Request, model: str, session: str | None = None) -> Any:
        service.check_model(model)
        return model_card(model, "anthropic-version" in request.headers)

    async def count_tokens(request: fastapi.Request, session: str | None = None) -> Any:
        tokens = await service.count_tokens(anthropic.parse_count_request(await read_json_body(request)))
        return {"input_tokens": tokens}

    for prefix in PREFIXES:
        app.get(prefix + "/v1/models")(models)
        app.get(prefix + "/v1/models/{model:path}")(model)
        app.post(prefix + "/v1/messages/count_tokens")(count_tokens)

    async def health() -> Any:
        return {"status": "ok", "sessions": len(service.store.ids()), "policy_calls": service.runner.calls}

    app.get("/health")(health)


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
        return {"object": "list", "data": service.store.ids(scope_of(request))}

    app.get("/v1/sessions")(sessions)

    async def session_data(request: fastapi.Request, session: str, format: str = "json") -> Any:  # noqa: A002
        snapshot = snapshot_of(session, scope_of(request))
        if format == "json":
            return responses.JSONResponse(snapshot)
        if format != "jsonl":
            raise APIError(f"format must be 'json' or 'jsonl', got {format!r}", param="format")
        rows = session_records(snapshot, pad_token_id=int(service.policy.pad_token_id))
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        return responses.PlainTextResponse(text, media_type="application/x-ndjson")

    app.get("/v1/sessions/{session}")(session_data)

    async def post_reward(session: str, request: fastapi.Request) -> Any:
        reward, name = _reward(await read_json_body(request))
        target = find(session, scope_of(request))
        target.add_reward(reward, name)
        return {"id": target.id, "rewards": target.snapshot()["rewards"]}

    app.post("/v1/sessions/{session}/reward")(post_reward)
    app.post("/s/{session}/v1/reward")(post_reward)

    async def delete(request: fastapi.Request, session: str) -> Any:
        if service.store.pop(session, scope_of(request)) is None:
            raise APIError(f"no session {session!r}", status=404, code="session_not_found", param="session")
        return {"id": session, "deleted": True}

    app.delete("/v1/sessions/{session}")(delete)
