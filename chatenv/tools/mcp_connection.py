"""The live side of an MCP server: its client session on the background loop, its process, its stderr.

:class:`Connection` holds what :class:`~chatenv.tools.mcp.MCPServer` needs to reach and stop the server, apart
from the server object so that the object's finalizer can close it. The session lives in one long-lived task on
the tools' background event loop (:mod:`chatenv.tools.loop`) that enters the transport and session context
managers, initializes, and waits until :meth:`Connection.stop` cancels it, so the transport is opened and closed
in the same task. The server's process is found through ``/proc`` (Linux) by its stderr file, so that it can be
killed if the transport's own shutdown does not end it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import signal
import tempfile
import threading
from typing import TYPE_CHECKING, TextIO, cast

from chatenv.errors import MCPServerError
from chatenv.tools.loop import background_loop

if TYPE_CHECKING:
    import anyio
    from mcp import ClientSession, StdioServerParameters

__all__ = ["CLOSE_TIMEOUT", "Connection", "find_pid", "on_loop"]

CLOSE_TIMEOUT = 10.0  # the mcp transport waits up to ~6 s for a stubborn server before it gives up
_STDERR_TAIL = 1500


def _same_file(pid: int, stat: os.stat_result) -> bool:
    """Whether process ``pid`` leads its own session and writes its stderr to the file of ``stat`` (Linux)."""
    try:
        fd2 = os.stat(f"/proc/{pid}/fd/2")
        return (fd2.st_dev, fd2.st_ino) == (stat.st_dev, stat.st_ino) and os.getsid(pid) == pid
    except OSError:
        return False


def find_pid(errlog: TextIO) -> int | None:
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


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the calling code runs on ``loop``."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class Connection:
    """The session's state, kept apart from :class:`~chatenv.tools.mcp.MCPServer` so its finalizer can close it.

    Attributes:
        label: The server's command line, for messages.
        session: The ``ClientSession`` while connected, else None.
        pid: The server's process id once known (Linux), else None.
    """

    def __init__(self, label: str) -> None:
        self.label = label
        self.loop = background_loop()
        # a text file opened "w+" is a TextIOWrapper; typeshed only says IO[str]
        self.errlog = cast(TextIO, tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace"))
        self.session: ClientSession | None = None
        self.pid: int | None = None
        self.runner: concurrent.futures.Future[None] | None = None
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.scope: anyio.CancelScope | None = None
        self.stopping = False
        self.closed = False
        self.lock = threading.Lock()

    async def serve(self, params: StdioServerParameters, startup_timeout: float) -> None:
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

    async def run(self, params: StdioServerParameters, startup_timeout: float) -> None:
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
        if on_loop(self.loop):  # e.g. garbage collection on the loop's thread: it must not wait on itself
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
            runner.result(CLOSE_TIMEOUT)
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
