"""The :class:`PythonSandbox`: a pool of zygotes, each serving one isolated call at a time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING

from chatenv.tools.sandbox import cgroups, quota
from chatenv.tools.sandbox.results import SandboxError, SandboxResult, check_number, read_capped, why_killed
from chatenv.tools.sandbox.session import PythonSession
from chatenv.tools.sandbox.zygote import (
    BASE_ENV,
    WORKER_SCRIPT,
    Zygote,
    _ZygoteLost,
    mapped,
    receive,
    send,
    visible_paths,
)

if TYPE_CHECKING:
    from chatenv.tools.sandbox.procs import Message

__all__ = ["ISOLATIONS", "PythonSandbox", "check_number"]

ISOLATIONS = ("namespaces", "none")

CALL_LIMITS = ("auto", "cgroup", "watchdog", "process")

NOBODY = 65534

_MIN_MEMORY_MB = 64

_MAX_CODE_CHARS = 10_000_000

_REPLY_GRACE_S = 15.0  # past a call's timeout, how long the parent waits for its zygote before replacing it


def _shutdown(lock: threading.Condition, zygotes: set[Zygote], root: str, groups: Message) -> None:
    """Kill every zygote, remove the sandbox's files and cgroups (the finalizer of :class:`PythonSandbox`)."""
    with lock:
        doomed = list(zygotes)
        zygotes.clear()
    for zygote in doomed:
        zygote.kill()
    cgroups.remove_base(groups)
    quota.remove_tree(root, ignore_errors=True)


def _check_paths_and_env(paths: tuple[str, ...] | list[str], env: dict[str, str] | None) -> dict[str, str]:
    """Check the extra paths and environment of :class:`PythonSandbox`; the code's whole environment."""
    if isinstance(paths, str) or not all(isinstance(p, str) and os.path.isabs(p) for p in paths):
        raise TypeError(f"paths must be a list of absolute paths, got {paths!r}")
    for path in paths:
        if os.path.normpath(path).split("/")[1] in ("", "proc", "dev", "workdir"):
            raise ValueError(f"paths cannot show {path!r}: /, /proc, /dev and /workdir are the sandbox's own")
    env = {**BASE_ENV, **(env or {})}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TypeError("env must map str to str")
    return env


class PythonSandbox:
    """Runs Python code in a fresh, isolated process per call, from a pool of warm zygote processes.

    Thread-safe: envs on several threads share one sandbox; a call waits for a free zygote. Close it (or use it as a
    context manager) to kill the processes; they are also killed when it is garbage-collected or Python exits.

    Args:
        workers: How many zygotes (calls that run at the same time).
        timeout: Default wall-clock seconds per call; the code's processes are killed when it passes.
        memory_mb: Memory of the whole call (MiB; at least 64): every process the code starts together, and the
            files it writes to ``/tmp`` and ``/workdir`` where a cgroup counts them (see ``call_limits``); also the
            address space of each process (``RLIMIT_AS``: big allocations raise ``MemoryError``).
        max_output_chars: Characters of stdout and of stderr kept per call (and of a traceback's tail).
        allow_network: Whether code may use the network (the host's). When False, with namespaces the code has a
            network namespace of its own with only a loopback interface; with ``isolation="none"`` an audit hook
            refuses sockets (best-effort).
        isolation: ``"namespaces"`` (kernel isolation, see the module's docstring) or ``"none"`` (rlimits and a
            Python audit hook only; warns). With namespaces unavailable, construction raises :class:`SandboxError`.
        paths: More host paths the code may read (with namespaces; read-only, at the same paths).
        file_mb: Largest file the code may write (``RLIMIT_FSIZE``, MiB; stdout and stderr included). Bigger writes
            fail with ``OSError``.
        disk_mb: The call's disk quota (MiB; default ``file_mb``): ``/tmp`` and the episode's files in ``/workdir``
            together, on a tmpfs of that size (with namespaces); a write past it fails with ``ENOSPC``. The
            episode's folder is copied onto it before each call and back after it; ``/tmp`` is new for each call.
        max_open_files: ``RLIMIT_NOFILE`` of the code's process.
        max_processes: Processes and threads the whole call may have at once (a ``pids`` cgroup, else
            ``RLIMIT_NPROC`` in the call's own user namespace; with ``isolation="none"`` only by a cgroup).
        call_limits: How memory and processes are bounded for the whole call: ``"auto"`` (a cgroup where this
            process may make one, else a watchdog that sums the memory of the call's processes every 10 ms and
            kills them all over the bound), ``"cgroup"`` (cgroups or :class:`SandboxError`), ``"watchdog"`` (never
            cgroups), or ``"process"`` (no bound on the sum: ``memory_mb`` binds each process alone).
            :attr:`limits` says what is in force.
        start_timeout: Seconds a zygote may take to start.
        env: Environment variables for the code, over a minimal one (``PATH``, ``LANG``, ``HOME=/workdir``,
            ``TMPDIR``, BLAS/OpenMP threads 1); nothing of this process's environment is passed on.
        root: Directory for the sandbox's files and the sessions' working directories (default: the temp dir).

    Attributes:
        limits: How each bound is enforced: ``memory`` (``"cgroup2"``, ``"cgroup1"``, ``"watchdog"`` or
            ``"process"``), ``processes`` (``"cgroup2"``, ``"cgroup1"``, ``"rlimit"`` or ``"none"``), ``disk``
            (``"tmpfs"``, or ``"file size only"`` without namespaces), ``cpu`` (``"rlimit"``, per process).

    Raises:
        SandboxError: If the processes cannot start, the isolation asked for is unavailable, or
            ``call_limits="cgroup"`` and no cgroup can be made (the message says why and how to choose).
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
        disk_mb: int | None = None,
        max_open_files: int = 256,
        max_processes: int = 64,
        call_limits: str = "auto",
        start_timeout: float = 30.0,
        env: dict[str, str] | None = None,
        root: str | None = None,
    ):
        limits = {"workers": workers, "memory_mb": memory_mb, "file_mb": file_mb, "max_open_files": max_open_files}
        disk_mb = file_mb if disk_mb is None else disk_mb
        limits.update(max_output_chars=max_output_chars, max_processes=max_processes, disk_mb=disk_mb)
        for name, value in limits.items():
            check_number(name, value, {"memory_mb": _MIN_MEMORY_MB, "max_open_files": 32}.get(name, 1), True)
        check_number("timeout", timeout, 0)
        check_number("start_timeout", start_timeout, 0)
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
        if call_limits not in CALL_LIMITS:
            raise ValueError(f"call_limits must be one of {CALL_LIMITS}, got {call_limits!r}")
        if isolation == "none":
            warnings.warn(
                'PythonSandbox(isolation="none"): the code is bound only by rlimits and a Python audit hook; it can '
                "reach the trainer's processes, files and the network. Use it only for trusted code.",
                stacklevel=2,
            )
        env = _check_paths_and_env(paths, env)
        self.timeout, self.start_timeout = float(timeout), float(start_timeout)
        self.max_output_chars = max_output_chars
        self.isolation = isolation
        self.root = tempfile.mkdtemp(prefix="chatenv-sandbox-", dir=root)
        root_trainer = isolation == "namespaces" and os.geteuid() == 0 and mapped(NOBODY)
        self.code_uid = NOBODY if root_trainer else os.geteuid()
        os.mkdir(os.path.join(self.root, "mnt"), 0o700)
        os.mkdir(os.path.join(self.root, "disk"), 0o700)
        groups, self.limits = self._plan_limits(call_limits)
        self._config = {
            **limits,
            "isolation": isolation,
            "allow_network": bool(allow_network),
            "outer_uid": os.geteuid(),
            "code_uid": self.code_uid,
            "outer_gid": os.getegid(),
            "mount_dir": os.path.join(self.root, "mnt"),
            "disk_dir": os.path.join(self.root, "disk"),
            "cgroups": groups,
            "limits": self.limits,
            "probe_dir": self.new_workdir("probe-"),
            "paths": visible_paths(tuple(paths)),
            "env": env,
            "start_timeout": self.start_timeout,
        }
        self._cond = threading.Condition()
        self._zygotes: set[Zygote] = set()
        self._idle: list[Zygote | None] = []  # None: a slot whose zygote must be started
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._cond, self._zygotes, self.root, groups)
        try:
            started = [self._spawn() for _ in range(workers)]
            for zygote in started:
                self._start(zygote)
        except BaseException:
            self.close()
            raise
        self._idle.extend(started)

    def _plan_limits(self, call_limits: str) -> tuple[Message, dict[str, str]]:
        """Make the sandbox's cgroups where it may; them and :attr:`limits` (SandboxError if cgroups are required)."""
        why: list[str] = []
        groups, limits = cgroups.plan(call_limits, self.isolation, os.path.basename(self.root), why)
        if call_limits == "cgroup" and not limits["memory"].startswith("cgroup"):
            _shutdown(threading.Condition(), set(), self.root, groups)
            raise SandboxError(
                'call_limits="cgroup": this process may not make memory and pids cgroups ('
                + ("; ".join(why) or "no cgroup hierarchy found")
                + '); pass call_limits="auto" to bound the call by a memory watchdog and RLIMIT_NPROC instead, or '
                'call_limits="process" to bound each process alone'
            )
        return groups, limits

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

    def _spawn(self) -> Zygote:
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
                env=dict(BASE_ENV),
                start_new_session=True,
            )
        except BaseException:
            mine.close()
            os.close(stderr_fd)
            raise
        finally:
            theirs.close()
        zygote = Zygote(proc, mine, stderr_fd)
        with self._cond:
            self._zygotes.add(zygote)
        return zygote

    def _start(self, zygote: Zygote) -> None:
        """Wait for a new zygote's ready message; kill it and raise :class:`SandboxError` if it does not come."""
        try:
            message = receive(zygote.sock, time.monotonic() + self.start_timeout)[0]
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

    def _retire(self, zygote: Zygote) -> None:
        zygote.kill()
        with self._cond:
            self._zygotes.discard(zygote)

    def _acquire(self) -> Zygote:
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

    def _release(self, zygote: Zygote | None, replace: bool) -> None:
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

    def run(self, code: str, *, workdir: str | os.PathLike[str], timeout: float | None = None) -> SandboxResult:
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
        check_number("timeout", self.timeout if timeout is None else timeout, 0)
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

    def _exchange(self, zygote: Zygote, call: Message, fds: list[int]) -> Message:
        """Run one call on the zygote's standby helper: how it ended (a ``done`` report, or ``{"lost", ...}``)."""
        try:
            helper = zygote.take_helper(time.monotonic() + self.start_timeout)
        except _ZygoteLost as e:
            return {"lost": "the sandbox was closed during the call" if self._closed else str(e), "zygote": True}
        except SandboxError as e:
            return {"lost": str(e)}
        try:
            send(helper.sock, {"call": call}, fds)
            reply, _ = receive(helper.sock, time.monotonic() + call["timeout"] + _REPLY_GRACE_S)
        except _ZygoteLost:
            reply = {"done": {"lost": "the sandbox was closed during the call" if self._closed else "its helper died"}}
        finally:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(helper.pidfd, signal.SIGKILL)  # already exiting, or overdue
            helper.close()
        if reply is None:
            return {"lost": "the sandbox did not report back in time; its processes were killed"}
        return reply.get("done") or {"lost": f"unexpected reply {reply!r}"}

    def _result(self, done: Message, fds: list[int], timeout: float, duration: float) -> SandboxResult:
        out, n_out = read_capped(fds[1], self.max_output_chars)
        err, n_err = read_capped(fds[2], self.max_output_chars)
        raw = os.pread(fds[3], 4 * self.max_output_chars + 4096, 0)
        reply: Message = {}
        with contextlib.suppress(ValueError):
            reply = json.loads(raw) if raw else {}
        reply = reply if isinstance(reply, dict) else {}
        error = reply.get("error") if isinstance(reply.get("error"), str) else None
        killed = why_killed(done, reply, timeout)
        timed_out = bool(done.get("timed_out"))
        exceeded = done.get("exceeded") if isinstance(done.get("exceeded"), str) else None
        if exceeded is None and error and error.rstrip().rpartition("\n")[2].startswith("MemoryError"):
            exceeded = "memory"  # one allocation past the address-space limit
        peak = done.get("memory_peak")
        peak_mb = peak / 2**20 if isinstance(peak, int) else None
        return SandboxResult(
            out, err, error, timed_out, killed, n_out, n_err, duration, done.get("pid"), exceeded, peak_mb, self.limits
        )

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
