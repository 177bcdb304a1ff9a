"""Kernel isolation for :mod:`chatenv.tools.sandbox`: namespaces, a minimal read-only root, no capabilities, seccomp.

Used only inside the sandbox's helper processes (``sandbox_worker.py`` loads this file by path, so it imports the
standard library only). Each call's code runs in fresh namespaces made by one helper:

- user namespace: the code is root inside with no capability at all, and outside it is ``nobody`` (65534) when the
  trainer runs as root (the trainer's own uid otherwise);
- PID namespace: the code's process is its init; the trainer and every other process are invisible, and when the
  init exits the kernel kills everything left in the namespace;
- network namespace (unless the network is allowed): a loopback interface and nothing else;
- mount namespace: a new root (a read-only tmpfs) that shows, read-only, only the interpreter, its libraries,
  ``/usr``, ``/lib*`` and a few ``/etc`` files, plus device nodes, and ``/tmp`` and the episode's files at
  :data:`WORKDIR` (writable) on one size-limited tmpfs (the call's disk); the host's root is unmounted;
- IPC, UTS and cgroup namespaces;
- ``no_new_privs`` and a seccomp filter (:func:`seccomp_program`) that refuses ptrace, ``process_vm_*``, mounts,
  namespaces, keyrings, bpf, perf, kernel modules and the like (and, under a memory watchdog, SysV shared memory
  and memfds).

Linux only (x86_64 and aarch64 for seccomp).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import socket
import struct

__all__ = [
    "WORKDIR",
    "bind",
    "build_root",
    "drop_privileges",
    "enter_root",
    "install_seccomp",
    "loopback_up",
    "namespace_flags",
    "seccomp_program",
    "set_parent_death_signal",
    "shared_mount_point",
    "unshare",
    "write_id_maps",
]

WORKDIR = "/workdir"
NOBODY = 65534
DISK_INODES_PER_MB = 256  # files and folders the call's disk may hold, per MiB of its size (at least 1024)

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
_NAMESPACES = CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_SHARED = 1024, 2048, 4096, 16384, 1 << 18, 1 << 20
MS_RELATIME = 1 << 21
MNT_DETACH = 2
# statvfs f_flag bits -> the mount flags a read-only bind must keep (the kernel refuses to drop locked ones)
_KEEP_FLAGS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}

PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# SECBIT_NOROOT, SECBIT_NO_SETUID_FIXUP, SECBIT_KEEP_CAPS_LOCKED, SECBIT_NO_CAP_AMBIENT_RAISE and their locks
_SECUREBITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80

_LIBC = ctypes.CDLL(None, use_errno=True)

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: the zygote imports the bare minimum of the standard library
if TYPE_CHECKING:
    from typing import TypedDict

    class _Arch(TypedDict):
        """One architecture's seccomp facts: its audit value, syscall numbers, the syscalls denied by name."""

        audit: int
        clone: int
        clone3: int
        pivot_root: int
        seccomp: int
        denied: dict[str, int]
        shared_memory: dict[str, int]


# The syscalls code in the sandbox may not make (EPERM), by architecture. Numbers from the kernel's unistd tables.
_ARCHES: dict[str, _Arch] = {
    "x86_64": {
        "audit": 0xC000003E,
        "clone": 56,
        "clone3": 435,
        "pivot_root": 155,
        "seccomp": 317,
        "denied": {
            "ptrace": 101,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "mount": 165,
            "umount2": 166,
            "pivot_root": 155,
            "chroot": 161,
            "swapon": 167,
            "swapoff": 168,
            "reboot": 169,
            "sethostname": 170,
            "setdomainname": 171,
            "iopl": 172,
            "ioperm": 173,
            "init_module": 175,
            "delete_module": 176,
            "finit_module": 313,
            "quotactl": 179,
            "quotactl_fd": 443,
            "acct": 163,
            "kexec_load": 246,
            "kexec_file_load": 320,
            "keyctl": 250,
            "add_key": 248,
            "request_key": 249,
            "bpf": 321,
            "perf_event_open": 298,
            "userfaultfd": 323,
            "unshare": 272,
            "setns": 308,
            "open_by_handle_at": 304,
            "name_to_handle_at": 303,
            "syslog": 103,
            "lookup_dcookie": 212,
            "kcmp": 312,
            "pidfd_getfd": 438,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "open_tree": 428,
            "move_mount": 429,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "mount_setattr": 442,
            "vhangup": 153,
            "settimeofday": 164,
            "clock_settime": 227,
            "clock_adjtime": 305,
            "adjtimex": 159,
            "fanotify_init": 300,
            "uselib": 134,
        },  # fmt: skip
        "shared_memory": {"shmget": 29, "shmat": 30, "memfd_create": 319, "memfd_secret": 447},
    },
    "aarch64": {
        "audit": 0xC00000B7,
        "clone": 220,
        "clone3": 435,
        "pivot_root": 41,
        "seccomp": 277,
        "denied": {
            "ptrace": 117,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "mount": 40,
            "umount2": 39,
            "pivot_root": 41,
            "chroot": 51,
            "swapon": 224,
            "swapoff": 225,
            "reboot": 142,
            "sethostname": 161,
            "setdomainname": 162,
            "init_module": 105,
            "delete_module": 106,
            "finit_module": 273,
            "quotactl": 60,
            "quotactl_fd": 443,
            "acct": 89,
            "kexec_load": 104,
            "kexec_file_load": 294,
            "keyctl": 219,
            "add_key": 217,
            "request_key": 218,
            "bpf": 280,
            "perf_event_open": 241,
            "userfaultfd": 282,
            "unshare": 97,
            "setns": 268,
            "open_by_handle_at": 265,
            "name_to_handle_at": 264,
            "syslog": 116,
            "lookup_dcookie": 18,
            "kcmp": 272,
            "pidfd_getfd": 438,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "open_tree": 428,
            "move_mount": 429,
            "fsopen": 430,
            "fsconfig": 431,
            "fsmount": 432,
            "fspick": 433,
            "mount_setattr": 442,
            "vhangup": 58,
            "settimeofday": 170,
            "clock_settime": 112,
            "clock_adjtime": 266,
            "adjtimex": 171,
            "fanotify_init": 262,
        },  # fmt: skip
        "shared_memory": {"shmget": 194, "shmat": 196, "memfd_create": 279, "memfd_secret": 447},
    },
}


def _arch() -> _Arch:
    machine = platform.machine()
    if machine not in _ARCHES:
        raise OSError(errno.ENOSYS, f"the sandbox's seccomp filter has no syscall table for {machine}")
    return _ARCHES[machine]


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def namespace_flags(network: bool) -> int:
    """The ``CLONE_NEW*`` flags of a call: every namespace, the network one unless the network is allowed."""
    return _NAMESPACES & ~CLONE_NEWNET if network else _NAMESPACES


def unshare(flags: int) -> None:
    """Move this process into new namespaces (``unshare(2)``)."""
    _check(_LIBC.unshare(ctypes.c_int(flags)), "unshare")


def write_id_maps(pid: int | str, uid_map: str, gid_map: str, deny_setgroups: bool) -> None:
    """Write a process's uid/gid maps (``deny_setgroups``: needed when a process maps itself without privileges)."""
    base = f"/proc/{pid}"
    if deny_setgroups:
        with open(f"{base}/setgroups", "w") as f:
            f.write("deny")
    for name, text in (("uid_map", uid_map), ("gid_map", gid_map)):
        with open(f"{base}/{name}", "w") as f:
            f.write(text)


def mount(source: str | None, target: str, fstype: str | None = None, flags: int = 0, data: str | None = None) -> None:
    """``mount(2)``; an OSError names the target."""
    enc = [None if s is None else os.fsencode(s) for s in (source, target, fstype, data)]
    _check(_LIBC.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def bind(source: str, target: str, readonly: bool = True) -> None:
    """Bind ``source`` at ``target`` (which must exist, of the same kind), read-only unless told otherwise."""
    mount(source, target, None, MS_BIND)
    if readonly:
        keep = sum(flag for bit, flag in _KEEP_FLAGS.items() if os.statvfs(target).f_flag & bit)
        mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)


def _make(path: str, like: str) -> None:
    """Create ``path`` (with its parents) as a mount point for ``like``: a directory or an empty file."""
    if os.path.isdir(like):
        os.makedirs(path, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
        if not os.path.exists(path):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))


def build_root(root: str, paths: list[str], disk: str, disk_mb: int) -> None:
    """Build the code's root file system on the (empty, existing) directory ``root``, in this mount namespace.

    Args:
        root: Where to mount the new root's tmpfs.
        paths: Host files and directories to show read-only at the same paths (symlinks are copied as symlinks;
            paths below another one are skipped; missing ones are ignored).
        disk: An empty, existing directory outside ``root`` for the call's disk: a tmpfs of ``disk_mb`` whose
            ``tmp`` folder is the code's ``/tmp`` (also ``/dev/shm``) and whose ``work`` folder is left for the
            episode's files (see :data:`DISK_INODES_PER_MB` for its number of files).
        disk_mb: The size of that tmpfs: every file the call holds at once.
    """
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    inodes = max(1024, int(disk_mb) * DISK_INODES_PER_MB)
    mount("tmpfs", disk, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=755,size={int(disk_mb)}m,nr_inodes={inodes}")
    os.mkdir(f"{disk}/tmp")
    os.chmod(f"{disk}/tmp", 0o1777)
    os.mkdir(f"{disk}/work", 0o700)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
    os.mkdir(f"{root}/tmp")  # first: paths below /tmp are shown on it
    bind(f"{disk}/tmp", f"{root}/tmp", readonly=False)
    shown: list[str] = []
    for path in sorted({os.path.normpath(p) for p in paths}):
        if any(path.startswith(done.rstrip("/") + "/") for done in shown) or not os.path.lexists(path):
            continue
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            os.symlink(os.readlink(path), target)
            continue
        _make(target, path)
        bind(path, target)
        shown.append(path)
    os.makedirs(root + "/dev", mode=0o755, exist_ok=True)
    for name in ("null", "zero", "full", "random", "urandom"):
        _make(f"{root}/dev/{name}", f"/dev/{name}")
        bind(f"/dev/{name}", f"{root}/dev/{name}", readonly=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("shm", "/tmp")):
        os.symlink(target, f"{root}/dev/{name}")
    os.symlink("/proc/self/fd/1", f"{root}/dev/stdout")
    os.symlink("/proc/self/fd/2", f"{root}/dev/stderr")
    for name in ("proc", "tmp", WORKDIR.lstrip("/"), ".old"):
        os.makedirs(f"{root}/{name}", mode=0o755, exist_ok=True)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def shared_mount_point(path: str) -> None:
    """Make the directory ``path`` a mount of its own with shared propagation.

    What is later mounted on it here then appears in the mount namespaces copied from this one (the code's, which
    can no longer mount anything itself).
    """
    mount(path, path, None, MS_BIND)
    mount(None, path, None, MS_SHARED)


def enter_root(root: str) -> bool:
    """Mount a ``/proc`` for this PID namespace, make ``root`` the root and drop the host's; whether /proc is there.

    /proc is left empty where the kernel refuses to mount it (e.g. in a container that hides parts of its own).
    """
    try:
        mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        has_proc = True
    except OSError:
        has_proc = False
    old = f"{root}/.old"
    _check(_LIBC.syscall(_arch()["pivot_root"], os.fsencode(root), os.fsencode(old)), "pivot_root")
    os.chdir("/")
    _check(_LIBC.umount2(b"/.old", MNT_DETACH), "umount the host's root")
    return has_proc


def drop_privileges(uid: int | None) -> None:
    """Give up every capability for good (this process and what it starts), optionally becoming ``uid`` first.

    Args:
        uid: An inner uid to switch to (and the same gid), or None to stay the namespace's root without
            capabilities (``SECBIT_NOROOT``: executing a program gives none back).
    """
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
    except OSError:  # no /proc in this root: try every number a kernel may have
        last = 63
    for cap in range(last + 1):
        _LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # fails only for caps this kernel lacks
    _check(_LIBC.prctl(PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0), "set securebits")
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    header = struct.pack("=Ii", 0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = ctypes.create_string_buffer(24)  # two zeroed {effective, permitted, inheritable}
    _check(_LIBC.capset(header, data), "capset")
    _LIBC.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    with open("/proc/self/status") if os.path.exists("/proc/self/status") else open(os.devnull) as f:
        for line in f:
            if line.startswith("CapEff:") and int(line.split()[1], 16):
                raise OSError(errno.EPERM, "capabilities remained after dropping them")


def seccomp_program(machine: str | None = None, shared_memory: bool = True) -> bytes:
    """The classic-BPF seccomp filter: refuse the denied syscalls, namespace flags in clone, other ABIs (x32).

    Args:
        machine: ``platform.machine()`` to build for (default: this one).
        shared_memory: Whether SysV shared memory (``shmget``, ``shmat``) and memfds may be made. Refuse them where
            a memory watchdog bounds the call: their pages need not be mapped by any process, so it cannot count
            them (POSIX shared memory is files in ``/dev/shm``, the call's ``/tmp``, and counts on its disk).
    """
    arch = _ARCHES[machine] if machine else _arch()
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    allow, deny, enosys, kill = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS, 0x80000000
    out = [(ld, 0, 0, 4), (jeq, 1, 0, arch["audit"]), (ret, 0, 0, kill)]  # another architecture: kill
    out += [(ld, 0, 0, 0), (jge, 0, 1, 0x40000000), (ret, 0, 0, deny)]  # x32 calls share the arch, set this bit
    out += [(jeq, 0, 1, arch["clone3"]), (ret, 0, 0, enosys)]  # its flags are out of reach: libc falls back
    out += [(jeq, 0, 3, arch["clone"]), (ld, 0, 0, 16), (jset, 0, 1, _NAMESPACES), (ret, 0, 0, deny)]
    out.append((ld, 0, 0, 0))  # the clone check may have loaded args[0]
    denied = {**arch["denied"], **({} if shared_memory else arch["shared_memory"])}
    for nr in sorted(set(denied.values())):
        out += [(jeq, 0, 1, nr), (ret, 0, 0, deny)]
    out.append((ret, 0, 0, allow))
    return b"".join(struct.pack("=HBBI", *ins) for ins in out)


def install_seccomp(shared_memory: bool = True) -> None:
    """Set ``no_new_privs`` and load :func:`seccomp_program` for this process and everything it starts."""
    _check(_LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")
    program = seccomp_program(shared_memory=shared_memory)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = struct.pack("@HP", len(program) // 8, ctypes.addressof(buffer))  # struct sock_fprog
    # SECCOMP_SET_MODE_FILTER with SECCOMP_FILTER_FLAG_SPEC_ALLOW: a filter otherwise also turns on the speculative
    # store bypass mitigation for the process, which slows Python down by half; that side channel needs a VM anyway
    _check(_LIBC.syscall(_arch()["seccomp"], 1, 4, fprog), "load the seccomp filter")


def set_parent_death_signal(sig: int) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits."""
    _check(_LIBC.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "set the parent-death signal")


def loopback_up() -> None:
    """Bring the network namespace's loopback interface up (it starts down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), 0x8913, request))[1]  # SIOCGIFFLAGS
        fcntl.ioctl(s.fileno(), 0x8914, struct.pack("16sH22x", b"lo", flags | 1))  # SIOCSIFFLAGS, IFF_UP
