"""A sandboxed Python tool: model-written code runs in a fresh, kernel-isolated process per call.

:class:`PythonSandbox` keeps ``workers`` warm *zygote* processes (``python -I sandbox_worker.py``, started with an
empty environment; they never import ``chatenv`` or torch, never see code or output). For each call a zygote hands
the request to a helper it forked and isolated beforehand, which starts the code's process; so a call costs a
couple of milliseconds, not a Python start, and nothing of one call survives into the next.

With ``isolation="namespaces"`` (the default) the kernel enforces the boundary (see
:mod:`chatenv.tools.sandbox.isolation`): new user, PID, mount, network, IPC, UTS and cgroup namespaces per call, no
capabilities (and user ``nobody`` when the trainer is root), a read-only root showing only the interpreter and system
libraries, the episode's files at ``/workdir`` (copied in before the call and back after it: no host folder is
writable), no network unless allowed, ``no_new_privs`` and a seccomp filter. The code cannot see, signal, trace or read
the trainer, other episodes or their files; when the call ends or times out, its PID namespace and every process in it
are killed. Memory and processes are bounded for the whole call (a cgroup per call where this process may make one, else
a memory watchdog and ``RLIMIT_NPROC`` in the call's user namespace; :attr:`PythonSandbox.limits` says which), its files
by a disk quota (``/tmp`` and ``/workdir`` on one tmpfs), CPU time, file size and open files by rlimits whose hard limit
the code cannot raise; ``SandboxResult.exceeded`` names the bound a call ran into. Requests and outputs travel in memfds
and on sockets the code's process never holds. What the kernel does not stop (kernel exploits, side channels, CPU and
memory pressure on the host) needs a VM. Where namespaces are unavailable the sandbox refuses to start unless
``isolation="none"`` is asked for (a warning: then only rlimits and a Python audit hook bind the code). Linux only.

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

from chatenv.tools.sandbox.pool import PythonSandbox
from chatenv.tools.sandbox.results import SandboxError, SandboxResult
from chatenv.tools.sandbox.session import PythonSession, python_tool

__all__ = ["PythonSandbox", "PythonSession", "SandboxError", "SandboxResult", "python_tool"]
