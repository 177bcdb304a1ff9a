"""A sandboxed Python tool: model-written code runs in a fresh, kernel-isolated process per call.

:class:`PythonSandbox` keeps ``workers`` warm *zygote* processes (``python -I sandbox_worker.py``, started with an
empty environment; they never import ``chatenv`` or torch, never see code or output). For each call a zygote hands
the request to a helper it forked and isolated beforehand, which starts the code's process; so a call costs a
couple of milliseconds, not a Python start, and nothing of one call survives into the next.

With ``isolation="namespaces"`` (the default) the kernel enforces the boundary (see
:mod:`chatenv.tools.sandbox_isolation`): new user, PID, mount, network, IPC, UTS and cgroup namespaces per call, no
capabilities (and user ``nobody`` when the trainer is root), a read-only root showing only the interpreter and
system libraries, the episode's working directory at ``/workdir`` as the only writable host folder, no network
unless allowed, ``no_new_privs`` and a seccomp filter. The code cannot see, signal, trace or read the trainer, other
episodes or their files; when the call ends or times out, its PID namespace and every process in it are killed.
Resource limits (memory, CPU time, file size, open files, processes) bind each call. Requests and outputs travel in
memfds and on sockets the code's process never holds. What the kernel does not stop (kernel exploits, side
channels, CPU and memory pressure on the host) needs a VM. Where namespaces are unavailable the sandbox refuses to
start unless ``isolation="none"`` is asked for (a warning: then only rlimits and a Python audit hook bind the code).
Linux only.

:meth:`PythonSandbox.session` gives an episode a fresh working directory and the ``python(code)`` tool;
:func:`python_tool` makes one session per episode.

Example:
    >>> with PythonSandbox(workers=1) as sandbox:
    ...     session = sandbox.session()
    ...     print(session.python("print(6 * 7)"))
    ...     session.close()
    [stdout]
    42
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import json
import math
import os
import select
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path

from chatenv.tools.base import PerEpisode
from chatenv.tools.sandbox_worker import kill_tree

__all__ = ["PythonSandbox", "PythonSession", "SandboxError", "SandboxResult", "python_tool"]

WORKER_SCRIPT = Path(__file__).with_name("sandbox_worker.py")
ISOLATIONS = ("namespaces", "none")
NOBODY = 65534
_MIN_MEMORY_MB = 64
_MAX_CODE_CHARS = 10_000_000
_REPLY_GRACE_S = 15.0  # past a call's timeout, how long the parent waits for its zygote before replacing it
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/alternatives")
_SYSTEM_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "nsswitch.conf", "passwd", "group", "hosts")
_BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


class SandboxError(RuntimeError):
    """The sandbox cannot run code: it is closed, its isolation is unavailable, or a process could not start."""


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

    @property
    def ok(self) -> bool:
        """Whether the code ran through without an exception and was not killed."""
        return self.error is None and self.killed is None

    def text(self) -> str:
        """The result as the model sees it: each non-empty part under a ``[stdout]``-style header."""
        named = {"stdout": self.stdout, "stderr": self.stderr, "error": self.error, "killed": self.killed}
        parts = [f"[{name}]\n{value.rstrip()}" for name, value in named.items() if value]
        return "\n".join(parts) if parts else "(no output)"


class _ZygoteLost(Exception):
    """The zygote closed its socket, sent something unreadable or did not answer in time."""


def _receive(sock: socket.socket, deadline: float) -> tuple[dict | None, list[int]]:
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


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    try:
        socket.send_fds(sock, [json.dumps(message).encode()], list(fds))
    except OSError as e:
        raise _ZygoteLost(f"the sandbox process is gone ({e})") from None


@dataclasses.dataclass(eq=False)
class _Helper:
    """A helper the zygote prepared for one call: its pid, a pidfd to kill it by, the socket to talk to it."""

    pid: int
    pidfd: int
    sock: socket.socket

    def close(self) -> None:
        self.sock.close()
        os.close(self.pidfd)


@dataclasses.dataclass(eq=False)
class _Zygote:
    """One zygote process, the parent's end of its socket, the memfd holding its own stderr, its standby helper."""

    proc: subprocess.Popen
    sock: socket.socket
    stderr_fd: int
    ready: bool = False
    dead: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def take_helper(self, deadline: float) -> _Helper:
        """The standby helper (waiting for the zygote to prepare it); the zygote then prepares the next one.

        Raises:
            _ZygoteLost: If the zygote is gone or too slow.
            SandboxError: If the zygote could not prepare a helper (it stays usable).
        """
        message, fds = _receive(self.sock, deadline)
        if message is None:
            raise _ZygoteLost("the sandbox process did not prepare the call in time")
        _send(self.sock, {"next": True})
        if "standby" in message and len(fds) == 1:
            pid = int(message["standby"])
            return _Helper(pid, os.pidfd_open(pid), socket.socket(fileno=fds[0]))
        for fd in fds:
            os.close(fd)
        raise SandboxError(str(message.get("fatal", f"unexpected message {message!r}")))

    def exit_reason(self) -> str:
        try:
            code = self.proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            return "it closed its socket"
        return f"exit status {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"

    def stderr(self, limit: int = 4000) -> str:
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


def _read_capped(fd: int, limit: int) -> tuple[str, int]:
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


def _shutdown(lock: threading.Condition, zygotes: set, root: str) -> None:
    """Kill every zygote and remove the sandbox's files (the finalizer of :class:`PythonSandbox`)."""
    with lock:
        doomed = list(zygotes)
        zygotes.clear()
    for zygote in doomed:
        zygote.kill()
    shutil.rmtree(root, ignore_errors=True)


def _check_number(name: str, value: object, minimum: float, integer: bool = False) -> None:
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise TypeError(f"{name} must be {'an int' if integer else 'a finite number'}, got {value!r}")
    if value < minimum or (value == minimum == 0):
        raise ValueError(f"{name} must be {'> 0' if minimum == 0 else f'>= {minimum}'}, got {value!r}")


def _mapped(uid: int) -> bool:
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
    system = [*_SYSTEM_PATHS, *(f"/etc/{name}" for name in _SYSTEM_FILES)]
    return sorted({os.path.abspath(p) for p in (*prefixes, *system, *extra) if os.path.lexists(p)})


class PythonSandbox:
    """Runs Python code in a fresh, isolated process per call, from a pool of warm zygote processes.

    Thread-safe: envs on several threads share one sandbox; a call waits for a free zygote. Close it (or use it as a
    context manager) to kill the processes; they are also killed when it is garbage-collected or Python exits.

    Args:
        workers: How many zygotes (calls that run at the same time).
        timeout: Default wall-clock seconds per call; the code's processes are killed when it passes.
        memory_mb: Address-space limit of the code's process (``RLIMIT_AS``, MiB; at least 64). Big allocations
            then raise ``MemoryError``.
        max_output_chars: Characters of stdout and of stderr kept per call (and of a traceback's tail).
        allow_network: Whether code may use the network (the host's). When False, with namespaces the code has a
            network namespace of its own with only a loopback interface; with ``isolation="none"`` an audit hook
            refuses sockets (best-effort).
        isolation: ``"namespaces"`` (kernel isolation, see the module's docstring) or ``"none"`` (rlimits and a
            Python audit hook only; warns). With namespaces unavailable, construction raises :class:`SandboxError`.
        paths: More host paths the code may read (with namespaces; read-only, at the same paths).
        file_mb: Largest file the code may write (``RLIMIT_FSIZE``, MiB; stdout and stderr included; also the size
            of its ``/tmp``). Bigger writes fail with ``OSError``.
        max_open_files: ``RLIMIT_NOFILE`` of the code's process.
        max_processes: Processes and threads the code may have at once (``RLIMIT_NPROC``; with namespaces).
        start_timeout: Seconds a zygote may take to start.
        env: Environment variables for the code, over a minimal one (``PATH``, ``LANG``, ``HOME=/workdir``,
            ``TMPDIR``, BLAS/OpenMP threads 1); nothing of this process's environment is passed on.
        root: Directory for the sandbox's files and the sessions' working directories (default: the temp dir).

    Raises:
        SandboxError: If the processes cannot start, or the isolation asked for is unavailable (the message says
            why and how to choose).
    """

    def __init__(
        self,
        workers: int = 2,
        timeout: float = 10.0,
        memory_mb: int = 512,
        max_output_chars: int = 8000,
        allow_network: bool = False,
        *,
        isolation: str = "namespaces",
        paths: tuple[str, ...] | list[str] = (),
        file_mb: int = 64,
        max_open_files: int = 256,
        max_processes: int = 64,
        start_timeout: float = 30.0,
        env: dict[str, str] | None = None,
        root: str | None = None,
    ):
        limits = {"workers": workers, "memory_mb": memory_mb, "file_mb": file_mb, "max_open_files": max_open_files}
        limits.update(max_output_chars=max_output_chars, max_processes=max_processes)
        for name, value in limits.items():
            _check_number(name, value, {"memory_mb": _MIN_MEMORY_MB, "max_open_files": 32}.get(name, 1), True)
        _check_number("timeout", timeout, 0)
        _check_number("start_timeout", start_timeout, 0)
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if isolation == "none":
            warnings.warn(
                'PythonSandbox(isolation="none"): the code is bound only by rlimits and a Python audit hook; it can '
                "reach the trainer's processes, files and the network. Use it only for trusted code.",
                stacklevel=2,
            )
        if isinstance(paths, str) or not all(isinstance(p, str) and os.path.isabs(p) for p in paths):
            raise TypeError(f"paths must be a list of absolute paths, got {paths!r}")
        for path in paths:
            if os.path.normpath(path).split("/")[1] in ("", "proc", "dev", "workdir"):
                raise ValueError(f"paths cannot show {path!r}: /, /proc, /dev and /workdir are the sandbox's own")
        env = {**_BASE_ENV, **(env or {})}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise TypeError("env must map str to str")
        self.timeout, self.start_timeout = float(timeout), float(start_timeout)
        self.max_output_chars = max_output_chars
        self.isolation = isolation
        self.root = tempfile.mkdtemp(prefix="chatenv-sandbox-", dir=root)
        root_trainer = isolation == "namespaces" and os.geteuid() == 0 and _mapped(NOBODY)
        self.code_uid = NOBODY if root_trainer else os.geteuid()
        os.mkdir(os.path.join(self.root, "mnt"), 0o700)
        self._config = {
            **limits,
            "isolation": isolation,
            "allow_network": bool(allow_network),
            "outer_uid": os.geteuid(),
            "code_uid": self.code_uid,
            "outer_gid": os.getegid(),
            "mount_dir": os.path.join(self.root, "mnt"),
            "probe_dir": self.new_workdir("probe-"),
            "paths": visible_paths(tuple(paths)),
            "env": env,
            "start_timeout": self.start_timeout,
        }
        self._cond = threading.Condition()
        self._zygotes: set[_Zygote] = set()
        self._idle: list[_Zygote | None] = []  # None: a slot whose zygote must be started
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._cond, self._zygotes, self.root)
        try:
            started = [self._spawn() for _ in range(workers)]
            for zygote in started:
                self._start(zygote)
        except BaseException:
            self.close()
            raise
        self._idle.extend(started)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def new_workdir(self, prefix: str = "workdir-") -> str:
        """A new, empty working directory for :meth:`run` that the code's user may write (removed with the sandbox).

        Args:
            prefix: The start of its name.
        """
        path = tempfile.mkdtemp(prefix=prefix, dir=self.root)
        if self.code_uid != os.geteuid():
            os.chown(path, self.code_uid, self.code_uid)
        return path

    def _spawn(self) -> _Zygote:
        """Start a zygote process (without waiting for it to be ready)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        stderr_fd = os.memfd_create("sandbox-stderr", os.MFD_CLOEXEC)
        try:
            config = json.dumps({**self._config, "sock_fd": theirs.fileno()})
            argv = [sys.executable, "-I", str(WORKER_SCRIPT), config]
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr_fd,
                pass_fds=(theirs.fileno(),),
                cwd=self.root,
                env=dict(_BASE_ENV),
                start_new_session=True,
            )
        except BaseException:
            mine.close()
            os.close(stderr_fd)
            raise
        finally:
            theirs.close()
        zygote = _Zygote(proc, mine, stderr_fd)
        with self._cond:
            self._zygotes.add(zygote)
        return zygote

    def _start(self, zygote: _Zygote) -> None:
        """Wait for a new zygote's ready message; kill it and raise :class:`SandboxError` if it does not come."""
        try:
            message = _receive(zygote.sock, time.monotonic() + self.start_timeout)[0]
        except _ZygoteLost as e:
            message = {"fatal": f"{e} ({zygote.exit_reason()})"}
        if message is not None and "ready" in message:
            zygote.ready = True
            return
        message = message or {"fatal": f"it did not start within {self.start_timeout:g} s"}
        stderr = zygote.stderr()
        self._retire(zygote)
        hint = (
            "\nNamespaces are unavailable here (e.g. user namespaces are disabled, or a container forbids them): "
            'allow them, run the trainer in a VM, or pass isolation="none" to accept a sandbox without a kernel '
            "boundary."
            if self.isolation == "namespaces" and "isolate" in str(message.get("fatal"))
            else ""
        )
        raise SandboxError(
            f"the sandbox could not start: {message.get('fatal')}" + (f"\n{stderr}" if stderr else "") + hint
        )

    def _retire(self, zygote: _Zygote) -> None:
        zygote.kill()
        with self._cond:
            self._zygotes.discard(zygote)

    def _acquire(self) -> _Zygote:
        """A ready zygote, waiting until one is free (starting one where a slot has none)."""
        with self._cond:
            while not self._idle and not self._closed:
                self._cond.wait()
            if self._closed:
                raise SandboxError("the sandbox is closed")
            zygote = self._idle.pop()
        try:
            if zygote is not None and zygote.proc.poll() is not None:  # it died while idle
                self._retire(zygote)
                zygote = None
            zygote = zygote or self._spawn()
            if not zygote.ready:
                self._start(zygote)
        except BaseException:
            self._release(None, replace=False)
            raise
        return zygote

    def _release(self, zygote: _Zygote | None, replace: bool) -> None:
        """Return a zygote to the pool, or kill it and start a replacement (which gets ready in the background)."""
        if zygote is not None and (replace or self._closed):
            self._retire(zygote)
            zygote = None
            if not self._closed:
                with contextlib.suppress(OSError):  # if it fails, the next call that takes this slot tries again
                    zygote = self._spawn()
        with self._cond:
            closed = self._closed
            if not closed:
                self._idle.append(zygote)
                self._cond.notify()
        if closed and zygote is not None:
            self._retire(zygote)

    def run(self, code: str, *, workdir: str | os.PathLike, timeout: float | None = None) -> SandboxResult:
        """Run ``code`` as a script (a fresh process and ``__main__``) in ``workdir``.

        Args:
            code: Python source.
            workdir: An existing directory: with namespaces it is the code's only writable host folder, shown at
                ``/workdir`` (its current directory and the first entry of ``sys.path``). When the trainer runs as
                root, the code runs as ``nobody`` and needs write access to it (session folders have it).
            timeout: Wall-clock seconds (default: the sandbox's ``timeout``).

        Returns:
            The captured output and how the call ended; a timeout is reported in the result, not raised.

        Raises:
            TypeError: If ``code`` is not a string.
            ValueError: If ``workdir`` is not a directory the code's user can use, or ``timeout`` is not positive.
            SandboxError: If the sandbox is closed or its processes cannot be started.
        """
        if self._closed:
            raise SandboxError("the sandbox is closed")
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        if len(code) > _MAX_CODE_CHARS:
            raise ValueError(f"code is {len(code)} characters long; the sandbox takes at most {_MAX_CODE_CHARS}")
        _check_number("timeout", self.timeout if timeout is None else timeout, 0)
        timeout = float(self.timeout if timeout is None else timeout)
        workdir = os.path.realpath(os.fspath(workdir))
        if not os.path.isdir(workdir):
            raise ValueError(f"workdir must be an existing directory, got {workdir!r}")
        self._check_access(workdir)
        fds = [os.memfd_create(name, os.MFD_CLOEXEC) for name in ("request", "stdout", "stderr", "result")]
        try:
            os.write(fds[0], json.dumps({"code": code}).encode())
            zygote = self._acquire()
            start = time.monotonic()
            replace = True
            try:
                done = self._exchange(zygote, {"workdir": workdir, "timeout": timeout}, fds)
                replace = "zygote" in done
            finally:
                self._release(zygote, replace)
            return self._result(done, fds, timeout, time.monotonic() - start)
        finally:
            for fd in fds:
                os.close(fd)

    def _check_access(self, workdir: str) -> None:
        info = os.stat(workdir)
        if self.code_uid == os.geteuid() or info.st_uid == self.code_uid or info.st_mode & 0o003 == 0o003:
            return
        raise ValueError(
            f"workdir {workdir!r} is not writable by uid {self.code_uid}: the trainer runs as root, so the sandboxed "
            "code runs as nobody; use a session's folder (PythonSandbox.session()) or chown the folder to it"
        )

    def _exchange(self, zygote: _Zygote, call: dict, fds: list[int]) -> dict:
        """Run one call on the zygote's standby helper: how it ended (a ``done`` report, or ``{"lost", ...}``)."""
        try:
            helper = zygote.take_helper(time.monotonic() + self.start_timeout)
        except _ZygoteLost as e:
            return {"lost": "the sandbox was closed during the call" if self._closed else str(e), "zygote": True}
        except SandboxError as e:
            return {"lost": str(e)}
        try:
            _send(helper.sock, {"call": call}, fds)
            reply, _ = _receive(helper.sock, time.monotonic() + call["timeout"] + _REPLY_GRACE_S)
        except _ZygoteLost:
            reply = {"done": {"lost": "the sandbox was closed during the call" if self._closed else "its helper died"}}
        finally:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(helper.pidfd, signal.SIGKILL)  # already exiting, or overdue
            helper.close()
        if reply is None:
            return {"lost": "the sandbox did not report back in time; its processes were killed"}
        return reply.get("done") or {"lost": f"unexpected reply {reply!r}"}

    def _result(self, done: dict, fds: list[int], timeout: float, duration: float) -> SandboxResult:
        out, n_out = _read_capped(fds[1], self.max_output_chars)
        err, n_err = _read_capped(fds[2], self.max_output_chars)
        raw = os.pread(fds[3], 4 * self.max_output_chars + 4096, 0)
        reply: dict = {}
        with contextlib.suppress(ValueError):
            reply = json.loads(raw) if raw else {}
        reply = reply if isinstance(reply, dict) else {}
        error = reply.get("error") if isinstance(reply.get("error"), str) else None
        killed = _why_killed(done, reply, timeout)
        timed_out = bool(done.get("timed_out"))
        return SandboxResult(out, err, error, timed_out, killed, n_out, n_err, duration, done.get("pid"))

    def session(self, timeout: float | None = None) -> PythonSession:
        """A :class:`PythonSession`: a fresh working directory and the ``python`` tool (close it after the episode).

        Args:
            timeout: Seconds per call (default: the sandbox's ``timeout``).
        """
        return PythonSession(self, timeout=timeout)

    def worker_pids(self) -> list[int]:
        """The pids of the live zygote processes."""
        with self._cond:
            return sorted(z.proc.pid for z in self._zygotes if not z.dead)

    def close(self) -> None:
        """Kill the processes (a call in progress reports that it was killed) and remove the files; safe twice."""
        with self._cond:
            self._closed = True
            self._idle.clear()
            self._cond.notify_all()
        self._finalizer()

    def __enter__(self) -> PythonSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _why_killed(done: dict, reply: dict, timeout: float) -> str | None:
    """Why a call's process ended early, from the helper's report and the code's result; None if it ran through."""
    if "lost" in done:
        return str(done["lost"])
    if done.get("timed_out"):
        return f"timed out after {timeout:g} s; every process the code started was killed"
    if isinstance(reply.get("fatal"), str):
        return reply["fatal"]
    status = done.get("status")
    if status == 0 and "error" in reply:
        return None
    if isinstance(status, int) and status < 0:
        name = signal.Signals(-status).name
        why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (out of memory, or the code killed it)"}.get(name, "")
        return f"the code's process was killed by {name}{why}"
    return f"the code's process exited with status {status} before the code finished (did it call os._exit or exec?)"


class PythonSession:
    """One episode's use of a :class:`PythonSandbox`: a private working directory and the ``python`` tool.

    Files written by one call are there for later calls of the same session; other sessions never see them.
    Variables do not carry over between calls (each runs as a fresh script). ``close()`` removes the directory.

    Args:
        sandbox: The sandbox whose workers run the code.
        timeout: Seconds per call (default: the sandbox's ``timeout``).
    """

    def __init__(self, sandbox: PythonSandbox, timeout: float | None = None):
        if not isinstance(sandbox, PythonSandbox):
            raise TypeError(f"PythonSession needs a PythonSandbox, got {type(sandbox).__name__}")
        if timeout is not None:
            _check_number("timeout", timeout, 0)
        self.sandbox = sandbox
        self.timeout = timeout
        self.workdir = sandbox.new_workdir("session-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.workdir, ignore_errors=True)

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


def python_tool(sandbox: PythonSandbox, timeout: float | None = None) -> PerEpisode:
    """The ``python`` tool as a :class:`~chatenv.tools.base.PerEpisode`: one session per episode, closed at its end.

    Args:
        sandbox: The shared sandbox (its workers serve every episode).
        timeout: Seconds per call (default: the sandbox's ``timeout``).
    """
    if not isinstance(sandbox, PythonSandbox):
        raise TypeError(f"python_tool needs a PythonSandbox, got {type(sandbox).__name__}")

    def python_session() -> PythonSession:
        return sandbox.session(timeout=timeout)

    return PerEpisode(python_session)
