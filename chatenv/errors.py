"""Exception hierarchy for chatenv's domain failures.

Bad arguments raise the built-in exceptions (``ValueError``, ``TypeError``, ``KeyError``) with the value
that was wrong; the classes below name failures that belong to chatenv itself. Each subclasses the built-in
exception a caller would naturally catch, so ``except ValueError`` keeps working.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ChatEnvError",
    "MCPServerError",
    "MCPToolError",
    "MissingDependencyError",
    "SandboxError",
    "StepTimeout",
    "VectorEnvDied",
    "ModelNotAvailableError",
    "TemplateError",
    "TemplateNotPrefixStable",
    "TemplateParseError",
    "ToolCallError",
]


class ChatEnvError(Exception):
    """Base class of every error raised by chatenv on purpose."""


class TemplateError(ChatEnvError, ValueError):
    """A chat template cannot do what was asked (unknown, missing markers, inconsistent rendering)."""


class TemplateNotPrefixStable(TemplateError):
    """Rendering more messages changes the text (or tokens) of messages rendered before.

    Token-in/token-out stepping appends only the new messages' tokens to what the model already saw; a
    template that rewrites earlier turns (for example one that strips past reasoning) breaks that.
    """


class TemplateParseError(ChatEnvError, ValueError):
    """Text could not be parsed back into messages with the given template."""


class MissingDependencyError(ChatEnvError, ImportError):
    """An optional dependency is not installed; the message names the extra that provides it."""


class ModelNotAvailableError(ChatEnvError, FileNotFoundError):
    """A model could not be found locally (nothing is ever downloaded at run time)."""


class StepTimeout(ChatEnvError, TimeoutError):
    """An env step (usually its reward) did not return within the rollout's ``step_timeout``."""


class VectorEnvDied(ChatEnvError, RuntimeError):
    """A worker process of an asynchronous vector env died mid-rollout."""


class ToolCallError(ChatEnvError, RuntimeError):
    """A tool call failed and the env's failure policy for its kind is ``"raise"`` (the step changed nothing).

    Attributes:
        kind: ``parse``, ``unknown_tool``, ``arguments``, ``raised``, ``timeout`` or ``budget``.
        detail: What went wrong (the text the model would have been shown).
        call_id: The call's id.
        tool: The tool's name (``""`` when the call could not be read).
    """

    def __init__(self, kind: str, detail: str, *, call_id: str = "", tool: str = ""):
        super().__init__(f"tool call {call_id or '?'} failed ({kind}): {detail}")
        self.kind, self.detail, self.call_id, self.tool = kind, detail, call_id, tool


class MCPToolError(ChatEnvError, RuntimeError):
    """An MCP tool call failed on the server (a result marked ``isError``, or an error response).

    The message is the server's error text, ready to show to the model.
    """


class MCPServerError(ChatEnvError, RuntimeError):
    """The MCP server cannot be used: it did not start, it died, or it was closed."""


class SandboxError(ChatEnvError, RuntimeError):
    """The sandbox cannot run code: it is closed, its isolation is unavailable, or a process could not start."""


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


class AgentError(ChatEnvError, RuntimeError):
    """An agent program failed (a command's exit status, or it made no request)."""


class RunDirError(ChatEnvError):
    """The output folder cannot be used as asked (exists, not writable, disk full)."""


class DistributedError(ChatEnvError, RuntimeError):
    """The distributed collector cannot start or go on (actors that do not start, a factory that raises)."""


class InferenceUnavailable(DistributedError):
    """No inference actor can answer a policy request (all of them died)."""
