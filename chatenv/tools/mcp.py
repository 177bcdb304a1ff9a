"""Tools from an MCP server: :class:`MCPServer` runs one over stdio and offers its tools as :class:`Tool` objects.

The server is a subprocess; the client session (from the ``mcp`` package, ``pip install "chatenv-gym[mcp]"``)
lives on the tools' background event loop (:mod:`chatenv.tools.loop`), in one long-lived task that enters the
transport and session context managers, initializes, and waits until :meth:`MCPServer.close` cancels it, so the
transport is opened and closed in the same task. Each :class:`Tool` from :meth:`MCPServer.tools` is an ``async``
function that calls the server and returns the result as text; it can be awaited from any event loop.

Example:
    >>> import sys
    >>> with MCPServer(sys.executable, ["tests/mcp_server.py"]) as server:  # doctest: +SKIP
    ...     tools = server.tools()
    ...     server.call("add", {"a": 1, "b": 2})
    '3'

Results become text: text blocks joined by newlines, other blocks as a short bracketed placeholder naming their
kind (``[image: image/png]``), and the structured content as JSON when no text block carries the result. A
result the server marks as an error raises :class:`MCPToolError` with the server's text (an env turns it into a
tool error message); a server that died or was closed raises :class:`MCPServerError` naming its command.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import shlex
import signal
import tempfile
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import IO, Any

from chatenv.errors import ChatEnvError, MissingDependencyError
from chatenv.tools.base import Tool
from chatenv.tools.loop import background_loop, run_coroutine

__all__ = ["MCPServer", "MCPServerError", "MCPToolError", "result_text"]

_EXTRA = 'pip install "chatenv-gym[mcp]"'
_CONNECTION_CLOSED = -32000  # the MCP client's JSON-RPC error code for a closed connection
_CLOSE_TIMEOUT = 10.0  # the mcp transport waits up to ~6 s for a stubborn server before it gives up
_STDERR_TAIL = 1500


class MCPToolError(ChatEnvError, RuntimeError):
    """An MCP tool call failed on the server (a result marked ``isError``, or an error response).

    The message is the server's error text, ready to show to the model.
    """


class MCPServerError(ChatEnvError, RuntimeError):
    """The MCP server cannot be used: it did not start, it died, or it was closed."""


def _require_mcp() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(f"MCP tools need the mcp package: {_EXTRA}") from e


def _field(obj: Any, name: str, legacy: str) -> Any:
    """An attribute by its mcp 2.x name (snake_case), or its mcp 1.x name (camelCase)."""
    return getattr(obj, name, getattr(obj, legacy, None))


def _block_text(block: Any) -> str | None:
    """One content block as text; None for a block that is not text (a placeholder stands in for it)."""
    kind = getattr(block, "type", None)
    if kind == "text":
        return str(block.text)
    if kind == "resource" and isinstance(getattr(block.resource, "text", None), str):
        return str(block.resource.text)
    return None


def _placeholder(block: Any) -> str:
    """A short bracketed stand-in for a content block that is not text, e.g. ``[image: image/png]``."""
    kind = str(getattr(block, "type", None) or type(block).__name__)
    inner = getattr(block, "resource", None)
    detail = _field(block, "mime_type", "mimeType") or _field(inner, "mime_type", "mimeType")
    uri = getattr(block, "uri", None) or getattr(inner, "uri", None)
    shown = ", ".join(str(x) for x in (uri, detail) if x)
    return f"[{kind.replace('_', ' ')}: {shown}]" if shown else f"[{kind.replace('_', ' ')}]"


def result_text(result: Any) -> str:
    """A ``CallToolResult`` as text (see the module docstring for the rules)."""
    parts: list[str] = []
    has_text = False
    for block in getattr(result, "content", None) or []:
        text = _block_text(block)
        has_text = has_text or text is not None
        parts.append(_placeholder(block) if text is None else text)
    structured = _field(result, "structured_content", "structuredContent")
    if structured is not None and not has_text:
        parts.append(json.dumps(structured, ensure_ascii=False))
    return "\n".join(parts)


def _same_file(pid: int, stat: os.stat_result) -> bool:
    """Whether process ``pid`` leads its own session and writes its stderr to the file of ``stat`` (Linux)."""
    try:
        fd2 = os.stat(f"/proc/{pid}/fd/2")
        return (fd2.st_dev, fd2.st_ino) == (stat.st_dev, stat.st_ino) and os.getsid(pid) == pid
    except OSError:
        return False


def _find_pid(errlog: IO[str]) -> int | None:
    """The server's pid: the session leader whose stderr is ``errlog`` (read from /proc; None elsewhere)."""
    try:
        stat = os.fstat(errlog.fileno())
        entries = os.listdir("/proc")
    except (OSError, ValueError):
        return None
    me = str(os.getpid())
    for entry in entries:
        if entry.isdigit() and entry != me and _same_file(int(entry), stat):
            return int(entry)
    return None


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the calling code runs on ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class _Connection:
    """The session's state, kept apart from :class:`MCPServer` so its finalizer can close it.

    Attributes:
        label: The server's command line, for messages.
        session: The ``ClientSession`` while connected, else None.
        pid: The server's process id once known (Linux), else None.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.loop = background_loop()
        self.errlog: IO[str] = tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace")
        self.session: Any = None
        self.pid: int | None = None
        self.runner: concurrent.futures.Future[None] | None = None
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.scope: Any = None
        self.stopping = False
        self.closed = False
        self.lock = threading.Lock()

    async def serve(self, params: Any, startup_timeout: float) -> None:
        """Connect, initialize, mark ready, and hold the session until :meth:`stop` cancels it (on the loop)."""
        import anyio
        from mcp import ClientSession
        from mcp.client.stdio import stdio_client

        if self.stopping:
            return
        with anyio.CancelScope(deadline=anyio.current_time() + startup_timeout) as scope:
            self.scope = scope
            async with stdio_client(params, errlog=self.errlog) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    scope.deadline = math.inf
                    self.session = session
                    self.ready.set_result(None)
                    try:
                        await anyio.sleep_forever()
                    finally:
                        self.session = None
        if scope.cancelled_caught and not self.ready.done() and not self.stopping:
            raise TimeoutError(f"it did not start within {startup_timeout} s")

    async def run(self, params: Any, startup_timeout: float) -> None:
        """:meth:`serve`, passing a failure before the session is ready on to the thread waiting for it."""
        try:
            await self.serve(params, startup_timeout)
        except BaseException as e:
            if not self.ready.done():
                self.ready.set_exception(e)
            raise
        finally:
            if not self.ready.done():
                self.ready.set_exception(MCPServerError(f"MCP server `{self.label}` was closed while starting"))

    def stop(self) -> None:
        """Cancel the session task (called on the loop)."""
        self.stopping = True
        if self.scope is not None:
            self.scope.cancel()

    def stderr_tail(self) -> str:
        """The last lines the server wrote to stderr (at most ~1,500 characters)."""
        try:
            size = os.fstat(self.errlog.fileno()).st_size
            raw = os.pread(self.errlog.fileno(), _STDERR_TAIL, max(0, size - _STDERR_TAIL))
        except (OSError, ValueError):
            return ""
        lines = [line.rstrip() for line in raw.decode("utf-8", "replace").splitlines()]
        return "\n".join(line for line in lines if line.strip())

    def alive(self) -> bool | None:
        """Whether the server process still runs (None if its pid is unknown)."""
        if self.pid is None:
            return None
        try:
            return _same_file(self.pid, os.fstat(self.errlog.fileno()))
        except (OSError, ValueError):
            return False

    def gone(self) -> MCPServerError:
        """The error for a server that cannot be reached (closed, or its process died)."""
        if self.closed or self.stopping:
            return MCPServerError(f"MCP server `{self.label}` is closed")
        state = "its process has exited" if self.alive() is False else "the connection closed"
        tail = self.stderr_tail()
        return MCPServerError(
            f"MCP server `{self.label}` is not running ({state})"
            + (f"; the end of its stderr:\n{tail}" if tail else "")
        )

    def shutdown(self) -> None:
        """End the session and make sure the process is gone; safe to call more than once, from any thread."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        if _on_loop(self.loop):  # e.g. garbage collection on the loop's thread: it must not wait on itself
            self.loop.call_soon(self.stop)
            self.errlog.close()
            return
        try:
            self.wait_stopped()
        finally:
            self.kill()
            self.errlog.close()

    def wait_stopped(self) -> None:
        """Cancel the session task and wait (bounded) for the transport to stop the server."""
        runner = self.runner
        if runner is None or runner.done():
            return
        try:
            self.loop.call_soon_threadsafe(self.stop)
            runner.result(_CLOSE_TIMEOUT)
        except concurrent.futures.TimeoutError:
            runner.cancel()
        except Exception:  # a session that failed may still leave a process: kill() checks
            pass

    def kill(self) -> None:
        """Kill the server's process group if the transport's own shutdown could not end it."""
        if self.pid is not None and self.alive():
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                pass


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
            command=self.command, args=list(self.args), env=dict(env) if env else None, cwd=cwd
        )
        self._conn = conn = _Connection(shlex.join([self.command, *self.args]))
        self._finalizer = weakref.finalize(self, conn.shutdown)
        conn.runner = asyncio.run_coroutine_threadsafe(conn.run(params, self.startup_timeout), conn.loop)
        try:
            conn.ready.result(self.startup_timeout + _CLOSE_TIMEOUT)
        except Exception as e:
            error = self._startup_error(e)  # before close(), which drops the captured stderr
            self.close()
            raise error from e
        except BaseException:  # KeyboardInterrupt while waiting: stop the server, then let it through
            self.close()
            raise
        conn.pid = _find_pid(conn.errlog)

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

    def _session(self) -> Any:
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

    async def _list_here(self) -> list[Any]:
        session = self._session()
        try:
            page = await session.list_tools()
            listed = list(page.tools)
            while _field(page, "next_cursor", "nextCursor"):
                from mcp.types import PaginatedRequestParams

                cursor = _field(page, "next_cursor", "nextCursor")
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
        if _field(result, "is_error", "isError"):
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
        if _on_loop(self._conn.loop):
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

    def _make_tool(self, listed: Any) -> Tool:
        name = str(listed.name)
        description = str(getattr(listed, "description", None) or "")
        parameters = _field(listed, "input_schema", "inputSchema") or {"type": "object", "properties": {}}
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
