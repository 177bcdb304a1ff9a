"""The capture endpoint's state and request flow, independent of the web framework.

:class:`CaptureService` owns the policy runner, the chat tokenizers (the policy's template, and its tool variant
for requests with ``tools``) and the sessions. :meth:`CaptureService.complete` serves one request: plan where its
messages go in the session (TITO continuation or a new segment), check the context, generate, read the replies
and commit them. A request that fails at any point leaves its session as it was.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chatenv.errors import TemplateError
from chatenv.serve.engine import Job, PolicyRunner
from chatenv.serve.errors import APIError
from chatenv.serve.replies import make_choice
from chatenv.serve.request import ChatRequest
from chatenv.serve.sessions import Choice, Plan, Session
from chatenv.serve.store import SessionStore
from chatenv.serve.switches import forced_call, request_tokenizer
from chatenv.serve.tokens.prompt import served_prompt
from chatenv.templates import get_template
from chatenv.tokenization import ChatTokenizer, chat_tokenizer

__all__ = ["CaptureService", "Completion"]


@dataclass
class Completion:
    """A served request: the response's id, time and model, its replies, and where they were recorded."""

    meta: dict[str, Any]
    chat_tokenizer: ChatTokenizer
    choices: list[Choice]
    prompt_tokens: int
    session: Session
    top: list[list[list[tuple[int, float]]] | None] = field(default_factory=list)  # per reply: top log-probs


class CaptureService:
    """A policy served behind chat completions, recording token-exact trajectories per session.

    Args:
        policy: A generating policy (:class:`~chatenv.protocols.ServedPolicy`, e.g. a ``wrappers.policies``
            wrapper; any input mode).
        model_name: The model id clients ask for (default: ``"chatenv-policy"``); ``aliases`` are accepted too.
        aliases: Other model ids to accept.
        max_context: Most tokens of prompt + reply (default: the policy's ``context_length``).
        max_batch: Most rows per policy call.
        batch_wait: Seconds the policy worker waits for more requests to batch with the first one.
        max_request_tokens: Most tokens one request may ask to generate (``n`` x its reply budget); a request over it
            is refused with 400 ``request_too_large`` before it runs, so one client cannot hold the policy for
            minutes (default 32768; None: no limit).
        max_sessions: Most sessions held in memory; the least recently used idle ones past it are written to disk
            (readable, not extended; see :class:`~chatenv.serve.store.SessionStore`).
        max_session_tokens: Most ids one session may hold (every segment, plus the ``n`` replies a request may
            generate); a request past it is refused with 400 ``session_too_large`` before it runs (default 2**20;
            None: no limit).
    """

    def __init__(
        self,
        policy: Any,
        *,
        model_name: str = "chatenv-policy",
        aliases: tuple[str, ...] = (),
        max_context: int | None = None,
        max_batch: int = 32,
        batch_wait: float = 0.02,
        max_request_tokens: int | None = 32768,
        max_sessions: int | None = 4096,
        max_session_tokens: int | None = 1 << 20,
    ):
        for name, value in (("max_request_tokens", max_request_tokens), ("max_session_tokens", max_session_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        self.max_request_tokens = max_request_tokens
        self.max_session_tokens = max_session_tokens
        self.runner = PolicyRunner(policy, max_batch=max_batch, batch_wait=batch_wait)
        self.policy = policy
        self.model_name = model_name
        self.model_names = (model_name, *aliases)
        self.max_context = max_context if max_context is not None else getattr(policy, "context_length", None)
        settings = getattr(policy, "settings", None)
        self.default_max_tokens = int(getattr(settings, "max_new_tokens", 256))
        self.store = SessionStore(max_sessions=max_sessions)
        base = getattr(policy, "chat_tokenizer", None)
        self._base: ChatTokenizer = (
            base if base is not None else chat_tokenizer(policy.tokenizer, getattr(policy, "template", None))
        )
        self._tools: ChatTokenizer | None = None
        self.started = int(time.time())

    # ------------------------------------------------------------------------------------------ checks

    def check_model(self, model: str) -> None:
        """Refuse a model this endpoint does not serve (404 ``model_not_found``)."""
        if model not in self.model_names:
            raise APIError(
                f"the model {model!r} does not exist here; this endpoint serves {list(self.model_names)}",
                status=404,
                code="model_not_found",
                param="model",
            )

    def chat_tokenizer(self, tools: list[Any] | None) -> ChatTokenizer:
        """The policy's chat tokenizer; for requests with tools, its template's tool variant (as envs choose it)."""
        if tools is None or self._base.tool_format is not None:
            return self._base
        if self._tools is None:
            variant = self._base.template.tool_variant
            if variant is None:
                name = self._base.template.name or "<tokenizer template>"
                raise APIError(f"the policy's template {name!r} cannot render tools", param="tools")
            self._tools = chat_tokenizer(self.policy.tokenizer, get_template(variant))
        return self._tools

    def max_new_tokens(self, prompt_tokens: int, asked: int | None) -> int:
        """The reply budget: ``asked``, else the policy's default, within the context (never a silent cut).

        Raises:
            APIError: ``context_length_exceeded`` when the prompt (plus ``asked``) does not fit.
        """
        limit = self.max_context
        if limit is None:
            return asked if asked is not None else self.default_max_tokens
        if prompt_tokens >= limit or (asked is not None and prompt_tokens + asked > limit):
            wanted = f" + {asked} completion tokens" if asked is not None else ""
            raise APIError(
                f"this model's maximum context length is {limit} tokens; the messages take {prompt_tokens} "
                f"tokens{wanted}. Shorten the messages or lower max_tokens",
                param="messages",
                code="context_length_exceeded",
            )
        return asked if asked is not None else min(self.default_max_tokens, limit - prompt_tokens)

    async def count_tokens(self, request: ChatRequest) -> int:
        """Tokens of the request's prompt: its messages rendered (with its tools) up to the reply's header.

        A count of the chat as sent (no session is read or changed); a session continuing a recorded segment keeps
        the segment's own ids, which can differ where the template re-renders earlier turns.

        Raises:
            APIError: For a model not served here, or messages the template cannot render.
        """
        self.check_model(request.model)
        ct = request_tokenizer(self.chat_tokenizer(request.tools), request)
        try:
            encoded = await asyncio.to_thread(
                ct.encode, request.messages, add_generation_prompt=True, tools=request.tools
            )
        except (TemplateError, ValueError, TypeError) as e:
            raise APIError(f"the messages cannot be rendered: {e}", param="messages") from None
        return len(encoded.ids)

    # ------------------------------------------------------------------------------------------ serving

    async def complete(
        self,
        request: ChatRequest,
        session_id: str | None,
        scope: int | None = None,
        *,
        on_delta: Callable[[int, list[int], list[float] | None], None] | None = None,
        ready: asyncio.Future[tuple[str, int]] | None = None,
    ) -> Completion:
        """Serve one request in its session (a fresh anonymous session for ``session_id=None``).

        Args:
            request: The parsed request.
            session_id: Its session, or None.
            scope: The API key it came with, when the endpoint has several (sessions are per key).
            on_delta: Streaming: called from the policy worker with each reply's new tokens as they are generated
                (see :class:`~chatenv.serve.engine.Job`).
            ready: Streaming: set to ``(session id, prompt tokens)`` once the request passed the endpoint's checks,
                before it is generated (the policy may still refuse it on its worker).

        A request cancelled while it waits (its client hung up) never runs; one cancelled while the policy generates
        is not recorded. Either way the session stays as it was.
        """
        self.check_model(request.model)
        if request.logprobs and getattr(self.policy, "log_probs_key", None) is None:
            raise APIError("this policy returns no log-probs", param="logprobs", code="unsupported_parameter")
        ct = request_tokenizer(self.chat_tokenizer(request.tools), request)
        known = self.store.get(session_id, create=False, scope=scope) if session_id is not None else None
        session = known or self.store.get(session_id, scope=scope)
        assert session is not None  # get() creates the session unless told not to
        session.pending += 1
        try:
            return await self._serve(request, ct, session, on_delta, ready)
        except BaseException:
            if session.pending == 1 and session.requests == 0:
                self.store.discard(session)  # a refused first request leaves no session behind
            raise
        finally:
            session.pending -= 1

    async def _serve(
        self, request: ChatRequest, ct: Any, session: Any, on_delta: Any = None, ready: Any = None
    ) -> Completion:
        plan = await self._claim(request, ct, session)
        try:
            served_prompt(request, plan.ids)  # client prompt ids (token routes) must equal the planned ids
            kwargs = {**request.generate_kwargs, "max_new_tokens": plan.budget, **forced_call(ct, request)}
            if request.stop:
                kwargs["stop"] = list(request.stop)
            job = Job(plan.ids, plan.mask, plan.messages, request.n, kwargs, request.seed, on_delta)
            if ready is not None and not ready.done():
                ready.set_result((session.id, len(plan.ids)))
            generated = await self.runner.generate(job)
            prefix = f"call_{uuid.uuid4().hex[:8]}_"
            choices = [
                make_choice(ct, g, request, prefix if len(generated) == 1 else f"{prefix}{k}_")
                for k, g in enumerate(generated)
            ]
        except BaseException:
            session.release(plan)
            raise
        session.commit(plan, choices)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": request.model}
        return Completion(meta, ct, choices, len(plan.ids), session, [g.top for g in generated])

    async def _claim(self, request: ChatRequest, ct: Any, session: Session) -> Plan:
        """Plan the request in its session, check its budgets, and claim its segment (see :meth:`Session.claim`).

        Requests of one session run concurrently: a plan made while another request took its segment is made again
        (then it continues a fork of that segment).
        """
        for _ in range(8):
            try:  # rendering and tokenizing run on a thread: a long chat does not stall the event loop
                plan = await asyncio.to_thread(session.plan, ct, request.messages, request.tools, request.prompt_ids)
            except (TemplateError, ValueError, TypeError) as e:
                raise APIError(f"the messages cannot be rendered: {e}", param="messages") from None
            budget = self.max_new_tokens(len(plan.ids), request.max_tokens)
            if self.max_request_tokens is not None and request.n * budget > self.max_request_tokens:
                raise APIError(
                    f"the request asks for up to {request.n} x {budget} = {request.n * budget} generated tokens, over "
                    f"this endpoint's limit of {self.max_request_tokens} per request; lower n or max_tokens",
                    param="max_tokens",
                    code="request_too_large",
                )
            if session.claim(plan, request.n * budget, self.max_session_tokens):
                plan.budget = budget
                return plan
        raise APIError(  # only under a storm of requests continuing one segment at once
            f"session {session.id!r} is too busy to plan this request; retry it",
            status=409,
            code="session_busy",
            param="session",
        )

    def close(self) -> None:
        """Stop the policy worker."""
        self.runner.close()
