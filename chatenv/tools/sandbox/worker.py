"""The zygote and the helpers of :mod:`chatenv.tools.sandbox`: the processes around each call's code process.

The trainer starts this file by path (``python -I worker.py CONFIG_JSON``) with an empty environment, so the zygote
never imports ``chatenv`` (nor torch) and holds nothing of the trainer's; :func:`main` is the entry point.

- **Zygote** (:func:`main`): checks the whole chain with one trivial call, then forks a *standby* helper, hands the
  helper's socket to the trainer once it is ready, and waits until the trainer takes it before preparing the next.
  It never sees code or output.
- **Helper**: with ``isolation="namespaces"`` it enters new user, mount, PID, network (unless allowed), IPC, UTS and
  cgroup namespaces (a root trainer has the zygote write its id maps), builds the code's root file system
  (:mod:`isolation`) with a shared mount point at ``/workdir``, forks the code's process (:mod:`runner`) and waits
  until it is ready. At the call (four memfds from the trainer: the request, stdout, stderr, the result) it binds
  the episode's folder onto ``/workdir``, passes the memfds on, waits on a pidfd with the timeout, kills the
  namespace's init if needed and reports ``{"done": {"pid", "status", "timed_out"}}`` (``status``: the exit code,
  negative for a signal). The kernel then removes the namespaces with everything in them.

Messages are JSON on ``SOCK_SEQPACKET`` sockets. Zygote -> trainer: ``{"ready": pid}`` or ``{"fatal": reason}``,
then ``{"standby": pid}`` with the helper's socket (or ``{"fatal": reason}``) each time; trainer -> zygote:
``{"next": true}`` once it has taken a standby. Trainer -> helper: ``{"call": {"workdir", "timeout"}}`` + 4 fds.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
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
    from chatenv.tools.sandbox import isolation as iso
    from chatenv.tools.sandbox import runner
    from chatenv.tools.sandbox.procs import Message
else:
    iso = procs.load("isolation")
    runner = procs.load("runner")

__all__ = ["main"]

_PR_SET_CHILD_SUBREAPER = 36

_GRACE_S = 5.0  # how long past its timeout the zygote waits for the probe call


class _Helper:
    """The zygote's side of one helper: its pid and socket (handed to the parent once the helper is ready)."""

    def __init__(self, config: Message):
        mine, theirs = procs.pair()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                _helper(config, theirs)
            finally:
                os._exit(0)
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
            elif "ready" in message:
                return None
            else:
                return str(message.get("fatal", message))

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
        pid, mine, held = _start_runner(config)
    except OSError as e:
        procs.send(sock, {"fatal": f"the sandbox could not isolate the code: {e}"})
        return
    procs.send(sock, {"ready": True})
    message, fds = procs.receive(sock)
    if message is None or len(fds) != 4:
        return
    call = message["call"]
    if isolated:  # shown at /workdir in the code's mount namespace (the mount point is shared with it)
        iso.bind(call["workdir"], config["mount_dir"] + iso.WORKDIR, readonly=False)
    procs.send(mine, {"call": call}, fds)
    for fd in fds:
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    timed_out = not select.select([pidfd], [], [], call["timeout"])[0]
    if timed_out:
        procs.signal_all([pid], signal.SIGKILL)  # the init of its PID namespace: everything in it dies too
    _, status = os.waitpid(pid, 0)
    if not isolated:
        procs.kill_tree(os.getpid(), include_root=False)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    procs.send(sock, {"done": {"pid": pid, "status": os.waitstatus_to_exitcode(status), "timed_out": timed_out}})


def _start_runner(config: Message) -> tuple[int, socket.socket, list[int]]:
    """Fork the code's process and wait until it is ready: its pid, the socket to it, its mount namespace's fd."""
    mine, theirs = procs.pair()
    pid = os.fork()
    if pid == 0:
        runner.code_process(config, theirs)
    procs.SOCKETS.remove(theirs)
    theirs.close()
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
    iso.build_root(config["mount_dir"], config["paths"], config["file_mb"])
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
    procs.SOCKETS.append(sock)
    iso.set_parent_death_signal(signal.SIGKILL)
    gc.freeze()  # forked processes then never scan (and so copy) the zygote's objects
    signal.signal(signal.SIGCHLD, lambda signum, frame: _reap())  # helpers are reaped as soon as they exit
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
        _reap()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    main()
