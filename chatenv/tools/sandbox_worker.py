"""The worker process of :mod:`chatenv.tools.sandbox`: runs the code its parent sends, one request at a time.

The parent starts this file by path (``python -I sandbox_worker.py CONFIG_JSON``) so that the worker never imports
the ``chatenv`` package (and torch with it). Importing the module does nothing (the sandbox imports it for
:func:`frame` and :func:`kill_tree`, which both sides use); :func:`main` is the entry point.

Protocol: length-prefixed JSON messages (4-byte big-endian length, then UTF-8 JSON) over two pipes whose numbers
are in the configuration (``req_fd`` for requests, ``resp_fd`` for replies), so that code writing to file
descriptors 1 and 2 cannot corrupt it. The worker first sends ``{"ready": pid}`` (or ``{"fatal": message}`` and
exits), then answers each ``{"code", "workdir", "timeout"}`` request with ``{"error", "abnormal"}``: the error's
traceback (None if the code ran through) and why the worker should be replaced (None if it is fine). Stdout and
stderr are the parent's files, truncated before each call; the parent reads them.

Limits (best-effort: they bind this process and what it starts, only as far as the OS enforces them): address
space (``RLIMIT_AS``), CPU seconds per call (``RLIMIT_CPU``, soft limit relative to the CPU time used so far), file
size (``RLIMIT_FSIZE``, with ``SIGXFSZ`` ignored so that writes fail instead of killing), open files
(``RLIMIT_NOFILE``), no core dumps, and an audit hook that refuses sockets when the network is off.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import linecache
import os
import resource
import signal
import struct
import sys
import threading
import time
import traceback

__all__ = ["NETWORK_EVENTS", "SPAWN_EVENTS", "Worker", "descendants", "frame", "kill_tree", "main", "signal_all"]

FILENAME = "<sandbox>"
NETWORK_EVENTS = frozenset(
    {
        "socket.bind",
        "socket.connect",
        "socket.getaddrinfo",
        "socket.gethostbyaddr",
        "socket.gethostbyname",
        "socket.getnameinfo",
        "socket.sendmsg",
        "socket.sendto",
        "socket.sethostname",
    }
)
SPAWN_EVENTS = frozenset(
    {
        "ctypes.dlopen",
        "ctypes.dlsym",
        "os.exec",
        "os.fork",
        "os.forkpty",
        "os.posix_spawn",
        "os.spawn",
        "os.system",
        "subprocess.Popen",
    }
)
_MIB = 1024 * 1024
_PR_SET_CHILD_SUBREAPER = 36


def _vm_size_mb() -> float:
    """This process's address space in MiB (0 where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def descendants(root: int) -> list[int]:
    """Pids of every process below ``root``, from the parent pids in /proc (empty without /proc)."""
    children: dict[int, list[int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


def signal_all(pids: list[int], sig: int) -> None:
    """Send ``sig`` to each pid (a negative pid: a process group), ignoring those that are gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def frame(message: dict) -> bytes:
    """One protocol message: 4-byte big-endian length, then the UTF-8 JSON."""
    data = json.dumps(message).encode()
    return struct.pack("!I", len(data)) + data


def kill_tree(root: int, include_root: bool = True) -> None:
    """Stop ``root``'s descendants (collected from /proc until no new ones appear), then kill them all.

    Args:
        root: The pid at the top; with ``include_root`` it is stopped first and killed with its process group.
        include_root: Whether to kill ``root`` too (the sandbox killing a worker) or only what is below it.
    """
    seen = [root] if include_root else []
    signal_all(seen, signal.SIGSTOP)
    for _ in range(10):
        new = [p for p in descendants(root) if p not in seen]
        if not new:
            break
        signal_all(new, signal.SIGSTOP)
        seen.extend(new)
    signal_all([-root] if include_root else [], signal.SIGKILL)  # the worker's process group
    signal_all(seen, signal.SIGKILL)


def _set_limit(which: int, value: int) -> None:
    """Set a fixed (soft = hard) limit, never above the hard limit this process already has."""
    hard = resource.getrlimit(which)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))


def _cap_tail(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return (
        f"[... {len(text) - limit} characters cut; tracebacks are limited to {limit} characters ...]\n" + text[-limit:]
    )


class Worker:
    """The worker's state: configuration, saved process state to restore after each call, and the protocol.

    Args:
        config: The parent's configuration (see :func:`main`).
    """

    def __init__(self, config: dict) -> None:
        self.config = config
        self.req_fd = config["req_fd"]
        self.resp_fd = config["resp_fd"]
        self.spawned = False
        self.libc = ctypes.CDLL(None, use_errno=True)
        for fd in (self.req_fd, self.resp_fd):
            os.set_inheritable(fd, False)
        self.saved_fds = (os.dup(1), os.dup(2))
        self.saved_env = dict(os.environ)
        self.saved_builtins = dict(builtins.__dict__)
        self.saved_path = list(sys.path)
        self.home = config["home"]
        self.recursion_limit = sys.getrecursionlimit()
        self.streams: list = []

    def audit(self, event: str, args: tuple) -> None:
        """The audit hook: refuse the network (when it is off) and note process starts."""
        if event in NETWORK_EVENTS and not self.config["allow_network"]:
            raise PermissionError(f"network access is disabled in this sandbox ({event} was refused)")
        if event in SPAWN_EVENTS:
            self.spawned = True

    def set_limits(self) -> str | None:
        """Apply the fixed limits; the reason they cannot be met, or None."""
        memory_mb = self.config["memory_mb"]
        used = _vm_size_mb()
        if memory_mb < used + 16:
            return f"memory_mb={memory_mb} is too small: the worker's Python already uses {used:.0f} MiB"
        _set_limit(resource.RLIMIT_CORE, 0)
        _set_limit(resource.RLIMIT_AS, memory_mb * _MIB)
        _set_limit(resource.RLIMIT_FSIZE, self.config["file_mb"] * _MIB)
        _set_limit(resource.RLIMIT_NOFILE, self.config["max_open_files"])
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self.libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of the code's processes come back here
        sys.addaudithook(self.audit)
        return None

    def send(self, message: dict) -> None:
        """Send one message to the parent."""
        data = frame(message)
        while data:
            data = data[os.write(self.resp_fd, data) :]

    def receive(self) -> dict | None:
        """The next request, or None when the parent has closed the pipe."""
        head = self._read(4)
        if head is None:
            return None
        body = self._read(struct.unpack("!I", head)[0])
        return None if body is None else json.loads(body)

    def _read(self, n: int) -> bytes | None:
        parts, left = [], n
        while left:
            chunk = os.read(self.req_fd, min(left, 1 << 20))
            if not chunk:
                return None
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def prepare(self, request: dict) -> None:
        """Reset stdout/stderr to the parent's (emptied) files, enter the workdir and set the CPU and time limits."""
        for fd, saved in zip((1, 2), self.saved_fds):
            os.dup2(saved, fd)
            os.ftruncate(fd, 0)
        self.streams = [
            open(fd, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1) for fd in (1, 2)
        ]
        self.streams.append(open(os.devnull))
        sys.stdout, sys.stderr, sys.stdin = self.streams
        sys.argv = [FILENAME]
        sys.path[:] = [request["workdir"], *self.saved_path]
        os.chdir(request["workdir"])
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = int(usage.ru_utime + usage.ru_stime + request["timeout"]) + 2
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu if hard == resource.RLIM_INFINITY else min(cpu, hard), hard))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        signal.signal(signal.SIGALRM, _backstop)
        signal.setitimer(signal.ITIMER_REAL, request["timeout"] + 5)  # only matters if the parent is gone
        self.spawned = False

    def execute(self, code: str) -> tuple[str | None, str | None]:
        """Run ``code`` in a fresh ``__main__`` namespace; its traceback (or None) and the reason to retire."""
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)
        try:
            exec(compile(code, FILENAME, "exec", dont_inherit=True), namespace)
        except SystemExit as e:
            return (None if e.code in (None, 0) else f"SystemExit: {e.code}"), None
        except MemoryError as e:
            namespace.clear()
            return self.format_error(e), "the code ran out of memory"
        except BaseException as e:  # the code's own errors, KeyboardInterrupt included
            return self.format_error(e), None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            namespace.clear()
        return None, None

    def format_error(self, error: BaseException) -> str:
        """The traceback of ``error`` without this worker's frame, its tail capped."""
        try:
            tb = error.__traceback__.tb_next if error.__traceback__ else None
            text = "".join(traceback.format_exception(type(error), error, tb))
        except MemoryError:
            text = f"{type(error).__name__}: (no traceback: out of memory)"
        return _cap_tail(text, self.config["max_output_chars"])

    def flush(self) -> None:
        """Flush Python's and C's stdout/stderr buffers into the parent's files."""
        for stream in (sys.stdout, sys.stderr, *self.streams[:2]):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        self.libc.fflush(None)

    def cleanup(self, workdir: str) -> str | None:
        """Kill what the code started, restore the process state; the reason to retire the worker, or None."""
        reason = None
        if self.spawned:
            kill_tree(os.getpid(), include_root=False)
        if not self._reap(deadline=time.monotonic() + 1.0):
            reason = "processes started by the code did not exit"
        if threading.active_count() > 1:
            reason = "the code left threads running"
        os.chdir(self.home)
        for name, module in list(sys.modules.items()):  # modules imported from this workdir stay with it
            if str(getattr(module, "__file__", None) or "").startswith(workdir + os.sep):
                del sys.modules[name]
        if dict(builtins.__dict__) != self.saved_builtins:
            builtins.__dict__.clear()
            builtins.__dict__.update(self.saved_builtins)
        if dict(os.environ) != self.saved_env:
            os.environ.clear()
            os.environ.update(self.saved_env)
        sys.path[:] = self.saved_path
        sys.setrecursionlimit(self.recursion_limit)
        return reason

    def _reap(self, deadline: float) -> bool:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return True
            if pid == 0:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.002)

    def call(self, request: dict) -> dict:
        """Answer one request."""
        self.prepare(request)
        error, abnormal = self.execute(request["code"])
        self.flush()
        for stream in self.streams:
            try:
                stream.close()
            except OSError:
                pass
        sys.stdout, sys.stderr, sys.stdin = sys.__stdout__, sys.__stderr__, sys.__stdin__
        return {"error": error, "abnormal": self.cleanup(request["workdir"]) or abnormal}


def _backstop(signum: int, frame: object) -> None:
    """Kill this worker's process group: a call ran far past its time and the parent did not stop it."""
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    """Serve requests until the parent closes the pipe.

    Args:
        argv: ``[CONFIG_JSON]`` (default ``sys.argv[1:]``): ``req_fd``, ``resp_fd``, ``home`` (the idle
            working directory), ``memory_mb``, ``file_mb``, ``max_open_files``, ``allow_network``,
            ``max_output_chars`` (also the cap of a traceback).
    """
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    worker = Worker(config)
    sys.argv = [FILENAME]
    os.chdir(worker.home)
    fatal = worker.set_limits()
    if fatal:
        worker.send({"fatal": fatal})
        return
    worker.send({"ready": os.getpid()})
    while True:
        request = worker.receive()
        if request is None:
            return
        try:
            reply = worker.call(request)
        except Exception as e:  # the worker itself failed (e.g. the workdir vanished): report it, then be replaced
            reply = {"error": f"the sandbox could not run the code: {e!r}", "abnormal": "the worker failed"}
        worker.send(reply)


if __name__ == "__main__":
    main()
