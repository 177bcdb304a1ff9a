"""One call as the helper of :mod:`chatenv.tools.sandbox` runs it: files in, wait, count, files out.

With ``isolation="namespaces"`` the episode's folder is copied onto the call's disk (a tmpfs of ``disk_mb``, see
:mod:`quota`) and shown at ``/workdir``; the helper hands the call to the code's process and waits for it with the
timeout (polling the memory of the call's processes where the watchdog bounds it), kills what is left, reads what
the call's cgroups counted, copies the folder back and reports how the call ended.

Standard library only (loaded by path in the zygote, see :mod:`procs`).
"""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import sys
import time

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: the zygote imports the bare minimum of the standard library
if TYPE_CHECKING:
    from chatenv.tools.sandbox import cgroups, procs, quota
    from chatenv.tools.sandbox import isolation as iso
    from chatenv.tools.sandbox.procs import Message
else:
    procs = sys.modules.get("_chatenv_sandbox_procs")
    if procs is None:  # imported from the package (the trainer, the docs)
        from chatenv.tools.sandbox import procs
    iso, quota, cgroups = procs.load("isolation"), procs.load("quota"), procs.load("cgroups")

__all__ = ["WATCH_S", "run_call"]

WATCH_S = 0.01  # how often the memory watchdog sums the call's memory

_MIB = 1024 * 1024


def run_call(config: Message, call: Message, pid: int, mine: socket.socket, fds: list[int]) -> Message:
    """Run one call on the waiting code's process ``pid``; the ``done`` report.

    The report holds ``pid``, ``status`` (exit code, negative for a signal), ``timed_out``, ``exceeded`` (the bound
    the call hit: ``"timeout"``, ``"memory"``, ``"pids"``, ``"disk"``, ``"cpu"``, or None), ``memory_peak``
    (bytes, where counted) and ``why`` (a reason the call was stopped that the status cannot tell, if any).
    """
    isolated = config["isolation"] == "namespaces"
    disk, quota_bytes = config["disk_dir"], int(config["disk_mb"]) * _MIB
    if isolated:
        try:
            quota.same_owner_and_mode(call["workdir"], f"{disk}/work")
            quota.copy_tree(call["workdir"], f"{disk}/work", quota_bytes)
        except Exception as e:  # not only OSError: whatever stops the copy must reach the result, not kill this
            for fd in fds:
                os.close(fd)
            procs.signal_all([pid], signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            full = isinstance(e, OSError) and e.errno == errno.ENOSPC
            why = (
                f"the episode's folder holds more than disk_mb={config['disk_mb']} MiB of files: remove some or "
                "make the sandbox with a larger disk_mb"
                if full
                else f"the sandbox could not copy the episode's folder: {_reason(e)}"
            )
            code = os.waitstatus_to_exitcode(status)
            return {"pid": pid, "status": code, "timed_out": False, "why": why, "exceeded": "disk" if full else None}
        iso.bind(f"{disk}/work", config["mount_dir"] + iso.WORKDIR, readonly=False)  # the mount point is shared
    procs.send(mine, {"call": call}, fds)
    for fd in fds:
        os.close(fd)
    timed_out, watched_peak, over = _wait(config, pid, float(call["timeout"]))
    _, status = os.waitpid(pid, 0)
    if not isolated:
        procs.kill_tree(os.getpid(), include_root=False)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                break
    code = os.waitstatus_to_exitcode(status)
    done: Message = {"pid": pid, "status": code, "timed_out": timed_out}
    stats = cgroups.call_stats(config["cgroups"], config["call_key"]) if config["cgroups"] else {}
    done["memory_peak"] = stats.get("memory_peak", watched_peak)
    if over:
        done["why"] = (
            f"the call's processes used more than memory_mb={config['memory_mb']} MiB together; all were killed"
        )
    kinds = [
        ("timeout", timed_out),
        ("memory", over or stats.get("oom_kills", 0) > 0),
        ("pids", stats.get("pids_refused", 0) > 0),
        ("disk", isolated and _full(disk)),
        ("cpu", code == -signal.SIGXCPU),
    ]
    done["exceeded"] = next((kind for kind, hit in kinds if hit), None)
    if isolated:
        try:
            quota.empty_folder(call["workdir"])
            quota.copy_tree(f"{disk}/work", call["workdir"], quota_bytes)
        except Exception as e:
            if isinstance(e, OSError) and e.errno == errno.ENOSPC:
                done["exceeded"] = done["exceeded"] or "disk"
                done.setdefault("why", f"the call's files need more than disk_mb={config['disk_mb']} MiB; not all kept")
            else:
                done.setdefault("why", f"the call's files could not all be kept: {_reason(e)}")
    return done


def _reason(error: Exception) -> str:
    """An error as a reason: its message, with its type where that is not an OSError's."""
    return str(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"


def _full(disk: str) -> bool:
    """Whether the call's disk is full (of bytes or of files)."""
    info = os.statvfs(disk)
    return info.f_bavail == 0 or info.f_favail == 0


def _wait(config: Message, pid: int, timeout: float) -> tuple[bool, int | None, bool]:
    """Wait for the code's process to end, killing it at the timeout or over the watchdog's bound.

    Returns:
        Whether it timed out, the peak memory the watchdog saw (None without it), whether it went over.
    """
    watch = config["limits"]["memory"] == "watchdog"
    limit = int(config["memory_mb"]) * _MIB
    pidfd = os.pidfd_open(pid)
    deadline = time.monotonic() + timeout
    peak, ended, over = 0, False, False
    try:
        while not ended and not over:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ended = bool(select.select([pidfd], [], [], min(left, WATCH_S) if watch else left)[0])
            if watch and not ended:
                used = quota.tree_memory(os.getpid())
                peak, over = max(peak, used), used > limit
    finally:
        os.close(pidfd)
    if not ended:
        procs.signal_all([pid], signal.SIGKILL)  # the init of its PID namespace: everything in it dies too
    return not ended and not over, peak if watch else None, over
