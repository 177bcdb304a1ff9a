"""Prompt ids a client supplies: checked against the session, never trusted blindly.

A token route's request gives its prompt as ids (``tokens`` on ``/v1/chat/completions/tokens``, ``token_ids`` on
``/inference/v1/generate``). The endpoint still plans the request from its messages (for the generate route, the
chat those ids spell, :func:`chat_of_ids`): the session decides where the request goes, a continuation of the
segment its messages extend (the recorded ids, each reply verbatim, then only the new messages' tokens) or a new
segment (a fresh render; also where the client's ids are a fresh render of the messages rather than the recorded
continuation, as from clients that re-render the whole chat each turn: the model is then sampled after the client's
ids, and that is what the new segment records). :func:`served_prompt` then requires the client's ids to equal the
planned ids, token for token; ids that differ are refused with 400 ``prompt_ids_mismatch`` naming the first
differing position, and nothing is generated or recorded. So every recorded segment stays token-exact: its ids
are the ids the model was sampled after, and they are the chat its messages say.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chatenv.errors import TemplateParseError
from chatenv.serve.errors import APIError
from chatenv.serve.request import ChatRequest
from chatenv.tokenization import ChatTokenizer

__all__ = ["MISMATCH", "chat_of_ids", "first_difference", "served_prompt"]

#: the error code of client prompt ids that differ from the session's
MISMATCH = "prompt_ids_mismatch"


def first_difference(given: Sequence[int], planned: Sequence[int]) -> int | None:
    """The first position where two id sequences differ (a length difference counts), or None when equal."""
    for k, (a, b) in enumerate(zip(given, planned)):
        if a != b:
            return k
    return None if len(given) == len(planned) else min(len(given), len(planned))


def _show(ids: Sequence[int], k: int) -> str:
    return str(ids[k]) if k < len(ids) else "nothing (the sequence ends)"


def served_prompt(request: ChatRequest, planned: Sequence[int]) -> None:
    """Check the client's prompt ids (if any) against the ``planned`` ids; keep the served ids when asked for them.

    Raises:
        APIError: 400 ``prompt_ids_mismatch`` naming the first position where the ids differ.
    """
    ids = [int(i) for i in planned]
    given = request.prompt_ids
    if given is not None:
        k = first_difference(given, ids)
        if k is not None:
            raise APIError(
                f"the prompt ids differ from the ids this session holds for these messages at position {k}: given "
                f"{_show(given, k)}, recorded {_show(ids, k)} ({len(given)} ids given, {len(ids)} expected). Send "
                "the ids as returned (prompt_token_ids, then the reply's token_ids) followed by the template's "
                "rendering of the new messages, or send the messages without ids",
                param="tokens",
                code=MISMATCH,
            )
    if request.return_token_ids:
        request.prompt_ids = ids


def chat_of_ids(ct: ChatTokenizer, ids: Sequence[int], param: str = "token_ids") -> list[dict[str, Any]]:
    """The chat that prompt ids spell with the policy's template, up to the open assistant header that ends them.

    ``param``: the request field holding the ids (named in refusals).

    A candidate only: the request is then planned from these messages and :func:`served_prompt` requires the planned
    ids to equal ``ids``, so a misreading (text that spells markup, say) is refused, never recorded.

    Raises:
        APIError: When the template has no parser, the ids are not a chat it writes, or they do not end with its
            generation prompt.
    """
    try:
        messages = ct.template.parse(ct.decode(ids))
    except TemplateParseError as e:
        raise APIError(
            f"the '{param}' ids are not a chat the policy's template writes: {e}", param=param, code=MISMATCH
        ) from None
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant" or last.get("is_complete", True) or last.get("content"):
        raise APIError(
            f"the '{param}' ids must end with the template's generation prompt (an open assistant header, "
            f"{ct.generation_header!r}); continuing a partial assistant message is not supported",
            param=param,
            code=MISMATCH,
        )
    chat = [{k: v for k, v in m.items() if k != "is_complete"} for m in messages[:-1]]
    if not chat:
        raise APIError(f"the '{param}' ids hold no message before the generation prompt", param=param)
    return chat
