"""The zygote and the helpers of :mod:`chatenv.tools.sandbox`: the processes around each call's code process.

The trainer starts this file by path (``python -I worker.py CONFIG_JSON``) with an empty environment, so the zygote
never imports ``chatenv`` (nor torch) and holds nothing of the trainer's; :func:`main` is the entry point.

- **Zygote** (:func:`main`): checks the whole chain with one trivial call, then forks a *standby* helper, hands the
  helper's socket to the trainer once it is ready, and waits until the trainer takes it before preparing the next.
  It never sees code or output.
- **Helper**: with ``isolation="namespaces"`` it enters new user, mount, PID, network (unless allowed), IPC, UTS and
  cgroup namespaces (a root trainer has the zygote write its id maps), builds the code's root file system
  (:mod:`isolation`) on the call's disk with a shared mount point at ``/workdir``, forks the code's process
  (:mod:`runner`; the zygote moves it into the call's cgroups, :mod:`cgroups`) and waits until it is ready. At the
  call (four memfds from the trainer: the request, stdout, stderr, the result) it runs it (:mod:`calls`: the
  episode's folder copied in, the timeout and the memory watchdog, the folder copied back) and reports
  ``{"done": {...}}`` (see :func:`calls.run_call`). The kernel then removes the namespaces with everything in them;
  the zygote removes the call's cgroups once it has reaped the helper.

Messages are JSON on ``SOCK_SEQPACKET`` sockets. Zygote -> trainer: ``{"ready": pid}`` or ``{"fatal": reason}``,
then ``{"standby": pid}`` with the helper's socket (or ``{"fatal": reason}``) each time; trainer -> zygote:
``{"next": true}`` once it has taken a standby. Trainer -> helper: ``{"call": {"workdir", "timeout"}}`` + 4 fds.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import itertools
import json
import os
import select
import signal
import socket
import sys
import time

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: the zygote imports the bare minimum of the standard library
if TYPE_CHECKING or __package__:
    from chatenv.tools.sandbox import procs
else:  # run by path in the zygote (python -I worker.py): its siblings are loaded by path too
    _spec = importlib.util.spec_from_file_location(
        "_chatenv_sandbox_procs", os.path.join(os.path.dirname(__file__), "procs.py")
    )
    procs = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = procs
    _spec.loader.exec_module(procs)

if TYPE_CHECKING:
    from chatenv.tools.sandbox import calls, cgroups, runner
    from chatenv.tools.sandbox import isolation as iso
    from chatenv.tools.sandbox.procs import Message
else:
    iso, runner = procs.load("isolation"), procs.load("runner")
    calls, cgroups = procs.load("calls"), procs.load("cgroups")

__all__ = ["main"]

_PR_SET_CHILD_SUBREAPER = 36

_GRACE_S = 5.0  # how long past its timeout the zygote waits for the probe call

_CALLS = itertools.count()  # numbers the helpers this zygote starts
_KEYS: dict[int, str] = {}  # the cgroup name of each helper still running, by pid


class _Helper:
    """The zygote's side of one helper: its pid and socket (handed to the parent once the helper is ready)."""

    def __init__(self, config: Message):
        self.config = config
        self.key = f"{os.getpid()}-{next(_CALLS)}-{os.urandom(4).hex()}"  # its cgroup's name: never one made before
        mine, theirs = procs.pair()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _helper({**config, "call_key": self.key}, theirs)
            finally:
                os._exit(0)
        _KEYS[self.pid] = self.key
        theirs.close()
        procs.SOCKETS.remove(theirs)
        self.sock = mine

    def wait_ready(self, deadline: float) -> str | None:
        """Answer set-up messages until the helper is ready; why it failed, or None."""
        while True:
            if not select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return "the sandbox helper did not get ready in time"
            message, _ = procs.receive(self.sock)
            if message is None:
                return f"the sandbox helper {self.pid} stopped while setting up"
            if "map" in message:  # a root trainer: the helper's root maps to root (to build the root), and nobody
                nobody = iso.NOBODY
                ids = f"0 0 1\n{nobody} {nobody} 1\n"
                iso.write_id_maps(self.pid, ids, ids, deny_setgroups=False)
                procs.send(self.sock, {"mapped": True})
            elif "code" in message:  # the code's process, forked and warming up
                fatal = self._limit(int(message["code"]))
                if fatal:
                    return fatal
            elif "ready" in message:
                return None
            else:
                return str(message.get("fatal", message))

    def _limit(self, code_pid: int) -> str | None:
        """Move the helper's code process into cgroups of its own (if the sandbox has them); why it failed, or None."""
        config = self.config
        if not config["cgroups"]:
            return None
        try:
            cgroups.make_call(config["cgroups"], self.key, config["memory_mb"], config["max_processes"], code_pid)
        except OSError as e:
            return f"the sandbox could not make the call's cgroup: {e}"
        return None

    def close(self) -> None:
        """Close the zygote's end of the socket (the helper is then the parent's, or dies when it reads EOF)."""
        if self.sock in procs.SOCKETS:
            procs.SOCKETS.remove(self.sock)
        self.sock.close()


def _helper(config: Message, sock: socket.socket) -> None:
    """A helper process: isolate, start the code's process and wait; then run one call and report how it ended."""
    iso.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != config["zygote"]:
        return
    procs.only_fds({2: 2, 3: sock.fileno()})
    sock = socket.socket(fileno=3)
    procs.SOCKETS.append(sock)
    isolated = config["isolation"] == "namespaces"
    try:
        if isolated:
            _isolate(config, sock)
        else:
            ctypes.CDLL(None).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        pid, mine, held = _start_runner(config, sock)
    except OSError as e:
        procs.send(sock, {"fatal": f"the sandbox could not isolate the code: {e}"})
        return
    procs.send(sock, {"ready": True})
    message, fds = procs.receive(sock)
    if message is None or len(fds) != 4:
        return
    procs.send(sock, {"done": calls.run_call(config, message["call"], pid, mine, fds)})


def _start_runner(config: Message, zygote: socket.socket) -> tuple[int, socket.socket, list[int]]:
    """Fork the code's process and wait until it is ready: its pid, the socket to it, its mount namespace's fd.

    The zygote is told the new process's pid at once, to move it into the call's cgroups while it warms up.
    """
    mine, theirs = procs.pair()
    pid = os.fork()
    if pid == 0:
        runner.code_process(config, theirs)
    procs.SOCKETS.remove(theirs)
    theirs.close()
    procs.send(zygote, {"code": pid})
    if not select.select([mine], [], [], config["start_timeout"])[0]:
        raise OSError("the code's process did not get ready in time")
    ready, held = procs.receive(mine)  # held: the code's mount namespace, so that this helper's exit (after it has
    if ready != {"ready": True}:  # reported) tears it down, not the code's exit (which the report waits for)
        raise OSError((ready or {}).get("fatal", "the code's process stopped while setting up"))
    return pid, mine, held


def _isolate(config: Message, sock: socket.socket) -> None:
    """Enter new namespaces, map this process's ids, build the code's root and a shared mount point for /workdir."""
    iso.unshare(iso.namespace_flags(config["allow_network"]))
    if config["code_uid"] != config["outer_uid"]:
        procs.send(sock, {"map": os.getpid()})
        if procs.receive(sock)[0] != {"mapped": True}:
            raise OSError("the zygote did not map this helper's user ids")
    else:
        maps = (f"0 {config['outer_uid']} 1", f"0 {config['outer_gid']} 1")
        iso.write_id_maps("self", *maps, deny_setgroups=True)
    iso.build_root(config["mount_dir"], config["paths"], config["disk_dir"], config["disk_mb"])
    iso.shared_mount_point(config["mount_dir"] + iso.WORKDIR)
    if not config["allow_network"]:
        iso.loopback_up()
    socket.sethostname("sandbox")


def _serve(config: Message, sock: socket.socket) -> None:
    """The zygote's loop: prepare a standby helper, hand it to the parent, wait until the parent takes it."""
    while True:
        helper = _Helper(config)
        fatal = helper.wait_ready(time.monotonic() + config["start_timeout"])
        try:
            if fatal:
                procs.signal_all([helper.pid], signal.SIGKILL)
                procs.send(sock, {"fatal": fatal})
            else:
                procs.send(sock, {"standby": helper.pid}, [helper.sock.fileno()])
        except OSError:
            return
        finally:
            helper.close()
        message, _ = procs.receive(sock)
        _reap(config)
        if message is None:
            return


_EXITED: set[str] = set()  # the cgroups of helpers that exited, still to be removed


def _reap(config: Message) -> None:
    """Reap the helpers that have exited and remove their cgroups (later, while their code is still exiting)."""
    while True:
        try:
            pid = os.waitpid(-1, os.WNOHANG)[0]
        except ChildProcessError:
            break
        if pid == 0:
            break
        key = _KEYS.pop(pid, None)
        if config["cgroups"] and key:
            _EXITED.add(key)
    for key in list(_EXITED):
        try:
            if cgroups.remove(config["cgroups"], key):
                _EXITED.discard(key)
        except OSError:
            _EXITED.discard(key)


def main(argv: list[str] | None = None) -> None:
    """Serve the parent until it closes the socket.

    Args:
        argv: ``[CONFIG_JSON]`` (default ``sys.argv[1:]``): ``sock_fd``, ``isolation`` (``"namespaces"`` or
            ``"none"``), ``outer_uid``/``outer_gid`` (the trainer's), ``code_uid`` (the uid the code runs as:
            ``nobody`` when the trainer is root, else the trainer's), ``mount_dir`` (an empty directory for the new
            root), ``disk_dir`` (an empty directory for the call's disk), ``probe_dir``, ``paths`` (shown
            read-only), ``env`` (the code's environment), ``memory_mb``, ``file_mb``, ``disk_mb``,
            ``max_open_files``, ``max_processes``, ``allow_network``, ``max_output_chars``, ``start_timeout``,
            ``cgroups`` (``{controller: [version, folder]}``, see :func:`cgroups.detect`) and ``limits`` (how each
            bound is enforced).
    """
    config = json.loads((argv if argv is not None else sys.argv[1:])[0])
    config["zygote"] = os.getpid()
    sock = socket.socket(fileno=config["sock_fd"])
    procs.SOCKETS.append(sock)
    iso.set_parent_death_signal(signal.SIGKILL)
    gc.freeze()  # forked processes then never scan (and so copy) the zygote's objects
    signal.signal(signal.SIGCHLD, lambda signum, frame: _reap(config))  # helpers are reaped as soon as they exit
    fatal = _probe(config)
    procs.send(sock, {"fatal": fatal} if fatal else {"ready": os.getpid()})
    if not fatal:
        _serve(config, sock)


def _probe(config: Message) -> str | None:
    """Run one trivial call through the whole chain; why it failed, or None."""
    helper = _Helper(config)
    fds = [os.memfd_create(name) for name in ("request", "stdout", "stderr", "result")]
    try:
        os.write(fds[0], json.dumps({"code": "pass"}).encode())
        fatal = helper.wait_ready(time.monotonic() + config["start_timeout"])
        if fatal:
            return fatal
        procs.send(helper.sock, {"call": {"workdir": config["probe_dir"], "timeout": config["start_timeout"]}}, fds)
        if not select.select([helper.sock], [], [], config["start_timeout"] + _GRACE_S)[0]:
            return "the first call did not finish in time"
        outcome = procs.receive(helper.sock)[0] or {}
        result = runner.read_all(fds[3])
        if outcome.get("done", {}).get("status") != 0:
            stderr = runner.read_all(fds[2]).decode(errors="replace")[-4000:]
            reason = json.loads(result).get("fatal") if result else None
            return reason or f"the first call ended with {outcome}" + (f"\n{stderr}" if stderr else "")
        return None
    except OSError as e:
        return str(e)
    finally:
        procs.signal_all([helper.pid], signal.SIGKILL)
        helper.close()
        _reap(config)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    main()
