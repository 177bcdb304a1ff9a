"""The processes behind :mod:`chatenv.tools.sandbox`: a warm zygote, one helper per call, and the code's process.

The parent starts this file by path (``python -I sandbox_worker.py CONFIG_JSON``) with an empty environment, so the
zygote never imports ``chatenv`` (nor torch) and holds nothing of the trainer's. Importing the module does nothing
(the sandbox imports it for :func:`kill_tree`); :func:`main` is the entry point.

- **Zygote** (:func:`main`): serves calls one at a time over a ``SOCK_SEQPACKET`` socket whose number is in the
  configuration. It never sees code or output: a call brings four memfds from the parent (the request, stdout,
  stderr, the result) and the zygote hands them to a helper it forked beforehand (the *standby*), then forks the
  next standby while the call runs.
- **Helper** (:func:`_helper`): forked from the zygote; with ``isolation="namespaces"`` it enters new user, mount,
  PID, network (unless allowed), IPC, UTS and cgroup namespaces and builds the code's root file system
  (:mod:`sandbox_isolation`), then waits. On a call it binds the episode's working directory into that root, forks
  the code's process (the init of the new PID namespace), kills it at the timeout and reports how it ended. The
  kernel then removes the namespaces with everything in them.
- **Runner** (:func:`_runner`): the code's process. It enters the root, drops every capability (and becomes
  ``nobody`` when the trainer is root), sets its limits, closes every descriptor but stdin/stdout/stderr and the
  result memfd, loads the seccomp filter, and runs the code as a fresh ``__main__`` script; the traceback (or None)
  goes to the result memfd. Nothing of it outlives the call.

Messages are JSON. Parent -> zygote: ``{"call": {"workdir", "timeout"}}`` + 4 fds; zygote -> parent: first
``{"ready": pid}`` or ``{"fatal": reason}``, then per call ``{"done": {"pid", "status", "timed_out"}}`` (``status``:
the exit code, negative for a signal) or ``{"done": {"lost": reason}}``.
"""

from __future__ import annotations

import builtins
import ctypes
import fcntl
import gc
import importlib.util
import json
import linecache
import os
import resource
import select
import signal
import socket
import sys
import time
import traceback

__all__ = ["NETWORK_EVENTS", "descendants", "kill_tree", "main", "signal_all"]

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
_PR_SET_CHILD_SUBREAPER = 36
_GRACE_S = 5.0  # how long past its timeout the zygote waits for the probe call
_SYS_PATH = [p for p in sys.path if p]  # the interpreter's own (started with -I: no script folder)
_SOCKETS: list[socket.socket] = []  # every socket of this process: detached (not closed) in forked children
_ARMED: list[bool] = []  # non-empty once the code runs (the audit hook of isolation="none" then refuses sockets)


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


def kill_tree(root: int, include_root: bool = True) -> None:
    """Stop ``root``'s descendants (collected from /proc until no new ones appear), then kill them all.

    Args:
        root: The pid at the top; with ``include_root`` it is stopped first and killed with its process group.
        include_root: Whether to kill ``root`` too or only what is below it.
    """
    seen = [root] if include_root else []
    signal_all(seen, signal.SIGSTOP)
    for _ in range(10):
        new = [p for p in descendants(root) if p not in seen]
        if not new:
            break
        signal_all(new, signal.SIGSTOP)
        seen.extend(new)
    signal_all([-root] if include_root else [], signal.SIGKILL)
    signal_all(seen, signal.SIGKILL)


def _isolation():
    """The :mod:`sandbox_isolation` module, loaded by path (this process never imports the ``chatenv`` package)."""
    if "sandbox_isolation" not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_isolation.py")
        spec = importlib.util.spec_from_file_location("sandbox_isolation", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["sandbox_isolation"] = module
        spec.loader.exec_module(module)
    return sys.modules["sandbox_isolation"]


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def _receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and the descriptors that came with it; ``(None, [])`` when the other side is gone."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
    except OSError:
        return None, []
    return (json.loads(data) if data else None), fds


def _pair() -> tuple[socket.socket, socket.socket]:
    pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    _SOCKETS.extend(pair)
    return pair


def _only_fds(keep: dict[int, int]) -> None:
    """Make the descriptors ``keep`` maps to (target -> source, targets < 100) the only open ones.

    The sockets of this process are detached first, so that their objects never close a reused number.
    """
    for sock in _SOCKETS:
        sock.detach()
    _SOCKETS.clear()
    moved = {source: fcntl.fcntl(source, fcntl.F_DUPFD, 100) for source in set(keep.values())}  # above the targets
    for target, source in keep.items():
        os.dup2(moved[source], target)
    highest = max(keep, default=-1)
    os.closerange(highest + 1, 1 << 20)
    for fd in range(highest):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


class _Helper:
    """The zygote's side of one helper: its pid and socket (handed to the parent once the helper is ready)."""

    def __init__(self, config: dict):
        mine, theirs = _pair()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _helper(config, theirs)
            finally:
                os._exit(0)
        theirs.close()
        _SOCKETS.remove(theirs)
        self.sock = mine

    def wait_ready(self, deadline: float) -> str | None:
        """Answer set-up messages until the helper is ready; why it failed, or None."""
        while True:
            if not select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return "the sandbox helper did not get ready in time"
            message, _ = _receive(self.sock)
            if message is None:
                return f"the sandbox helper {self.pid} stopped while setting up"
            if "map" in message:  # a root trainer: the helper's root maps to root (to build the root), and nobody
                nobody = _isolation().NOBODY
                ids = f"0 0 1\n{nobody} {nobody} 1\n"
                _isolation().write_id_maps(self.pid, ids, ids, deny_setgroups=False)
                _send(self.sock, {"mapped": True})
            elif "ready" in message:
                return None
            else:
                return str(message.get("fatal", message))

    def close(self) -> None:
        """Close the zygote's end of the socket (the helper is then the parent's, or dies when it reads EOF)."""
        if self.sock in _SOCKETS:
            _SOCKETS.remove(self.sock)
        self.sock.close()


def _helper(config: dict, sock: socket.socket) -> None:
    """A helper process: isolate, start the code's process and wait; then run one call and report how it ended."""
    iso = _isolation()
    iso.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != config["zygote"]:
        return
    _only_fds({2: 2, 3: sock.fileno()})
    sock = socket.socket(fileno=3)
    _SOCKETS.append(sock)
    isolated = config["isolation"] == "namespaces"
    try:
        if isolated:
            _isolate(config, sock)
        else:
            ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        pid, mine, held = _start_runner(config)
    except OSError as e:
        _send(sock, {"fatal": f"the sandbox could not isolate the code: {e}"})
        return
    _send(sock, {"ready": True})
    message, fds = _receive(sock)
    if message is None or len(fds) != 4:
        return
    call = message["call"]
    if isolated:  # shown at /workdir in the code's mount namespace (the mount point is shared with it)
        iso.bind(call["workdir"], config["mount_dir"] + iso.WORKDIR, readonly=False)
    _send(mine, {"call": call}, fds)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    timed_out = not select.select([pidfd], [], [], call["timeout"])[0]
    if timed_out:
        signal_all([pid], signal.SIGKILL)  # the init of its PID namespace: everything in it dies too
    _, status = os.waitpid(pid, 0)
    if not isolated:
        kill_tree(os.getpid(), include_root=False)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    _send(sock, {"done": {"pid": pid, "status": os.waitstatus_to_exitcode(status), "timed_out": timed_out}})


def _start_runner(config: dict) -> tuple[int, socket.socket, list[int]]:
    """Fork the code's process and wait until it is ready: its pid, the socket to it, its mount namespace's fd."""
    mine, theirs = _pair()
    pid = os.fork()
    if pid == 0:
        _runner(config, theirs)
    _SOCKETS.remove(theirs)
    theirs.close()
    if not select.select([mine], [], [], config["start_timeout"])[0]:
        raise OSError("the code's process did not get ready in time")
    ready, held = _receive(mine)  # held: the code's mount namespace, so that this helper's exit (after it has
    if ready != {"ready": True}:  # reported) tears it down, not the code's exit (which the report waits for)
        raise OSError((ready or {}).get("fatal", "the code's process stopped while setting up"))
    return pid, mine, held


def _isolate(config: dict, sock: socket.socket) -> None:
    """Enter new namespaces, map this process's ids, build the code's root and a shared mount point for /workdir."""
    iso = _isolation()
    iso.unshare(iso.namespace_flags(config["allow_network"]))
    if config["code_uid"] != config["outer_uid"]:
        _send(sock, {"map": os.getpid()})
        if _receive(sock)[0] != {"mapped": True}:
            raise OSError("the zygote did not map this helper's user ids")
    else:
        maps = (f"0 {config['outer_uid']} 1", f"0 {config['outer_gid']} 1")
        iso.write_id_maps("self", *maps, deny_setgroups=True)
    iso.build_root(config["mount_dir"], config["paths"], config["file_mb"])
    iso.shared_mount_point(config["mount_dir"] + iso.WORKDIR)
    if not config["allow_network"]:
        iso.loopback_up()
    socket.sethostname("sandbox")


def _runner(config: dict, sock: socket.socket) -> None:
    """The code's process: isolate and limit itself, wait for the call, run the code, write the result.

    Never returns. Set-up failures go to the helper; later ones to the result memfd.
    """
    try:
        iso = _isolation()
        iso.set_parent_death_signal(signal.SIGKILL)
        _only_fds({2: 2, 3: sock.fileno()})
        sock = socket.socket(fileno=3)
        _SOCKETS.append(sock)
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
                iso.install_seccomp()
            elif not config["allow_network"]:
                sys.addaudithook(_refuse_network)
        except OSError as e:
            _send(sock, {"fatal": str(e)})
            os._exit(70)
        try:
            _warm_up(config, isolated)
        except Exception as e:
            _send(sock, {"fatal": f"the code's process failed to warm up: {type(e).__name__}: {e}"})
            os._exit(70)
        _send(sock, {"ready": True}, namespace)
        for fd in namespace:
            os.close(fd)
        message, fds = _receive(sock)
        if message is None or len(fds) != 4:
            os._exit(0)
    except BaseException:
        os._exit(70)
    _call(config, message["call"], fds, isolated)


def _warm_up(config: dict, isolated: bool) -> None:
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
    _environment(config, _isolation().WORKDIR if isolated else "/", isolated)
    json.loads(json.dumps({"code": "x = 1"}))
    _execute("x = 1", config["max_output_chars"])


def _environment(config: dict, workdir: str, isolated: bool) -> None:
    os.environ.clear()
    os.environ.update({**config["env"], "HOME": workdir, "TMPDIR": "/tmp" if isolated else workdir})
    sys.path[:] = [workdir, *_SYS_PATH]
    sys.path_importer_cache.clear()


def _call(config: dict, call: dict, fds: list[int], isolated: bool) -> None:
    """Run one call in the code's process (descriptors: the request, stdout, stderr, the result); never returns."""
    try:
        request = json.loads(_read_all(fds[0]))
        _only_fds({0: os.open(os.devnull, os.O_RDONLY), 1: fds[1], 2: fds[2], 3: fds[3]})
    except BaseException:
        os._exit(70)
    try:
        used = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        cpu = int(used + call["timeout"]) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (cpu if hard == resource.RLIM_INFINITY else min(cpu, hard), hard))
        workdir = _isolation().WORKDIR if isolated else call["workdir"]
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


def _refuse_network(event: str, args: tuple) -> None:
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


def _limits(config: dict, count_processes: bool) -> str | None:
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
        limits[resource.RLIMIT_NPROC] = config["max_processes"]
    for which, value in limits.items():
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return None


def _read_all(fd: int) -> bytes:
    """Everything in a memfd, from its start (its offset is shared with the other processes that hold it)."""
    parts, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _write(fd: int, message: dict) -> None:
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
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    ctypes.CDLL(None).fflush(None)
    return error


def _serve(config: dict, sock: socket.socket) -> None:
    """The zygote's loop: prepare a standby helper, hand it to the parent, wait until the parent takes it."""
    while True:
        helper = _Helper(config)
        fatal = helper.wait_ready(time.monotonic() + config["start_timeout"])
        try:
            if fatal:
                signal_all([helper.pid], signal.SIGKILL)
                _send(sock, {"fatal": fatal})
            else:
                _send(sock, {"standby": helper.pid}, [helper.sock.fileno()])
        except OSError:
            return
        finally:
            helper.close()
        message, _ = _receive(sock)
        _reap()
        if message is None:
            return


def _reap() -> None:
    """Reap the helpers that have exited."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def main(argv: list[str] | None = None) -> None:
    """Serve the parent until it closes the socket.

    Args:
        argv: ``[CONFIG_JSON]`` (default ``sys.argv[1:]``): ``sock_fd``, ``isolation`` (``"namespaces"`` or
            ``"none"``), ``outer_uid``/``outer_gid`` (the trainer's), ``code_uid`` (the uid the code runs as:
            ``nobody`` when the trainer is root, else the trainer's), ``mount_dir`` (an empty directory for the new
            root), ``probe_dir``, ``paths`` (shown read-only), ``env`` (the code's environment), ``memory_mb``,
            ``file_mb``, ``max_open_files``, ``max_processes``, ``allow_network``, ``max_output_chars``,
            ``start_timeout``.
    """
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    config["zygote"] = os.getpid()
    sock = socket.socket(fileno=config["sock_fd"])
    _SOCKETS.append(sock)
    _isolation().set_parent_death_signal(signal.SIGKILL)
    gc.freeze()  # forked processes then never scan (and so copy) the zygote's objects
    signal.signal(signal.SIGCHLD, lambda signum, frame: _reap())  # helpers are reaped as soon as they exit
    fatal = _probe(config)
    _send(sock, {"fatal": fatal} if fatal else {"ready": os.getpid()})
    if not fatal:
        _serve(config, sock)


def _probe(config: dict) -> str | None:
    """Run one trivial call through the whole chain; why it failed, or None."""
    helper = _Helper(config)
    fds = [os.memfd_create(name) for name in ("request", "stdout", "stderr", "result")]
    try:
        os.write(fds[0], json.dumps({"code": "pass"}).encode())
        fatal = helper.wait_ready(time.monotonic() + config["start_timeout"])
        if fatal:
            return fatal
        _send(helper.sock, {"call": {"workdir": config["probe_dir"], "timeout": config["start_timeout"]}}, fds)
        if not select.select([helper.sock], [], [], config["start_timeout"] + _GRACE_S)[0]:
            return "the first call did not finish in time"
        outcome = _receive(helper.sock)[0] or {}
        result = _read_all(fds[3])
        if outcome.get("done", {}).get("status") != 0:
            stderr = _read_all(fds[2]).decode(errors="replace")[-4000:]
            reason = json.loads(result).get("fatal") if result else None
            return reason or f"the first call ended with {outcome}" + (f"\n{stderr}" if stderr else "")
        return None
    except OSError as e:
        return str(e)
    finally:
        signal_all([helper.pid], signal.SIGKILL)
        helper.close()
        _reap()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    main()
