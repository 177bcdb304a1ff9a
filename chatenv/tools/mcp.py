"""Tools from an MCP server: :class:`MCPServer` runs one over stdio and offers its tools as :class:`Tool` objects.

The server is a subprocess; the client session (from the ``mcp`` package, ``pip install "chatenv-gym[mcp]"``) lives
on the tools' background event loop (:mod:`chatenv.tools.loop`), in one long-lived task that enters the transport
and session context managers, initializes, and waits until :meth:`MCPServer.close` cancels it, so the transport is
opened and closed in the same task (:mod:`chatenv.tools.mcp_connection`). Each :class:`Tool` from
:meth:`MCPServer.tools` is an ``async`` function that calls the server and returns the result as text; it can be
awaited from any event loop.

Example:
    >>> import sys
    >>> with MCPServer(sys.executable, ["tests/mcp_server.py"]) as server:  # doctest: +SKIP
    ...     tools = server.tools()
    ...     server.call("add", {"a": 1, "b": 2})
    '3'

Results become text (:mod:`chatenv.tools.mcp_content`): text blocks joined by newlines, other blocks as a short
bracketed placeholder naming their kind (``[image: image/png]``), and the structured content as JSON when no text
block carries the result. A result the server marks as an error raises :class:`MCPToolError` with the server's text
(an env turns it into a tool error message); a server that died or was closed raises :class:`MCPServerError` naming
its command.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shlex
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from chatenv.errors import MCPServerError, MCPToolError, MissingDependencyError
from chatenv.tools.base import Tool
from chatenv.tools.loop import run_coroutine
from chatenv.tools.mcp_connection import CLOSE_TIMEOUT, Connection, find_pid, on_loop
from chatenv.tools.mcp_content import field, result_text

if TYPE_CHECKING:
    from mcp import ClientSession
    from mcp.types import Tool as ListedTool

__all__ = ["MCPServer", "MCPServerError", "MCPToolError", "result_text"]

_EXTRA = 'pip install "chatenv-gym[mcp]"'
_CONNECTION_CLOSED = -32000  # the MCP client's JSON-RPC error code for a closed connection


def _require_mcp() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(f"MCP tools need the mcp package: {_EXTRA}") from e


def _unwrap(error: BaseException) -> BaseException:
    """The one error inside (nested) exception groups of one error each, else ``error`` itself."""
    while isinstance(getattr(error, "exceptions", None), tuple) and len(error.exceptions) == 1:  # type: ignore[attr-defined]
        error = error.exceptions[0]  # type: ignore[attr-defined]
    return error


class MCPServer:
    """An MCP server run as a subprocess over stdio, with its tools as :class:`Tool` objects.

    Args:
        command: The executable that starts the server (``"npx"``, ``sys.executable``, ...).
        args: Its arguments.
        env: Extra environment variables for the server, added to the mcp client's safe default environment
            (``PATH``, ``HOME``, ...; the rest of this process's environment is not passed on).
        cwd: The server's working directory (None: this process's).
        startup_timeout: Seconds to start and initialize the server, and to list its tools.
        call_timeout: Seconds a tool call may take (the tools' :attr:`Tool.timeout`, and :meth:`call`'s default;
            None: no limit of its own).
        concurrent: Whether the tools may run at the same time as other concurrent calls of a turn (an MCP session
            answers calls in parallel; whether the server's tools allow it is the server's matter).

    Raises:
        MissingDependencyError: If the ``mcp`` package is not installed.
        MCPServerError: If the server does not start or initialize in time (with the end of its stderr).

    The server runs until :meth:`close` (also on ``with`` exit, garbage collection and interpreter exit); tools
    from :meth:`tools` keep it alive while they exist.
    """

    def __init__(
        self,
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        startup_timeout: float = 30.0,
        call_timeout: float | None = None,
        concurrent: bool = False,
    ) -> None:
        _require_mcp()
        from mcp import StdioServerParameters

        if isinstance(args, str):
            raise TypeError(f"args must be a sequence of strings, not one string: got {args!r}")
        self.command = str(command)
        self.args = tuple(str(a) for a in args)
        self.startup_timeout = float(startup_timeout)
        self.call_timeout = call_timeout
        self.concurrent = concurrent
        self._tools: list[Tool] | None = None
        params = StdioServerParameters(
            command=self.command,
            args=list(self.args),
            env=dict(env) if env else None,
            cwd=os.fspath(cwd) if cwd is not None else None,
        )
        self._conn = conn = Connection(shlex.join([self.command, *self.args]))
        self._finalizer = weakref.finalize(self, conn.shutdown)
        conn.runner = asyncio.run_coroutine_threadsafe(conn.run(params, self.startup_timeout), conn.loop)
        try:
            conn.ready.result(self.startup_timeout + CLOSE_TIMEOUT)
        except Exception as e:
            error = self._startup_error(e)  # before close(), which drops the captured stderr
            self.close()
            raise error from e
        except BaseException:  # KeyboardInterrupt while waiting: stop the server, then let it through
            self.close()
            raise
        conn.pid = find_pid(conn.errlog)

    def _startup_error(self, error: Exception) -> MCPServerError:
        cause = _unwrap(error)
        if isinstance(cause, concurrent.futures.TimeoutError):
            cause = TimeoutError(f"it did not start within {self.startup_timeout} s")
        tail = self._conn.stderr_tail()
        return MCPServerError(
            f"MCP server `{self._conn.label}` failed to start: {str(cause) or type(cause).__name__}"
            + (f"; the end of its stderr:\n{tail}" if tail else "")
        )

    @property
    def label(self) -> str:
        """The server's command line, as shown in messages."""
        return self._conn.label

    @property
    def pid(self) -> int | None:
        """The server's process id (found through /proc on Linux; None where that is not available)."""
        return self._conn.pid

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._conn.closed

    def _check_open(self) -> None:
        if self._conn.closed:
            raise self._conn.gone()

    def _session(self) -> ClientSession:
        session = self._conn.session
        if session is None or self._conn.closed:
            raise self._conn.gone()
        return session

    def _translate(self, error: Exception, name: str) -> Exception:
        """An error from the session as :class:`MCPServerError` (connection gone) or :class:`MCPToolError`."""
        import anyio

        detail = getattr(error, "error", None)
        code = getattr(detail, "code", None)
        if isinstance(error, (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream)):
            return self._conn.gone()
        if code == _CONNECTION_CLOSED or self._conn.alive() is False:
            return self._conn.gone()
        if detail is not None:
            return MCPToolError(f"{name}: {getattr(detail, 'message', None) or error}")
        return error

    async def _list_here(self) -> list[ListedTool]:
        session = self._session()
        try:
            page = await session.list_tools()
            listed = list(page.tools)
            while field(page, "next_cursor", "nextCursor"):
                from mcp.types import PaginatedRequestParams

                cursor = field(page, "next_cursor", "nextCursor")
                page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor))
                listed.extend(page.tools)
        except Exception as e:
            raise self._translate(e, "tools/list") from e
        return listed

    async def _call_here(self, name: str, arguments: Mapping[str, Any]) -> str:
        session = self._session()
        try:
            result = await session.call_tool(name, dict(arguments))
        except Exception as e:
            raise self._translate(e, name) from e
        text = result_text(result)
        if field(result, "is_error", "isError"):
            raise MCPToolError(text or f"the MCP tool {name!r} failed without a message")
        return text

    async def acall(self, name: str, arguments: Mapping[str, Any] | None = None) -> str:
        """Call a tool of the server and return its result as text; awaitable from any event loop.

        Raises:
            MCPToolError: If the tool reports an error (the message is the server's text).
            MCPServerError: If the server is closed or its process died.
        """
        self._check_open()
        coro = self._call_here(name, arguments or {})
        if on_loop(self._conn.loop):
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._conn.loop))

    def call(self, name: str, arguments: Mapping[str, Any] | None = None, timeout: float | None = None) -> str:
        """Call a tool of the server from sync code and return its result as text.

        Args:
            name: The tool's name.
            arguments: Its arguments (a JSON object).
            timeout: Seconds to wait (None: :attr:`call_timeout`); the call is cancelled when they run out.

        Raises:
            TimeoutError: If the tool does not answer in time (the session stays usable).
            MCPToolError: If the tool reports an error (the message is the server's text).
            MCPServerError: If the server is closed or its process died.
        """
        self._check_open()
        limit = self.call_timeout if timeout is None else timeout
        try:
            return run_coroutine(self._call_here(name, arguments or {}), limit)
        except TimeoutError as e:
            raise TimeoutError(f"the MCP tool {name!r} of `{self.label}` did not answer within {limit} s") from e

    def tools(self, *, refresh: bool = False) -> list[Tool]:
        """The server's tools, one :class:`Tool` each (listed once; ``refresh=True`` lists them again).

        Each tool's schema is OpenAI-style, with the server's ``inputSchema`` as its parameters; its ``fn`` is an
        ``async`` function that calls the server (see :meth:`acall`).

        Raises:
            MCPServerError: If the server is closed or its process died.
        """
        self._check_open()
        if self._tools is None or refresh:
            listed = run_coroutine(self._list_here(), self.startup_timeout)
            self._tools = [self._make_tool(t) for t in listed]
        return list(self._tools)

    def _make_tool(self, listed: ListedTool) -> Tool:
        name = str(listed.name)
        description = str(getattr(listed, "description", None) or "")
        parameters = field(listed, "input_schema", "inputSchema") or {"type": "object", "properties": {}}
        schema = {
            "type": "function",
            "function": {"name": name, "description": description, "parameters": dict(parameters)},
        }

        async def fn(**arguments: Any) -> str:
            return await self.acall(name, arguments)

        fn.__name__ = fn.__qualname__ = name
        fn.__doc__ = description
        return Tool(
            name,
            schema,
            fn,
            concurrent=self.concurrent,
            timeout=self.call_timeout,
            extra={"mcp_server": self.label},
        )

    def close(self) -> None:
        """End the session and stop the server process (killing it if it does not exit); safe to call twice."""
        self._finalizer()

    def __enter__(self) -> MCPServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pid={self.pid}"
        return f"MCPServer({self.label!r}, {state})"
