"""The code's process of :mod:`chatenv.tools.sandbox`: one call, isolated and limited.

It isolates and limits itself, waits for its one call, runs the code as a fresh ``__main__`` script and writes the
traceback (or None) to the result memfd. Standard library only (loaded by path in the zygote, see :mod:`procs`).
Forked by a helper (:mod:`worker`) before the call: with ``isolation="namespaces"`` it is the init of a new PID
namespace; it takes a mount namespace of its own, pivots into the prepared root, drops every capability (and becomes
``nobody`` under a root trainer), sets its limits, loads the seccomp filter and runs a warm-up script, then waits.
At the call it keeps only stdin (``/dev/null``), stdout, stderr and the result memfd; the socket to its helper is
closed before the code runs.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import linecache
import os
import resource
import signal
import socket
import sys
import traceback

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: the zygote imports the bare minimum of the standard library
if TYPE_CHECKING:
    from chatenv.tools.sandbox import isolation as iso
    from chatenv.tools.sandbox import procs
    from chatenv.tools.sandbox.procs import Message
else:
    procs = sys.modules.get("_chatenv_sandbox_procs")
    if procs is None:  # imported from the package (the trainer, the docs)
        from chatenv.tools.sandbox import procs
    iso = procs.load("isolation")

__all__ = ["FILENAME", "NETWORK_EVENTS", "code_process", "read_all"]

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

_MIB = 1024 * 1024

_SYS_PATH = [p for p in sys.path if p]  # the interpreter's own (started with -I: no script folder)

_ARMED: list[bool] = []  # non-empty once the code runs (the audit hook of isolation="none" then refuses sockets)


def code_process(config: Message, sock: socket.socket) -> None:
    """The code's process: isolate and limit itself, wait for the call, run the code, write the result.

    Never returns. Set-up failures go to the helper; later ones to the result memfd.
    """
    try:
        iso.set_parent_death_signal(signal.SIGKILL)
        procs.only_fds({2: 2, 3: sock.fileno()})
        sock = socket.socket(fileno=3)
        procs.SOCKETS.append(sock)
        isolated = config["isolation"] == "namespaces"
        namespace = []
        try:
            if isolated:
                iso.unshare(iso.CLONE_NEWNS)  # its own copy: pivoting the root there leaves the helper's alone
                if iso.enter_root(config["mount_dir"]):
                    namespace.append(os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC))
                iso.drop_privileges(config["code_uid"] if config["code_uid"] != config["outer_uid"] else None)
            fatal = _limits(config, count_processes=isolated)
            if fatal:
                raise OSError(fatal)
            if isolated:
                iso.install_seccomp(shared_memory=config["limits"]["memory"] != "watchdog")
            elif not config["allow_network"]:
                sys.addaudithook(_refuse_network)
        except OSError as e:
            procs.send(sock, {"fatal": str(e)})
            os._exit(70)
        try:
            _warm_up(config, isolated)
        except Exception as e:
            procs.send(sock, {"fatal": f"the code's process failed to warm up: {type(e).__name__}: {e}"})
            os._exit(70)
        procs.send(sock, {"ready": True}, namespace)
        for fd in namespace:
            os.close(fd)
        message, fds = procs.receive(sock)
        if message is None or len(fds) != 4:
            os._exit(0)
    except BaseException:
        os._exit(70)
    _call(config, message["call"], fds, isolated)


def _warm_up(config: Message, isolated: bool) -> None:
    """Run a trivial script the way a call will, before the call.

    The pages a call touches are then this process's own already (copying them on first write costs milliseconds
    on some virtual machines).
    """
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            os.dup2(null, fd)
    if null > 2:
        os.close(null)
    _environment(config, iso.WORKDIR if isolated else "/", isolated)
    json.loads(json.dumps({"code": "x = 1"}))
    _execute("x = 1", config["max_output_chars"])


def _environment(config: Message, workdir: str, isolated: bool) -> None:
    os.environ.clear()
    os.environ.update({**config["env"], "HOME": workdir, "TMPDIR": "/tmp" if isolated else workdir})
    sys.path[:] = [workdir, *_SYS_PATH]
    sys.path_importer_cache.clear()


def _call(config: Message, call: Message, fds: list[int], isolated: bool) -> None:
    """Run one call in the code's process (descriptors: the request, stdout, stderr, the result); never returns."""
    try:
        request = json.loads(read_all(fds[0]))
        procs.only_fds({0: os.open(os.devnull, os.O_RDONLY), 1: fds[1], 2: fds[2], 3: fds[3]})
    except BaseException:
        os._exit(70)
    try:
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        cpu = int(used + call["timeout"]) + 2
        cpu = cpu if hard == resource.RLIM_INFINITY else min(cpu, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))  # hard = soft: the code cannot raise it
        workdir = iso.WORKDIR if isolated else call["workdir"]
        os.chdir(workdir)
        if not isolated:
            _environment(config, workdir, isolated)
        _ARMED.append(True)
        error = _execute(request["code"], config["max_output_chars"])
        _write(3, {"error": error})
        os._exit(0)
    except BaseException as e:
        try:
            _write(3, {"fatal": f"the sandbox could not run the code: {type(e).__name__}: {e}"})
        finally:
            os._exit(70)


def _refuse_network(event: str, args: tuple[object, ...]) -> None:
    """Audit hook of ``isolation="none"`` once the code runs (best-effort: subprocesses and ctypes escape it)."""
    if event in NETWORK_EVENTS and _ARMED:
        raise PermissionError(f"network access is disabled in this sandbox ({event} was refused)")


def _vm_size_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _limits(config: Message, count_processes: bool) -> str | None:
    """Apply the resource limits to this process; the reason they cannot be met, or None."""
    memory_mb = config["memory_mb"]
    used = _vm_size_mb()
    if memory_mb < used + 16:
        return f"memory_mb={memory_mb} is too small: the sandbox's Python already uses {used:.0f} MiB"
    limits = {
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_AS: memory_mb * _MIB,
        resource.RLIMIT_FSIZE: config["file_mb"] * _MIB,
        resource.RLIMIT_NOFILE: config["max_open_files"],
    }
    if count_processes:  # per user of the call's user namespace; in "none" mode it would count the trainer's own
        # where a cgroup counts the call's processes, it is the bound that reports them (this one is a backstop)
        cgrouped = config["limits"]["processes"].startswith("cgroup")
        limits[resource.RLIMIT_NPROC] = config["max_processes"] + (16 if cgrouped else 0)
    for which, value in limits.items():  # hard = soft: the code cannot raise them
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return None


def read_all(fd: int) -> bytes:
    """Everything in a memfd, from its start (its offset is shared with the other processes that hold it)."""
    parts, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _write(fd: int, message: Message) -> None:
    data = json.dumps(message).encode()
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    while data:
        data = data[os.write(fd, data) :]


def _execute(code: str, cap: int) -> str | None:
    """Run ``code`` as a fresh ``__main__`` script with the standard streams on descriptors 0-2; its traceback."""
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    sys.stdin = open(0, closefd=False)
    sys.argv = [FILENAME]
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)
    error = None
    try:
        exec(compile(code, FILENAME, "exec", dont_inherit=True), namespace)
    except SystemExit as e:
        error = None if e.code in (None, 0) else f"SystemExit: {e.code}"
    except BaseException as e:  # the code's own errors, KeyboardInterrupt and MemoryError included
        try:
            tb = e.__traceback__.tb_next if e.__traceback__ else None
            error = "".join(traceback.format_exception(type(e), e, tb))
        except MemoryError:
            error = f"{type(e).__name__}: (no traceback: out of memory)"
        if len(error) > cap:
            error = (
                f"[... {len(error) - cap} characters cut; tracebacks are limited to {cap} characters ...]\n"
                + (error[-cap:])
            )
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    ctypes.CDLL(None).fflush(None)
    return error
