"""The CPU cores this process may use, and torch thread counts kept within them.

A process may be held to fewer cores than the machine has: by its CPU affinity (``taskset``, the cpuset of a
container or of a job scheduler) and by a cgroup CPU quota (``docker --cpus``, a Kubernetes CPU limit: ``cpu.max``
in cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1). More torch threads than that oversubscribes the
cores: every parallel region waits for threads the kernel cannot run at the same time, and a step can take many
times longer. Every place chatenv, its wrappers and its benchmarks set torch threads goes through
:func:`torch_threads` (or :func:`set_torch_threads`), which never goes above :func:`usable_cpus`.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

__all__ = ["cgroup_cpu_limit", "set_torch_threads", "torch_threads", "usable_cpus"]


def _cgroup_dirs(root: Path, proc_cgroup: Path) -> list[tuple[Path, bool]]:
    """The folders of this process's cgroups (v2 and v1 ``cpu``) and of their parents, each with whether it is v2."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    out: list[tuple[Path, bool]] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # the v2 hierarchy: mounted at the root, or at root/unified on hybrid systems
            mounts, v2 = [root, root / "unified"], True
        elif "cpu" in controllers.split(","):
            mounts, v2 = [root / controllers, root / "cpu"], False
        else:
            continue
        for mount in mounts:
            here = mount / path.strip("/")
            while True:  # the cgroup, then each parent up to the mount (a parent's quota holds its children too)
                out.append((here, v2))
                if here == mount or mount not in here.parents:
                    break
                here = here.parent
    return out


def _quota(folder: Path, v2: bool) -> float | None:
    """The CPU quota set in one cgroup folder, in cores, or None."""
    try:
        if v2:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        else:
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
    except (OSError, ValueError):
        return None
    if quota in ("max", "-1") or not quota.lstrip("-").isdigit() or not period.isdigit() or int(period) <= 0:
        return None
    return int(quota) / int(period) if int(quota) > 0 else None


def cgroup_cpu_limit(
    root: str | Path = "/sys/fs/cgroup", proc_cgroup: str | Path = "/proc/self/cgroup"
) -> float | None:
    """The CPU quota of this process's cgroup and of its parents, in cores (the smallest), or None where none is set.

    Args:
        root: Where the cgroup file systems are mounted.
        proc_cgroup: The file naming this process's cgroups.

    Example:
        >>> limit = cgroup_cpu_limit()
        >>> limit is None or limit > 0
        True
    """
    quotas = [q for folder, v2 in _cgroup_dirs(Path(root), Path(proc_cgroup)) if (q := _quota(folder, v2))]
    return min(quotas) if quotas else None


def _affinity() -> int:
    """The cores of this process's CPU affinity."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def usable_cpus() -> int:
    """The cores this process may use: those of its CPU affinity, fewer under a cgroup quota (rounded down, >= 1)."""
    quota = cgroup_cpu_limit()
    return max(1, min(_affinity(), math.floor(quota))) if quota is not None else max(1, _affinity())


def _why() -> str:
    """Where the limit of :func:`usable_cpus` comes from, in words."""
    quota = cgroup_cpu_limit()
    return f"CPU affinity: {_cores(_affinity())}" + (f", cgroup CPU quota: {quota:g} cores" if quota else "")


def _cores(n: int) -> str:
    return f"{n} core" if n == 1 else f"{n} cores"


def torch_threads(requested: int | None = None, *, name: str = "threads") -> tuple[int, str | None]:
    """The torch CPU threads to use: ``requested`` (default: torch's current count), at most :func:`usable_cpus`.

    Args:
        requested: The threads asked for (a flag's value), or None for torch's own choice.
        name: The name ``requested`` has for the user (``"--threads"``), for the note.

    Returns:
        The threads, and a sentence saying why they are fewer than asked (None when they are not).

    Raises:
        ValueError: For a ``requested`` count below 1.
    """
    import torch

    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise ValueError(f"{name} must be an int >= 1 or None, got {requested!r}")
    limit = usable_cpus()
    wanted = requested if requested is not None else torch.get_num_threads()
    if wanted <= limit:
        return wanted, None
    asked = f"{name} {wanted}" if requested is not None else f"torch's default of {wanted} threads"
    return limit, (
        f"{asked} is more than the {_cores(limit)} this process may use ({_why()}); using {limit} "
        f"thread{'s' if limit != 1 else ''}: more threads than cores make every step wait for threads that cannot run"
    )


def set_torch_threads(requested: int | None = None, *, name: str = "threads") -> int:
    """Set torch's CPU threads to :func:`torch_threads` of ``requested``, warning when they are lowered.

    Returns:
        The threads set.
    """
    import torch

    threads, lowered = torch_threads(requested, name=name)
    if lowered:
        warnings.warn(lowered, RuntimeWarning, stacklevel=2)
    torch.set_num_threads(threads)
    return threads
