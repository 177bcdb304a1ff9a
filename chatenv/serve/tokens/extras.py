"""The token extras vLLM takes on its chat route: ``return_token_ids``, ``return_tokens_as_token_ids``, and more.

- ``return_token_ids: true``: the response carries ``prompt_token_ids`` (the ids the replies were generated after,
  top level) and each choice's ``token_ids`` (its generated ids, the end-of-turn id included when sampled), as
  vLLM writes them. Non-streaming only (a streaming request asking for them is refused).
- ``return_tokens_as_token_ids: true``: each log-prob entry's ``token`` is ``"token_id:<id>"`` instead of its text.
- ``skip_special_tokens``: accepted either way; a reply's text is its ids decoded with special tokens written
  (never the end-of-turn id, which ends the reply), since a reply must come back to the endpoint as it was returned
  to continue its segment token-exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from chatenv.serve.errors import APIError
from chatenv.serve.request import ChatRequest, flag

if TYPE_CHECKING:
    from chatenv.serve.sessions import Choice

__all__ = ["TOKEN_FIELDS", "token_extras", "token_label", "with_token_ids"]

#: the request fields this module reads (vLLM's names)
TOKEN_FIELDS = frozenset({"return_token_ids", "return_tokens_as_token_ids", "skip_special_tokens"})


def token_extras(body: Mapping[str, Any], request: ChatRequest) -> ChatRequest:
    """``request`` with the token extras of ``body`` set (checked).

    Raises:
        APIError: For a field that is not a bool, or ``return_token_ids`` with ``stream``.
    """
    request.return_token_ids = flag(body, "return_token_ids")
    request.tokens_as_ids = flag(body, "return_tokens_as_token_ids")
    flag(body, "skip_special_tokens")  # either value: see the module's note
    if request.return_token_ids and request.stream:
        raise APIError(
            "'return_token_ids' is served on non-streaming requests only; set stream to false",
            param="return_token_ids",
            code="unsupported_parameter",
        )
    return request


def token_label(token_id: int) -> str:
    """A log-prob entry's token written as its id (vLLM's ``return_tokens_as_token_ids`` form)."""
    return f"token_id:{token_id}"


def with_token_ids(body: dict[str, Any], request: ChatRequest, choices: Sequence[Choice]) -> dict[str, Any]:
    """A completion ``body`` with vLLM's ``prompt_token_ids`` and per-choice ``token_ids`` when the request asked."""
    if request.return_token_ids:
        body["prompt_token_ids"] = list(request.prompt_ids or [])
        for entry, choice in zip(body["choices"], choices):
            entry["token_ids"] = list(choice.ids)
    return body
