"""A small stdio MCP server for the MCP tool tests: ``python tests/mcp_server.py``.

Importing this module starts nothing; the server runs only as a script. Works with the ``mcp`` package's
``MCPServer`` (mcp 2.x) and ``FastMCP`` (mcp 1.x).
"""

import asyncio
import os
from typing import Any


def build_server() -> Any:
    """The server with its tools (imports ``mcp`` here, so importing this module needs no extra)."""
    try:
        from mcp.server.mcpserver import MCPServer as Server
        from mcp.server.mcpserver.exceptions import ToolError
    except ImportError:  # mcp 1.x
        from mcp.server.fastmcp import FastMCP as Server
        from mcp.server.fastmcp.exceptions import ToolError
    from mcp.types import CallToolResult, ImageContent, TextContent

    server = Server("chatenv-test", log_level="WARNING")
    count = [0]

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    def fail(message: str) -> str:
        """Always fail, with the given message."""
        raise ToolError(message)

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep for a while, then say so."""
        await asyncio.sleep(seconds)
        return f"slept {seconds}"

    @server.tool()
    def counter() -> int:
        """Count the calls of this tool in this server process."""
        count[0] += 1
        return count[0]

    @server.tool()
    def pid() -> int:
        """The server's process id."""
        return os.getpid()

    @server.tool()
    def mixed() -> CallToolResult:
        """Return a text block, an image block and structured content."""
        return CallToolResult(
            content=[
                TextContent(type="text", text="a picture:"),
                ImageContent(type="image", data="iVBORw0KGgo=", mimeType="image/png"),
            ],
            structuredContent={"width": 1, "height": 1},
        )

    @server.tool()
    def structured() -> CallToolResult:
        """Return structured content only."""
        return CallToolResult(content=[], structuredContent={"ok": True, "items": [1, 2]})

    return server


if __name__ == "__main__":
    build_server().run()
