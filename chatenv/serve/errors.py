"""OpenAI-style API errors: a status code and the ``{"error": {...}}`` body clients expect (home: chatenv.errors)."""

from __future__ import annotations

from chatenv.errors import APIError, error_body

__all__ = ["APIError", "error_body"]
