"""What the endpoint needs of one API dialect: its routes, its request mapping, its reply and error shapes.

Every dialect (Chat Completions in :mod:`chatenv.serve.chat`, Responses in :mod:`chatenv.serve.responses`,
Anthropic Messages in :mod:`chatenv.serve.anthropic`) maps its request onto one
:class:`~chatenv.serve.request.ChatRequest` and is served by the one respond path of :mod:`chatenv.serve.app`: find
the session, complete (:meth:`~chatenv.serve.service.CaptureService.complete`), then write the reply as a JSON body
or as server-sent events, and refusals in the dialect's own error shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chatenv.errors import APIError

if TYPE_CHECKING:
    from chatenv.serve.request import ChatRequest
    from chatenv.serve.service import Completion

__all__ = ["Dialect"]


def _openai_error(error: APIError) -> dict[str, Any]:
    return error.body()


@dataclass(frozen=True)
class Dialect:
    """One API dialect served by the endpoint.

    Attributes:
        name: The dialect's name (``chat``, ``responses``, ``anthropic``).
        paths: Its generating routes (each also served under ``/s/{session}``).
        parse: Checks a request body; returns the dialect's parsed request (refusals raise
            :class:`~chatenv.errors.APIError` naming the field).
        chat: The :class:`~chatenv.serve.request.ChatRequest` of a parsed request.
        body: The JSON reply of a served request: ``body(parsed, completion)``.
        writer: The server-sent-events writer of a streaming request: ``writer(parsed)``.
        user_field: The request field that names a session when neither the path nor the header does (in errors).
        error: The dialect's error body for a refusal.
    """

    name: str
    paths: tuple[str, ...]
    parse: Callable[[Any], Any]
    chat: Callable[[Any], ChatRequest]
    body: Callable[[Any, Completion], dict[str, Any]]
    writer: Callable[[Any], Any]
    user_field: str
    error: Callable[[APIError], dict[str, Any]] = _openai_error
