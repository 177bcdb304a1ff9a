"""One episode's use of a sandbox: :class:`PythonSession` and :func:`python_tool`."""

from __future__ import annotations

import dataclasses
import os
import sys
import weakref
from typing import Protocol

from chatenv.tools.base import PerEpisode
from chatenv.tools.sandbox import quota
from chatenv.tools.sandbox.results import SandboxError, SandboxResult, check_number


class SandboxLike(Protocol):
    """What a session uses of :class:`chatenv.tools.sandbox.PythonSandbox` (whose ``session()`` makes sessions)."""

    timeout: float

    def new_workdir(self, prefix: str = ...) -> str: ...  # noqa: D102

    def run(self, code: str, *, workdir: str, timeout: float | None = None) -> SandboxResult: ...  # noqa: D102

    def session(self, timeout: float | None = None) -> PythonSession: ...  # noqa: D102


__all__ = ["PythonSession", "python_tool"]


class PythonSession:
    """One episode's use of a :class:`~chatenv.tools.sandbox.PythonSandbox`: a private folder and the ``python`` tool.

    Files written by one call are there for later calls of the same session; other sessions never see them.
    Variables do not carry over between calls (each runs as a fresh script). ``close()`` removes the directory.

    Args:
        sandbox: The sandbox whose workers run the code.
        timeout: Seconds per call (default: the sandbox's ``timeout``).
    """

    def __init__(self, sandbox: SandboxLike, timeout: float | None = None):
        _check_sandbox(sandbox, "PythonSession")
        if timeout is not None:
            check_number("timeout", timeout, 0)
        self.sandbox = sandbox
        self.timeout = timeout
        self.workdir = sandbox.new_workdir("session-")
        self._cleanup = weakref.finalize(self, quota.remove_tree, self.workdir, ignore_errors=True)

    # a forked episode: the same files, in a folder of its own
    def __deepcopy__(self, memo: dict[int, object]) -> PythonSession:
        if self._cleanup.alive is False:
            raise SandboxError("this Python session is closed")
        copied = PythonSession(self.sandbox, timeout=self.timeout)
        # symlinks stay links: a link the code made to a host file is not followed into the copy; the code's user
        # (nobody under a root trainer) keeps write access
        owner = os.stat(self.workdir).st_uid
        quota.copy_tree(self.workdir, copied.workdir, sys.maxsize, owner if owner != os.geteuid() else None)
        return copied

    def python(self, code: str) -> str:
        """Run a Python script and return what it printed (stdout, stderr and the traceback of an error).

        Each call is a fresh script: variables do not carry over, but files written to the current directory do.
        Print the values you want to see.

        Args:
            code: The Python source code to run.
        """
        if self._cleanup.alive is False:
            raise SandboxError("this Python session is closed")
        result = self.sandbox.run(code, workdir=self.workdir, timeout=self.timeout)
        if result.timed_out:
            limit = self.timeout or self.sandbox.timeout
            partial = dataclasses.replace(result, killed=None)
            printed = f"; what it printed before that:\n{partial.text()}" if partial.stdout or partial.stderr else ""
            raise TimeoutError(f"the code ran longer than {limit:g} s and was stopped{printed}")
        return result.text()

    def close(self) -> None:  # noqa: D102 -- left undocumented on purpose: documented public methods become tools
        self._cleanup()


def _check_sandbox(sandbox: object, who: str) -> None:
    """Refuse anything but a sandbox (what runs code in a folder and makes folders: a PythonSandbox)."""
    if not callable(getattr(sandbox, "run", None)) or not callable(getattr(sandbox, "new_workdir", None)):
        raise TypeError(f"{who} needs a PythonSandbox, got {type(sandbox).__name__}")


def python_tool(sandbox: SandboxLike, timeout: float | None = None) -> PerEpisode:
    """The ``python`` tool as a :class:`~chatenv.tools.base.PerEpisode`: one session per episode, closed at its end.

    Args:
        sandbox: The shared sandbox (its workers serve every episode).
        timeout: Seconds per call (default: the sandbox's ``timeout``).
    """
    _check_sandbox(sandbox, "python_tool")

    def python_session() -> PythonSession:
        return sandbox.session(timeout=timeout)

    return PerEpisode(python_session)
