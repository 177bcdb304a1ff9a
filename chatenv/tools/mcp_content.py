"""What an MCP server returns, read across ``mcp`` versions: fields by either name, tool results as text.

The ``mcp`` package renamed its fields between 1.x (camelCase) and 2.x (snake_case), so its objects are read by
attribute with a fallback (:func:`field`) rather than through one version's classes.

Results become text: text blocks joined by newlines, other blocks as a short bracketed placeholder naming their
kind (``[image: image/png]``), and the structured content as JSON when no text block carries the result.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["field", "result_text"]


def field(obj: object, name: str, legacy: str) -> Any:
    """An attribute by its mcp 2.x name (snake_case), or its mcp 1.x name (camelCase); None if it has neither."""
    return getattr(obj, name, getattr(obj, legacy, None))


def _block_text(block: Any) -> str | None:
    """One content block (any version's class) as text; None for a block that is not text."""
    kind = getattr(block, "type", None)
    if kind == "text":
        return str(block.text)
    if kind == "resource" and isinstance(getattr(block.resource, "text", None), str):
        return str(block.resource.text)
    return None


def _placeholder(block: object) -> str:
    """A short bracketed stand-in for a content block that is not text, e.g. ``[image: image/png]``."""
    kind = str(getattr(block, "type", None) or type(block).__name__)
    inner = getattr(block, "resource", None)
    detail = field(block, "mime_type", "mimeType") or field(inner, "mime_type", "mimeType")
    uri = getattr(block, "uri", None) or getattr(inner, "uri", None)
    shown = ", ".join(str(x) for x in (uri, detail) if x)
    return f"[{kind.replace('_', ' ')}: {shown}]" if shown else f"[{kind.replace('_', ' ')}]"


def result_text(result: object) -> str:
    """A ``CallToolResult`` as text (see the module docstring for the rules)."""
    parts: list[str] = []
    has_text = False
    for block in getattr(result, "content", None) or []:
        text = _block_text(block)
        has_text = has_text or text is not None
        parts.append(_placeholder(block) if text is None else text)
    structured = field(result, "structured_content", "structuredContent")
    if structured is not None and not has_text:
        parts.append(json.dumps(structured, ensure_ascii=False))
    return "\n".join(parts)
