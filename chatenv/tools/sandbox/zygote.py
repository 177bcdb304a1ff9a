"""The trainer's side of the sandbox's processes: a zygote, the standby helper it hands over, their messages.

Messages are JSON on ``SOCK_SEQPACKET`` sockets, with descriptors attached (``SCM_RIGHTS``); every read here has a
deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import site
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from chatenv.tools.sandbox.procs import kill_tree
from chatenv.tools.sandbox.results import SandboxError

if TYPE_CHECKING:
    from chatenv.tools.sandbox.procs import Message

__all__ = ["BASE_ENV", "WORKER_SCRIPT", "Helper", "Zygote", "mapped", "receive", "send", "visible_paths"]

WORKER_SCRIPT = Path(__file__).with_name("worker.py")
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/alternatives")

SYSTEM_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "passwd", "group", "hosts")

BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class _ZygoteLost(SandboxError):
    """The zygote closed its socket, sent something unreadable or did not answer in time (the pool handles it)."""


def receive(sock: socket.socket, deadline: float) -> tuple[Message | None, list[int]]:
    """The next message on ``sock`` and the descriptors that came with it; ``(None, [])`` if ``deadline`` passes.

    Raises:
        _ZygoteLost: If the other side closed the socket or sent something that is not a JSON object.
    """
    if not select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
        return None, []
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 4)
    except OSError as e:
        raise _ZygoteLost(f"the sandbox process is gone ({e})") from None
    if not data:
        raise _ZygoteLost("the sandbox process stopped")
    with contextlib.suppress(ValueError):
        if isinstance(message := json.loads(data), dict):
            return message, fds
    for fd in fds:
        os.close(fd)
    raise _ZygoteLost("the sandbox process sent a malformed message")


def send(sock: socket.socket, message: Message, fds: Sequence[int] = ()) -> None:
    """Send one JSON message with descriptors attached; :class:`_ZygoteLost` if the other side is gone."""
    try:
        socket.send_fds(sock, [json.dumps(message).encode()], list(fds))
    except OSError as e:
        raise _ZygoteLost(f"the sandbox process is gone ({e})") from None


@dataclasses.dataclass(eq=False)
class Helper:
    """A helper the zygote prepared for one call: its pid, a pidfd to kill it by, the socket to talk to it."""

    pid: int
    pidfd: int
    sock: socket.socket

    def close(self) -> None:
        """Close the socket and the pidfd."""
        self.sock.close()
        os.close(self.pidfd)


@dataclasses.dataclass(eq=False)
class Zygote:
    """One zygote process, the parent's end of its socket, the memfd holding its own stderr, its standby helper."""

    proc: subprocess.Popen[bytes]
    sock: socket.socket
    stderr_fd: int
    ready: bool = False
    dead: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def take_helper(self, deadline: float) -> Helper:
        """The standby helper (waiting for the zygote to prepare it); the zygote then prepares the next one.

        Raises:
            _ZygoteLost: If the zygote is gone or too slow.
            SandboxError: If the zygote could not prepare a helper (it stays usable).
        """
        message, fds = receive(self.sock, deadline)
        if message is None:
            raise _ZygoteLost("the sandbox process did not prepare the call in time")
        send(self.sock, {"next": True})
        if "standby" in message and len(fds) == 1:
            pid = int(message["standby"])
            sock = socket.socket(fileno=fds[0])
            try:
                return Helper(pid, os.pidfd_open(pid), sock)
            except OSError as e:  # it died before it could be used
                sock.close()
                raise SandboxError(f"the sandbox's prepared process {pid} is gone ({e})") from None
        for fd in fds:
            os.close(fd)
        raise SandboxError(str(message.get("fatal", f"unexpected message {message!r}")))

    def exit_reason(self) -> str:
        """How the zygote ended (after waiting briefly), for error messages."""
        try:
            code = self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            return "it closed its socket"
        return f"exit status {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"

    def stderr(self, limit: int = 4000) -> str:
        """The start of what the zygote wrote to its stderr (e.g. a traceback at start-up)."""
        with contextlib.suppress(OSError):
            return os.pread(self.stderr_fd, limit, 0).decode(errors="replace").strip()
        return ""

    def kill(self) -> None:
        """Kill the zygote and every process below it, reap it and close its socket (safe to call twice)."""
        with self.lock:
            if not self.dead:
                self.dead = True
                if self.proc.returncode is None:
                    kill_tree(self.proc.pid)
                self.proc.wait()
                self.sock.close()
                os.close(self.stderr_fd)


def mapped(uid: int) -> bool:
    """Whether ``uid`` exists in this process's user namespace (e.g. not in a container that maps only root)."""
    try:
        with open("/proc/self/uid_map") as f:
            ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
    except OSError:
        return False
    return any(inside <= uid < inside + count for inside, _, count in ranges)


def visible_paths(extra: tuple[str, ...] = ()) -> list[str]:
    """The host paths the code sees, read-only, with ``isolation="namespaces"``.

    They are the interpreter with its standard library and site-packages, system programs and libraries, a few
    ``/etc`` files, and ``extra``.
    """
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *site.getsitepackages()}
    system = [*SYSTEM_PATHS, *(f"/etc/{name}" for name in SYSTEM_FILES)]
    return sorted({os.path.abspath(p) for p in (*prefixes, *system, *extra) if os.path.lexists(p)})
