"""What a sandboxed call returns: :class:`SandboxResult`, :class:`SandboxError`, and reading its memfds."""

from __future__ import annotations

import codecs
import dataclasses
import math
import os
import signal
from typing import TYPE_CHECKING

from chatenv.errors import SandboxError

if TYPE_CHECKING:
    from chatenv.tools.sandbox.procs import Message

__all__ = ["SandboxError", "SandboxResult", "check_number", "read_capped", "why_killed"]


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one call printed and how it ended.

    Attributes:
        stdout: What the code wrote to file descriptor 1, cut to ``max_output_chars`` (then with a marker at the end).
        stderr: The same for file descriptor 2.
        error: The traceback of the exception the code raised (its tail, from the code's frames), or None.
        timed_out: Whether the call ran past its timeout (its processes were then killed).
        killed: Why the code's process was killed or ended early (timeout, CPU limit, crash, ``os._exit``), or None.
        stdout_chars: How many characters the code wrote to stdout in all (more than ``len(stdout)`` when cut).
        stderr_chars: The same for stderr.
        duration_s: Wall-clock seconds of the call.
        worker_pid: The pid (as the trainer sees it) of the process that ran the code: a new one for every call.
        exceeded: The bound the call ran into, if any: ``"timeout"``, ``"memory"`` (the call's processes together
            went over ``memory_mb``, or one allocation did), ``"pids"`` (a process could not be started: the call
            had ``max_processes``), ``"disk"`` (its files filled ``disk_mb``), ``"cpu"`` (CPU time).
        memory_peak_mb: The most memory the call's processes held together (MiB), where a cgroup or the watchdog
            counted it (see :attr:`PythonSandbox.limits`); else None.
        limits: How the sandbox enforces each bound (:attr:`PythonSandbox.limits`).
    """

    stdout: str
    stderr: str
    error: str | None
    timed_out: bool
    killed: str | None
    stdout_chars: int
    stderr_chars: int
    duration_s: float
    worker_pid: int | None
    exceeded: str | None = None
    memory_peak_mb: float | None = None
    limits: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the code ran through without an exception and was not killed."""
        return self.error is None and self.killed is None

    def text(self) -> str:
        """The result as the model sees it: each non-empty part under a ``[stdout]``-style header."""
        named = {"stdout": self.stdout, "stderr": self.stderr, "error": self.error, "killed": self.killed}
        parts = [f"[{name}]\n{value.rstrip()}" for name, value in named.items() if value]
        return "\n".join(parts) if parts else "(no output)"


def read_capped(fd: int, limit: int) -> tuple[str, int]:
    """The first ``limit`` characters of a memfd's UTF-8 text (plus a marker if it has more) and its length."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    head: list[str] = []
    kept = total = offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        offset += len(chunk)
        text = decoder.decode(chunk)
        total += len(text)
        head.append(text[: max(0, limit - kept)])
        kept += len(head[-1])
    rest = decoder.decode(b"", final=True)
    total += len(rest)
    head.append(rest[: max(0, limit - kept)])
    text = "".join(head)
    if total > limit:
        text += f"\n[... {total - limit} more characters cut: output is limited to {limit} characters ...]"
    return text, total


def why_killed(done: Message, reply: Message, timeout: float) -> str | None:
    """Why a call's process ended early, from the helper's report and the code's result; None if it ran through."""
    if "lost" in done:
        return str(done["lost"])
    if done.get("timed_out"):
        return f"timed out after {timeout:g} s; every process the code started was killed"
    if isinstance(why := done.get("why"), str):
        return why
    if isinstance(fatal := reply.get("fatal"), str):
        return fatal
    status = done.get("status")
    if status == 0 and "error" in reply:
        return None
    if isinstance(status, int) and status < 0:
        name = signal.Signals(-status).name
        why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (out of memory, or the code killed it)"}.get(name, "")
        if name == "SIGKILL" and done.get("exceeded") == "memory":
            why = " (out of memory: the call's processes reached memory_mb together)"
        return f"the code's process was killed by {name}{why}"
    return f"the code's process exited with status {status} before the code finished (did it call os._exit or exec?)"


def check_number(name: str, value: object, minimum: float, integer: bool = False) -> None:
    """Raise TypeError unless ``value`` is a finite number (an int with ``integer``).

    ValueError if it is below ``minimum`` (or zero when ``minimum`` is 0).
    """
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise TypeError(f"{name} must be {'an int' if integer else 'a finite number'}, got {value!r}")
    if value < minimum or (value == minimum == 0):
        raise ValueError(f"{name} must be {'> 0' if minimum == 0 else f'>= {minimum}'}, got {value!r}")
