"""Processes and descriptors for the sandbox's own processes: messages with descriptors, fd hygiene, killing trees.

Standard library only: the zygote loads this file (and its siblings, with :func:`load`) by path, without importing
the ``chatenv`` package; the trainer imports it as ``chatenv.tools.sandbox.procs``.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.util
import json
import os
import signal
import socket
import sys
import types

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: the zygote imports the bare minimum of the standard library
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

    Message = dict[str, Any]  # one JSON object (a message, the config, a result)

__all__ = ["SOCKETS", "descendants", "kill_tree", "load", "only_fds", "pair", "receive", "send", "signal_all"]

SOCKETS: list[socket.socket] = []  # every socket of this process: detached (not closed) in forked children


def load(name: str) -> types.ModuleType:
    """The sibling module ``name`` (``isolation``, ``runner``).

    From the package when this module came from it, else loaded by path as ``_chatenv_sandbox_<name>``.
    """
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    key = f"_chatenv_sandbox_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(os.path.dirname(__file__), f"{name}.py"))
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load the sandbox module {name!r}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def send(sock: socket.socket, message: Message, fds: Sequence[int] = ()) -> None:
    """Send one JSON message with descriptors attached."""
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def receive(sock: socket.socket) -> tuple[Message | None, list[int]]:
    """The next message and the descriptors that came with it; ``(None, [])`` when the other side is gone."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
    except OSError:
        return None, []
    return (json.loads(data) if data else None), fds


def pair() -> tuple[socket.socket, socket.socket]:
    """A connected ``SOCK_SEQPACKET`` pair, registered in :data:`SOCKETS`."""
    pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    SOCKETS.extend(pair)
    return pair


def only_fds(keep: dict[int, int]) -> None:
    """Make the descriptors ``keep`` maps to (target -> source, targets < 100) the only open ones.

    The sockets of this process are detached first, so that their objects never close a reused number.
    """
    for sock in SOCKETS:
        sock.detach()
    SOCKETS.clear()
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
