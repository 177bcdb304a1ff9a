"""Per-call cgroups of :mod:`chatenv.tools.sandbox`: memory and process bounds for everything a call starts.

The trainer looks for a place to make cgroups at start (:func:`detect`): a cgroup v2 hierarchy whose ``memory`` and
``pids`` controllers it may delegate to a folder of its own, else the cgroup v1 ``memory`` and ``pids``
hierarchies, under this process's own cgroup. The zygote then makes one cgroup per call (:func:`make_call`), moves
the call's code process into it before any code runs (the code's children inherit it and the code cannot leave:
it sees no cgroup file system and holds no capability), reads what the kernel counted when the call ends
(:func:`call_stats`) and removes it (:func:`remove`).

Standard library only (loaded by path in the zygote, see :mod:`procs`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import time

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: the zygote imports the bare minimum of the standard library
if TYPE_CHECKING:
    from chatenv.tools.sandbox.procs import Message

__all__ = ["CONTROLLERS", "call_dirs", "call_stats", "detect", "make_call", "plan", "remove", "remove_base"]

CONTROLLERS = ("memory", "pids")

_MIB = 1024 * 1024


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _mounts() -> list[tuple[int, str, str, set[str]]]:
    """Each cgroup file system mounted here: its version, mount point, the cgroup it shows, its controllers."""
    found: list[tuple[int, str, str, set[str]]] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, kind = left.split(), right.split()
            if len(fields) < 5 or len(kind) < 3:
                continue
            if kind[0] == "cgroup2":
                found.append((2, fields[4], fields[3], set()))
            elif kind[0] == "cgroup":
                found.append((1, fields[4], fields[3], set(kind[2].split(",")) & set(CONTROLLERS)))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup by controller (``""``: the cgroup v2 one)."""
    own = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                own[name] = path
    return own


def _folder(mount: str, shown: str, path: str) -> str | None:
    """The folder of cgroup ``path`` under a mount that shows cgroup ``shown`` (None if it is not below it)."""
    shown = shown.rstrip("/")
    if path != shown and not path.startswith(shown + "/"):
        return None
    return os.path.normpath(mount + "/" + path[len(shown) :])


def _try_v2(mount: str, shown: str, own: dict[str, str], name: str, wanted: list[str], why: list[str]) -> str | None:
    """A new folder for the sandbox under this process's cgroup v2 with ``wanted`` controllers, or None (``why``)."""
    folder = _folder(mount, shown, own.get("", "/"))
    if folder is None:
        why.append(f"cgroup v2: this process's cgroup is not below the hierarchy mounted at {mount}")
        return None
    try:
        missing = set(wanted) - set(_read(f"{folder}/cgroup.controllers").split())
        if missing:
            why.append(f"cgroup v2: {folder} does not offer the {' and '.join(sorted(missing))} controllers")
            return None
        enabled = set(_read(f"{folder}/cgroup.subtree_control").split())
        if not set(wanted) <= enabled:  # allowed only where this cgroup holds no process itself (a delegation)
            _write(f"{folder}/cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
        base = f"{folder}/{name}"
        os.mkdir(base, 0o755)
    except OSError as e:
        why.append(_v2_reason(folder, e))
        return None
    try:
        _write(f"{base}/cgroup.subtree_control", " ".join(f"+{c}" for c in wanted))
        return base
    except OSError as e:
        with contextlib.suppress(OSError):
            os.rmdir(base)
        why.append(_v2_reason(base, e))
        return None


def _v2_reason(folder: str, error: OSError) -> str:
    """Why a cgroup v2 ``folder`` could not give the sandbox its controllers."""
    if error.errno == errno.EBUSY:
        return (
            f"cgroup v2: {folder} holds processes (this one among them) and is not the root cgroup, so the kernel "
            "refuses to enable the memory and pids controllers for cgroups below it (EBUSY)"
        )
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cgroup v2: this user may not write {folder} (not delegated to it): {error.strerror}"
    return f"cgroup v2: {folder}: {error}"


def _try_v1(mount: str, shown: str, own: dict[str, str], name: str, controller: str, why: list[str]) -> str | None:
    """A new folder for the sandbox under this process's cgroup in a v1 hierarchy of ``controller``, or None."""
    folder = _folder(mount, shown, own.get(controller, "/"))
    if folder is None:
        return None
    base = f"{folder}/{name}"
    try:
        os.mkdir(base, 0o755)
    except OSError as e:
        why.append(f"cgroup v1 {controller}: {base}: {e.strerror}")
        return None
    if os.path.exists(f"{base}/{'memory.limit_in_bytes' if controller == 'memory' else 'pids.max'}"):
        return base
    with contextlib.suppress(OSError):
        os.rmdir(base)
    return None


def detect(name: str, why: list[str] | None = None) -> dict[str, list[object]]:
    """Make a folder ``name`` for the sandbox's cgroups where this process may: ``{controller: [version, folder]}``.

    Controllers for which no cgroup can be made here are left out (e.g. a non-root user whose cgroups are not
    delegated to it); the reasons are added to ``why``. Linux only; an empty dict elsewhere.
    """
    why = [] if why is None else why
    try:
        mounts, own = _mounts(), _own_cgroups()
    except (OSError, ValueError) as e:
        why.append(f"the cgroups of this process cannot be read: {e}")
        return {}
    found: dict[str, list[object]] = {}
    for version, mount, shown, _ in mounts:
        if version == 2 and not found:
            base = _try_v2(mount, shown, own, name, list(CONTROLLERS), why)
            if base:
                found = {c: [2, base] for c in CONTROLLERS}
    for version, mount, shown, controllers in mounts:
        for controller in sorted(controllers - set(found)):
            if version == 1:
                base = _try_v1(mount, shown, own, name, controller, why)
                if base:
                    found[controller] = [1, base]
    return found


def call_dirs(cgroups: Message, key: str) -> dict[str, tuple[int, str]]:
    """The cgroup folders of the call ``key``: ``{controller: (version, folder)}`` (one folder for v2)."""
    return {c: (int(v), f"{base}/{key}") for c, (v, base) in cgroups.items()}


def make_call(cgroups: Message, key: str, memory_mb: int, max_processes: int, pid: int) -> None:
    """Make the call's cgroups with their bounds and move process ``pid`` into them.

    Raises:
        OSError: If a cgroup cannot be made (``FileExistsError`` if one of that name exists: a key is never reused,
            so that no call inherits another's counts) or the process cannot be moved.
    """
    dirs = call_dirs(cgroups, key)
    for folder in {folder for _, folder in dirs.values()}:
        os.mkdir(folder, 0o755)
    for controller, (version, folder) in dirs.items():
        if controller == "memory" and version == 2:
            _write(f"{folder}/memory.max", str(memory_mb * _MIB))
            if os.path.exists(f"{folder}/memory.swap.max"):
                _write(f"{folder}/memory.swap.max", "0")
        elif controller == "memory":
            _write(f"{folder}/memory.limit_in_bytes", str(memory_mb * _MIB))
            if os.path.exists(f"{folder}/memory.memsw.limit_in_bytes"):  # no swap beyond the bound either
                _write(f"{folder}/memory.memsw.limit_in_bytes", str(memory_mb * _MIB))
        else:
            _write(f"{folder}/pids.max", str(max_processes))
    for folder in {folder for _, folder in dirs.values()}:
        _write(f"{folder}/cgroup.procs", str(pid))


def _counts(path: str) -> dict[str, int]:
    """A ``key value`` file (``memory.events``, ``memory.oom_control``, ``pids.events``) as a dict."""
    counts = {}
    with contextlib.suppress(OSError, ValueError):
        for line in _read(path).splitlines():
            key, _, value = line.partition(" ")
            counts[key] = int(value)
    return counts


def call_stats(cgroups: Message, key: str) -> Message:
    """What the kernel counted for the call: ``memory_peak`` (bytes), ``oom_kills``, ``pids_refused``."""
    stats: Message = {}
    for controller, (version, folder) in call_dirs(cgroups, key).items():
        if controller == "memory":
            with contextlib.suppress(OSError, ValueError):
                peak = "memory.peak" if version == 2 else "memory.max_usage_in_bytes"
                stats["memory_peak"] = int(_read(f"{folder}/{peak}"))
            events = _counts(f"{folder}/memory.events" if version == 2 else f"{folder}/memory.oom_control")
            stats["oom_kills"] = events.get("oom_kill", 0)
        else:
            stats["pids_refused"] = _counts(f"{folder}/pids.events").get("max", 0)
    return stats


def remove(cgroups: Message, key: str) -> bool:
    """Remove the call's cgroups; False while a process of the call is still exiting (try again later)."""
    done = True
    for folder in {folder for _, folder in call_dirs(cgroups, key).values()}:
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            done = False
    return done


def remove_base(cgroups: Message, wait: float = 5.0) -> None:
    """Remove the sandbox's cgroup folders and every call's left in them (waiting up to ``wait`` s for exits)."""
    deadline = time.monotonic() + wait
    for base in {str(base) for _, base in cgroups.values()}:
        while True:
            try:
                for entry in os.scandir(base):
                    if entry.is_dir(follow_symlinks=False):
                        with contextlib.suppress(OSError):
                            os.rmdir(entry.path)
                os.rmdir(base)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.02)


def plan(call_limits: str, isolation: str, name: str, why: list[str] | None = None) -> tuple[Message, dict[str, str]]:
    """The sandbox's cgroups (made here, named ``name``) and how each bound is enforced.

    Args:
        call_limits: ``"auto"``, ``"cgroup"`` (cgroups for both controllers or none), ``"watchdog"`` or
            ``"process"`` (see :class:`~chatenv.tools.sandbox.PythonSandbox`).
        isolation: ``"namespaces"`` or ``"none"``.
        name: The name of the sandbox's cgroup folders.
        why: Where to add why cgroups could not be made (if they could not).

    Returns:
        ``{controller: [version, folder]}`` and the ``limits`` report of
        :attr:`~chatenv.tools.sandbox.PythonSandbox.limits`.
    """
    groups: Message = detect(name, why) if call_limits in ("auto", "cgroup") else {}
    if call_limits == "cgroup" and set(groups) != set(CONTROLLERS):
        remove_base(groups)
        groups = {}
    kind = {c: f"cgroup{groups[c][0]}" for c in groups}
    namespaces = isolation == "namespaces"
    limits = {
        "memory": kind.get("memory") or ("process" if call_limits == "process" else "watchdog"),
        "processes": kind.get("pids") or ("rlimit" if namespaces else "none"),
        "disk": "tmpfs" if namespaces else "file size only",
        "cpu": "rlimit",
    }
    return groups, limits
