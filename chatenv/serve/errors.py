"""OpenAI-style API errors: a status code and the ``{"error": {...}}`` body clients expect."""

from __future__ import annotations

from typing import Any

from chatenv.errors import ChatEnvError

__all__ = ["APIError", "error_body"]


class APIError(ChatEnvError):
    """A request the endpoint refuses, with what OpenAI clients read from the error body.

    Args:
        message: What was wrong and how to fix it.
        status: The HTTP status (400 bad request, 404 unknown model or session, ...).
        code: A machine-readable code (``context_length_exceeded``, ``model_not_found``, ``unsupported_parameter``).
        param: The request field at fault, if one is.
        type: The error type (``invalid_request_error`` unless the server itself failed).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        code: str | None = None,
        param: str | None = None,
        type: str = "invalid_request_error",  # noqa: A002  (the name OpenAI's error bodies use)
    ):
        super().__init__(message)
        self.message, self.status, self.code, self.param, self.type = message, status, code, param, type

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return error_body(self.message, type=self.type, code=self.code, param=self.param)


def error_body(message: str, *, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:  # noqa: A002
    """``{"error": {"message", "type", "param", "code"}}`` as OpenAI's API writes it."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
