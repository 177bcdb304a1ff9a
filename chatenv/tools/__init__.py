"""Tools for tool-calling agents: tools from Python functions, per-episode tool objects, MCP servers, a sandbox.

- :mod:`~chatenv.tools.base`: :class:`Tool`, :func:`as_tool` (schema from the signature and docstring),
  :class:`PerEpisode` (tool objects made fresh at each reset).
- :mod:`~chatenv.tools.runner`: :class:`Toolbox` (the tools and the rules: failure policy, budgets, timeouts,
  output cap) and the per-episode :class:`ToolSession` that runs a reply's calls.
- :mod:`~chatenv.tools.sandbox`: a sandboxed Python tool: a kernel-isolated process per call.
- :mod:`~chatenv.tools.mcp`: tools served by an MCP server (the ``mcp`` extra).

How a template writes and reads tool calls lives with the templates (:mod:`chatenv.templates.tool_calls`).
"""

from __future__ import annotations

from chatenv.tools.base import PerEpisode, Tool, as_tool
from chatenv.tools.runner import ERROR_KINDS, Toolbox, ToolResult, ToolSession, ToolStats, ToolTurn

__all__ = [
    "ERROR_KINDS",
    "PerEpisode",
    "Tool",
    "ToolResult",
    "ToolSession",
    "ToolStats",
    "ToolTurn",
    "Toolbox",
    "as_tool",
]
