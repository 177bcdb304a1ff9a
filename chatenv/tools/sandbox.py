"""A sandboxed Python tool: code runs in a pool of warm, resource-limited worker processes.

:class:`PythonSandbox` keeps ``workers`` processes running ``python -I sandbox_worker.py`` (each its own session
and process group; they never import ``chatenv`` or torch), so a call costs milliseconds, not a process start. Each
worker limits its memory, CPU time, file sizes and open files and refuses sockets when the network is off; the parent
enforces the wall-clock timeout by killing the worker and everything it started, then starts a replacement. Stdout
and stderr are captured at the file-descriptor level (C code and child processes included) and cut to
``max_output_chars`` with a marker that says how much was cut. :meth:`PythonSandbox.session` gives an episode a
fresh working directory and the ``python(code)`` tool; :func:`python_tool` makes one session per episode.

Best-effort, not a security boundary: rlimits and an audit hook in the worker bind the code only as far as the OS
and CPython enforce them (subprocesses escape the hook, ctypes can bypass it), and reused workers keep module state
between calls (``max_calls=1``: a fresh process per call). Add a container or VM for untrusted code. Linux only.

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
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from chatenv.tools.base import PerEpisode
from chatenv.tools.sandbox_worker import frame, kill_tree

__all__ = ["PythonSandbox", "PythonSession", "SandboxError", "SandboxResult", "python_tool"]

WORKER_SCRIPT = Path(__file__).with_name("sandbox_worker.py")
_MIN_MEMORY_MB = 64
_MAX_CODE_CHARS = 10_000_000


class SandboxError(RuntimeError):
    """The sandbox cannot run code: it is closed, or a worker process could not be started."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one call printed and how it ended.

    Attributes:
        stdout: What the code wrote to file descriptor 1, cut to ``max_output_chars`` (then with a marker at the end).
        stderr: The same for file descriptor 2.
        error: The traceback of the exception the code raised (its tail, from the code's frames), or None.
        timed_out: Whether the call ran past its timeout (the worker and its processes were then killed).
        killed: Why the worker was killed or died during the call (timeout, CPU limit, crash), or None.
        stdout_chars: How many characters the code wrote to stdout in all (more than ``len(stdout)`` when cut).
        stderr_chars: The same for stderr.
        duration_s: Wall-clock seconds of the call.
        worker_pid: The pid of the worker process that ran it.
    """

    stdout: str
    stderr: str
    error: str | None
    timed_out: bool
    killed: str | None
    stdout_chars: int
    stderr_chars: int
    duration_s: float
    worker_pid: int

    @property
    def ok(self) -> bool:
        """Whether the code ran through without an exception and was not killed."""
        return self.error is None and self.killed is None

    def text(self) -> str:
        """The result as the model sees it: each non-empty part under a ``[stdout]``-style header."""
        named = {"stdout": self.stdout, "stderr": self.stderr, "error": self.error, "killed": self.killed}
        parts = [f"[{name}]\n{value.rstrip()}" for name, value in named.items() if value]
        return "\n".join(parts) if parts else "(no output)"


class _WorkerLost(Exception):
    """The worker closed its pipe or sent something that is not a reply."""


@dataclasses.dataclass(eq=False)
class _Worker:
    """One worker process, its protocol pipes and its stdout/stderr files (``stem`` + ``.out`` / ``.err``)."""

    proc: subprocess.Popen
    req_fd: int
    resp_fd: int
    stem: str
    buffer: bytes = b""
    calls: int = 0
    ready: bool = False
    dead: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def send(self, message: dict) -> None:
        """Send one request; :class:`_WorkerLost` if the worker is gone."""
        data = frame(message)
        try:
            while data:
                data = data[os.write(self.req_fd, data) :]
        except OSError as e:
            raise _WorkerLost(f"the worker is gone ({e})") from None

    def receive(self, deadline: float) -> dict | None:
        """The next message, or None if ``deadline`` (a ``time.monotonic()`` time) passes first."""
        poller = select.poll()
        poller.register(self.resp_fd, select.POLLIN)
        while True:
            size = struct.unpack("!I", self.buffer[:4])[0] if len(self.buffer) >= 4 else None
            if size is not None and len(self.buffer) >= 4 + size:
                body, self.buffer = self.buffer[4 : 4 + size], self.buffer[4 + size :]
                return _decode(body)
            if size is not None and size > 1 << 26:
                raise _WorkerLost("the worker sent a malformed reply (did the code write to its pipe?)")
            if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                return None
            chunk = os.read(self.resp_fd, 1 << 16)
            if not chunk:
                raise _WorkerLost(self.exit_reason())
            self.buffer += chunk

    def exit_status(self, wait_s: float = 0.0) -> int | None:
        """The exit status (negative: the signal) once the worker has exited, or None; without reaping it."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # reaped by kill()
                return self.proc.returncode
            if info is not None:
                return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def exit_reason(self) -> str:
        """Why the worker stopped answering (after waiting briefly for it to exit)."""
        code = self.exit_status(wait_s=0.5)
        if code is None:
            return "the worker closed its pipe and stopped answering"
        if code >= 0:
            return f"the worker exited with status {code} (did the code call os._exit or exec?)"
        name = signal.Signals(-code).name
        why = {"SIGXCPU": " (CPU time limit)", "SIGKILL": " (out of memory, or the code killed it)"}.get(name, "")
        return f"the worker was killed by {name}{why}"

    def output(self, limit: int) -> tuple[str, int, str, int]:
        """What the last call wrote: ``(stdout, stdout_chars, stderr, stderr_chars)``, each cut to ``limit``."""
        return (*_read_capped(self.stem + ".out", limit), *_read_capped(self.stem + ".err", limit))

    def kill(self, remove_files: bool = False) -> None:
        """Kill the worker and every process below it, reap it and close its pipes (safe to call twice)."""
        with self.lock:
            if not self.dead:
                self.dead = True
                if self.proc.returncode is None:  # not reaped yet: its pid (a zombie's at least) is still its own
                    kill_tree(self.proc.pid)
                self.proc.wait()
                os.close(self.req_fd)
                os.close(self.resp_fd)
        for path in (self.stem + ".out", self.stem + ".err") if remove_files else ():
            with contextlib.suppress(OSError):
                os.unlink(path)


def _decode(body: bytes) -> dict:
    with contextlib.suppress(ValueError):
        if isinstance(message := json.loads(body), dict):
            return message
    raise _WorkerLost("the worker sent a malformed reply (did the code write to its pipe?)")


def _read_capped(path: str, limit: int) -> tuple[str, int]:
    """The first ``limit`` characters of a UTF-8 file (plus a marker if it has more) and its length in characters."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    head: list[str] = []
    kept = total = 0
    with contextlib.suppress(OSError), open(path, "rb") as f:
        while chunk := f.read(1 << 20):
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


def _shutdown(lock: threading.Condition, workers: set, root: str) -> None:
    """Kill every worker and remove the sandbox's files (the finalizer of :class:`PythonSandbox`)."""
    with lock:
        doomed = list(workers)
        workers.clear()
    for worker in doomed:
        worker.kill()
    shutil.rmtree(root, ignore_errors=True)


def _check_number(name: str, value: object, minimum: float, integer: bool = False) -> None:
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        raise TypeError(f"{name} must be {'an int' if integer else 'a finite number'}, got {value!r}")
    if value < minimum or (value == minimum == 0):
        raise ValueError(f"{name} must be {'> 0' if minimum == 0 else f'>= {minimum}'}, got {value!r}")


class PythonSandbox:
    """A pool of warm worker processes that run Python code under limits.

    Thread-safe: envs on several threads share one sandbox; a call waits for a free worker. Close it (or use it as a
    context manager) to kill the workers; they are also killed when it is garbage-collected or Python exits.

    Args:
        workers: How many worker processes (calls that run at the same time).
        timeout: Default wall-clock seconds per call; the worker and its processes are killed when it passes.
        memory_mb: Address-space limit of each worker (``RLIMIT_AS``, MiB; at least 64). Big allocations then
            raise ``MemoryError``, after which the worker is replaced.
        max_output_chars: Characters of stdout and of stderr kept per call (and of a traceback's tail).
        allow_network: Whether code may use sockets; when False an audit hook refuses connect, bind, sendto and
            name lookups with a PermissionError (best-effort: it does not bind subprocesses).
        file_mb: Largest file the code may write (``RLIMIT_FSIZE``, MiB; stdout and stderr included). Bigger
            writes fail with ``OSError`` (``SIGXFSZ`` is ignored).
        max_open_files: ``RLIMIT_NOFILE`` of each worker.
        max_calls: Calls after which a worker is replaced by a fresh one (1: a new process for every call).
        start_timeout: Seconds a new worker may take to start.
        env: The workers' environment (default: this process's, with BLAS/OpenMP threads set to 1).
        root: Directory for the sandbox's files and the sessions' working directories (default: the temp dir).

    Raises:
        SandboxError: If the workers cannot start (e.g. ``memory_mb`` is too small for Python).
    """

    def __init__(
        self,
        workers: int = 2,
        timeout: float = 10.0,
        memory_mb: int = 512,
        max_output_chars: int = 8000,
        allow_network: bool = False,
        *,
        file_mb: int = 64,
        max_open_files: int = 256,
        max_calls: int = 100,
        start_timeout: float = 30.0,
        env: dict[str, str] | None = None,
        root: str | None = None,
    ):
        limits = {"workers": workers, "memory_mb": memory_mb, "file_mb": file_mb, "max_open_files": max_open_files}
        limits.update(max_output_chars=max_output_chars, max_calls=max_calls)
        for name, value in limits.items():
            _check_number(name, value, {"memory_mb": _MIN_MEMORY_MB, "max_open_files": 32}.get(name, 1), True)
        _check_number("timeout", timeout, 0)
        _check_number("start_timeout", start_timeout, 0)
        self.timeout, self.start_timeout = float(timeout), float(start_timeout)
        self.max_output_chars, self.max_calls = max_output_chars, max_calls
        self.root = tempfile.mkdtemp(prefix="chatenv-sandbox-", dir=root)
        self._config = {**limits, "home": self.root, "allow_network": bool(allow_network)}
        env = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or os.environ)}
        self._popen_args = {"stdin": subprocess.DEVNULL, "cwd": self.root, "start_new_session": True, "env": env}
        self._cond = threading.Condition()
        self._workers: set[_Worker] = set()
        self._idle: list[_Worker | None] = []  # None: a slot whose worker must be started
        self._closed = False
        self._count = 0
        self._finalizer = weakref.finalize(self, _shutdown, self._cond, self._workers, self.root)
        try:
            started = [self._spawn() for _ in range(workers)]
            for worker in started:
                self._start(worker)
        except BaseException:
            self.close()
            raise
        self._idle.extend(started)

    def _spawn(self) -> _Worker:
        """Start a worker process (without waiting for it to be ready)."""
        with self._cond:
            self._count += 1
            stem = os.path.join(self.root, f"worker{self._count}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        out_fd, err_fd = os.open(stem + ".out", flags, 0o600), os.open(stem + ".err", flags, 0o600)
        (req_r, req_w), (resp_r, resp_w) = os.pipe(), os.pipe()
        config = json.dumps({**self._config, "req_fd": req_r, "resp_fd": resp_w})
        fds = [req_r, resp_w, out_fd, err_fd]  # the worker's ends: closed here once it has them
        try:
            argv = [sys.executable, "-I", str(WORKER_SCRIPT), config]
            proc = subprocess.Popen(argv, stdout=out_fd, stderr=err_fd, pass_fds=(req_r, resp_w), **self._popen_args)
        except BaseException:
            fds += [req_w, resp_r]
            raise
        finally:
            for fd in fds:
                os.close(fd)
        worker = _Worker(proc, req_w, resp_r, stem)
        with self._cond:
            self._workers.add(worker)
        return worker

    def _start(self, worker: _Worker) -> None:
        """Wait for a new worker's ready message; kill it and raise :class:`SandboxError` if it does not come."""
        try:
            message = worker.receive(time.monotonic() + self.start_timeout)
        except _WorkerLost as e:
            message = {"fatal": str(e)}
        if message is not None and "fatal" not in message:
            worker.ready = True
            return
        message = message or {"fatal": f"it did not start within {self.start_timeout:g} s"}
        stderr = worker.output(2000)[2]  # e.g. the traceback of a worker that failed to start
        self._retire(worker)
        raise SandboxError(f"a sandbox worker could not start: {message['fatal']}" + (f"\n{stderr}" if stderr else ""))

    def _retire(self, worker: _Worker) -> None:
        worker.kill(remove_files=True)
        with self._cond:
            self._workers.discard(worker)

    def _acquire(self) -> _Worker:
        """A ready worker, waiting until one is free (starting one where a slot has none)."""
        with self._cond:
            while not self._idle and not self._closed:
                self._cond.wait()
            if self._closed:
                raise SandboxError("the sandbox is closed")
            worker = self._idle.pop()  # the most recently used: warm caches, the same process for sequential calls
        try:
            if worker is not None and worker.exit_status() is not None:  # it died while idle
                self._retire(worker)
                worker = None
            worker = worker or self._spawn()
            if not worker.ready:
                self._start(worker)
        except BaseException:
            self._release(None, replace=False)
            raise
        return worker

    def _release(self, worker: _Worker | None, replace: bool) -> None:
        """Return a worker to the pool, or kill it and start a replacement (which gets ready in the background)."""
        if worker is not None and (replace or self._closed):
            self._retire(worker)
            worker = None
            if not self._closed:
                with contextlib.suppress(OSError):  # if it fails, the next call that takes this slot tries again
                    worker = self._spawn()
        with self._cond:
            closed = self._closed
            if not closed:
                self._idle.append(worker)
                self._cond.notify()
        if closed and worker is not None:
            self._retire(worker)

    def run(self, code: str, *, workdir: str | os.PathLike, timeout: float | None = None) -> SandboxResult:
        """Run ``code`` as a script (a fresh ``__main__`` namespace) with ``workdir`` as the working directory.

        Args:
            code: Python source.
            workdir: An existing directory; it is the current directory and the first entry of ``sys.path``.
            timeout: Wall-clock seconds (default: the sandbox's ``timeout``).

        Returns:
            The captured output and how the call ended; a timeout is reported in the result, not raised.

        Raises:
            TypeError: If ``code`` is not a string.
            ValueError: If ``workdir`` is not a directory or ``timeout`` is not positive.
            SandboxError: If the sandbox is closed or no worker can be started.
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        if len(code) > _MAX_CODE_CHARS:
            raise ValueError(f"code is {len(code)} characters long; the sandbox takes at most {_MAX_CODE_CHARS}")
        _check_number("timeout", self.timeout if timeout is None else timeout, 0)
        timeout = float(self.timeout if timeout is None else timeout)
        workdir = os.path.realpath(os.fspath(workdir))
        if not os.path.isdir(workdir):
            raise ValueError(f"workdir must be an existing directory, got {workdir!r}")
        worker = self._acquire()
        start = time.monotonic()
        replace = True
        try:
            reply, killed, timed_out = self._exchange(worker, {"code": code, "workdir": workdir, "timeout": timeout})
            if killed is not None:
                worker.kill()  # before reading: the killed processes write nothing more
            output = worker.output(self.max_output_chars)
            replace = reply is None or bool(reply.get("abnormal")) or worker.calls >= self.max_calls
        finally:
            self._release(worker, replace)
        error = None if reply is None else reply.get("error")
        out, n_out, err, n_err = output
        return SandboxResult(
            out, err, error, timed_out, killed, n_out, n_err, time.monotonic() - start, worker.proc.pid
        )

    def _exchange(self, worker: _Worker, request: dict) -> tuple[dict | None, str | None, bool]:
        """Send one request and wait for the reply: ``(reply, killed, timed_out)``."""
        worker.calls += 1
        timeout = request["timeout"]
        deadline = time.monotonic() + timeout
        try:
            worker.send(request)
            reply = worker.receive(deadline)
        except _WorkerLost as e:
            if self._closed:
                return None, "the sandbox was closed during the call", False
            return None, str(e), time.monotonic() >= deadline
        if reply is None:
            return None, f"timed out after {timeout:g} s; the worker and every process it started were killed", True
        return reply, None, False

    def session(self, timeout: float | None = None) -> PythonSession:
        """A :class:`PythonSession`: a fresh working directory and the ``python`` tool (close it after the episode).

        Args:
            timeout: Seconds per call (default: the sandbox's ``timeout``).
        """
        return PythonSession(self, timeout=timeout)

    def worker_pids(self) -> list[int]:
        """The pids of the live worker processes."""
        with self._cond:
            return sorted(w.proc.pid for w in self._workers if not w.dead)

    def close(self) -> None:
        """Kill the workers (a call in progress reports that it was killed) and remove the files; safe twice."""
        with self._cond:
            self._closed = True
            self._idle.clear()
            self._cond.notify_all()
        self._finalizer()

    def __enter__(self) -> PythonSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        self.workdir = tempfile.mkdtemp(prefix="session-", dir=sandbox.root)
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
