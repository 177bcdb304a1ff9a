"""The token routes of the capture endpoint: vLLM's tokens-in/tokens-out surface over the same sessions.

- ``POST /v1/chat/completions/tokens`` (:data:`DIALECT`): a chat completion whose prompt ids the client gives
  (``tokens``); served by the chat dialect's respond path, ids checked against the session
  (:func:`~chatenv.serve.tokens.prompt.served_prompt`).
- ``POST /inference/v1/generate``: ids in, ids and log-probs out (:func:`~chatenv.serve.tokens.output.generate_body`).
  The chat is read from the ids (:func:`~chatenv.serve.tokens.prompt.chat_of_ids`) and planned like any request,
  so a turn continues the segment whose reply it sends back, and the ids must equal the ids planned.
- ``POST /v1/completions``: prompt ids (or text) in, as vLLM serves them (:mod:`~chatenv.serve.tokens.completions`).
- ``POST /generate``: SGLang's native route, ids in and out, as slime sends it (:mod:`~chatenv.serve.tokens.sglang`).
- ``POST /tokenize``, ``POST /detokenize``: the policy's template and tokenizer, as vLLM serves them.

Each is also served under ``/s/{session}`` (a base URL that names the session); the session is otherwise the
``X-Session-Id`` header (verifiers' train client sends its rollout's id there) or a fresh one.

(No ``from __future__ import annotations`` here: FastAPI reads the handlers' annotations, which name classes of the
lazily imported fastapi.)
"""

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from chatenv.errors import TemplateError
from chatenv.ids import check_vocab
from chatenv.serve import chat
from chatenv.serve.dialect import Dialect
from chatenv.serve.errors import APIError
from chatenv.serve.request import ChatRequest
from chatenv.serve.service import CaptureService
from chatenv.serve.tokens.completions import CompletionsRequest, completions_body, parse_completions
from chatenv.serve.tokens.output import generate_body, tokenize_body
from chatenv.serve.tokens.prompt import MISMATCH, chat_of_ids
from chatenv.serve.tokens.request import (
    GenerateRequest,
    TokenizeRequest,
    parse_chat_tokens,
    parse_detokenize,
    parse_generate,
    parse_tokenize,
)
from chatenv.serve.tokens.sglang import SGLangRequest, parse_sglang, sglang_body
from chatenv.web import SESSION_HEADER, read_json_body

__all__ = ["DIALECT", "add_token_routes"]

#: ``/v1/chat/completions/tokens``: the chat dialect with the prompt's ids given
DIALECT: Dialect = dataclasses.replace(
    chat.DIALECT, name="chat_tokens", paths=("/v1/chat/completions/tokens",), parse=parse_chat_tokens
)


def _check_ids(service: CaptureService, ids: Sequence[int], what: str) -> None:
    try:
        check_vocab(ids, len(service.policy.tokenizer), f"'{what}'", owner="the policy's tokenizer")
    except ValueError as e:
        raise APIError(str(e), param=what) from None


def _chat_request(service: CaptureService, parsed: GenerateRequest, messages: list[dict[str, Any]]) -> ChatRequest:
    model = parsed.model or service.model_name
    return parsed.chat_request(model, messages)


def _check_stops(service: CaptureService, stops: Sequence[int]) -> None:
    ct = service.chat_tokenizer(None)
    ends = {*ct.stop_ids, *ct.end_of_turn_ids}
    extra = [i for i in stops if i not in ends]
    if extra:
        raise APIError(
            f"sampling_params.stop_token_ids may only name the template's end-of-reply ids {sorted(ends)} (a reply "
            f"ends there anyway); got {extra}",
            param="sampling_params.stop_token_ids",
            code="unsupported_parameter",
        )


def _tokenize(service: CaptureService, req: TokenizeRequest) -> list[int]:
    tokenizer = service.policy.tokenizer
    if req.messages is None:
        assert req.prompt is not None  # the request holds one of them
        return list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    ct = service.chat_tokenizer(req.tools)
    try:
        encoded = ct.encode(req.messages, add_generation_prompt=req.add_generation_prompt, tools=req.tools)
    except (TemplateError, ValueError, TypeError) as e:
        raise APIError(f"the messages cannot be rendered: {e}", param="messages") from None
    ids: list[int] = encoded.ids.tolist()
    return list(tokenizer.build_inputs_with_special_tokens(ids)) if req.add_special_tokens else ids


def _check_model(service: CaptureService, model: str | None) -> None:
    if model is not None:  # vLLM's token routes may leave the model out: the served one
        service.check_model(model)


def _prompt_requests(service: CaptureService, parsed: CompletionsRequest | SGLangRequest) -> list[ChatRequest]:
    """Each prompt's request, its chat read from its ids (text is tokenized first, as vLLM does)."""
    ct = service.chat_tokenizer(None)
    param = "prompt" if isinstance(parsed, CompletionsRequest) else "input_ids"
    served = []
    for prompt in parsed.prompts:
        ids = service.policy.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        _check_ids(service, ids, param)
        served.append(parsed.for_prompt(chat_of_ids(ct, ids, param), ids))
    return served


async def _served(complete: Any, request: Any, reqs: list[ChatRequest], session: str | None, param: str) -> Any:
    """Each request's completion in the session, concurrently (None for a client that hung up).

    A prompt that is refused fails the response and cancels the others still being planned or generated (nothing of
    theirs is recorded); one that finished before the refusal stays recorded.
    """
    tasks = [asyncio.ensure_future(complete(request, r, session, "'user'")) for r in reqs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException as e:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if isinstance(e, APIError) and e.code == MISMATCH:  # name the route's own field
            e.param = param
        raise


def add_token_routes(app: Any, service: CaptureService, complete: Any, fastapi: Any, prefixes: Sequence[str]) -> None:
    """Add ``/v1/completions``, ``/inference/v1/generate``, ``/generate``, ``/tokenize``, ``/detokenize`` to ``app``.

    Args:
        app: The FastAPI app.
        service: What it serves.
        complete: The app's completer (finds the session, then :meth:`CaptureService.complete`).
        fastapi: The fastapi module.
        prefixes: The path prefixes each route is served under.
    """
    responses = fastapi.responses

    def reply(body: Any, done: list[Any]) -> Any:
        if any(d is None for d in done):
            return responses.Response(status_code=499)  # nobody is listening; nothing was recorded
        return responses.JSONResponse(body(), headers={SESSION_HEADER: done[0].session.id})

    async def generate(request: fastapi.Request, session: str | None = None) -> Any:
        parsed = parse_generate(await read_json_body(request))
        _check_model(service, parsed.model)
        _check_ids(service, parsed.token_ids, "token_ids")
        _check_stops(service, parsed.stop_token_ids)
        messages = await asyncio.to_thread(chat_of_ids, service.chat_tokenizer(None), parsed.token_ids)
        done = await _served(complete, request, [_chat_request(service, parsed, messages)], session, "token_ids")
        return reply(lambda: generate_body(parsed, done[0]), done)

    async def completions(request: fastapi.Request, session: str | None = None) -> Any:
        parsed = parse_completions(await read_json_body(request))
        service.check_model(parsed.request.model)
        _check_stops(service, parsed.stop_token_ids)
        served = await asyncio.to_thread(_prompt_requests, service, parsed)
        done = await _served(complete, request, served, session, "prompt")
        return reply(lambda: completions_body(parsed, list(zip(served, done))), done)

    async def sglang(request: fastapi.Request, session: str | None = None) -> Any:
        parsed = parse_sglang(await read_json_body(request), service.model_name)
        _check_stops(service, parsed.stop_token_ids)
        served = await asyncio.to_thread(_prompt_requests, service, parsed)
        done = await _served(complete, request, served, session, "input_ids")
        return reply(lambda: sglang_body(parsed, done), done)

    async def tokenize(request: fastapi.Request, session: str | None = None) -> Any:
        parsed = parse_tokenize(await read_json_body(request))
        _check_model(service, parsed.model)
        ids = await asyncio.to_thread(_tokenize, service, parsed)
        strs = service.policy.tokenizer.convert_ids_to_tokens(ids) if parsed.return_token_strs else None
        limit = service.max_context or int(service.policy.tokenizer.model_max_length)
        return tokenize_body(ids, limit, strs)

    async def detokenize(request: fastapi.Request, session: str | None = None) -> Any:
        model, ids = parse_detokenize(await read_json_body(request))
        _check_model(service, model)
        _check_ids(service, ids, "tokens")
        return {"prompt": service.chat_tokenizer(None).decode(ids)}

    for prefix in prefixes:
        app.post(prefix + "/v1/completions")(completions)
        app.post(prefix + "/inference/v1/generate")(generate)
        app.post(prefix + "/generate")(sglang)
        app.post(prefix + "/tokenize")(tokenize)
        app.post(prefix + "/detokenize")(detokenize)
