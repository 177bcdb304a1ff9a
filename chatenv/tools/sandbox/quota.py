"""The call's disk quota and the memory watchdog of :mod:`chatenv.tools.sandbox`.

Disk: during a call ``/tmp`` and ``/workdir`` live on one tmpfs of ``disk_mb`` (made by the helper in its own mount
namespace, so no privilege is needed); the episode's folder is copied onto it before the call and back after it,
so a write past the quota fails with ``ENOSPC`` and nothing of the call reaches the host's disk beyond it. Copies
never follow a link (links are copied as links), skip device files, FIFOs and sockets, and keep modes (plus
the owner's access) and times.

Memory, where no cgroup can be made: :func:`tree_memory` sums the private memory of every process below the
helper, which the helper polls while the call runs (the code's process is the init of its PID namespace, so
orphans stay below it).

Standard library only (loaded by path in the zygote, see :mod:`procs`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

__all__ = ["copy_tree", "empty_folder", "remove_tree", "same_owner_and_mode", "tree_memory"]

_MIB = 1024 * 1024


def empty_folder(path: str) -> None:
    """Remove everything in ``path`` (links are removed, never followed)."""
    for entry in os.scandir(path):
        remove_tree(entry.path)


def remove_tree(path: str, ignore_errors: bool = False) -> None:
    """Remove ``path`` and everything below it, at any depth, first giving its owner access to folders it lacks.

    Links are removed, never followed: code may leave a folder of mode 0 (which a plain ``shutil.rmtree`` of a
    non-root user skips) or thousands of nested ones (past Python's recursion limit).

    Raises:
        OSError: If something cannot be removed (unless ``ignore_errors``).
    """
    todo: list[tuple[str, bool]] = [(path, False)]
    while todo:
        here, listed = todo.pop()
        try:
            if listed:
                os.rmdir(here)
                continue
            info = os.lstat(here)
            if not stat.S_ISDIR(info.st_mode):
                os.unlink(here)
                continue
            if info.st_mode & 0o700 != 0o700:
                with contextlib.suppress(OSError):
                    os.chmod(here, stat.S_IMODE(info.st_mode) | 0o700)
            todo.append((here, True))
            todo.extend((entry.path, False) for entry in os.scandir(here))
        except FileNotFoundError:
            continue
        except OSError:
            if not ignore_errors:
                raise


def copy_tree(source: str, target: str, budget: int, owner: int | None = None) -> int:
    """Copy the contents of folder ``source`` into the existing folder ``target``; the bytes copied.

    Copies keep their owners where the copier may give them (else they are the copier's), modes (less set-uid and
    set-gid; the owner may always read and write files and open folders, so that the host can copy and remove
    what code left) and times. Folders are walked without recursion: any depth is copied.

    Args:
        source: The folder to copy from.
        target: An existing folder (its own mode and owner are left alone).
        budget: Bytes of file data that may be copied (files are sized by their length: a sparse file counts
            whole).
        owner: A uid (and gid) to give every copy instead of its source's.

    Raises:
        OSError: ``ENOSPC`` if the files need more than ``budget`` (what fits is copied) or the target's file
            system fills; another error if a file cannot be read or written.
    """
    copied = 0
    todo, folders = [(source, target)], []  # folders get their modes and times last: filling them changes both
    try:
        while todo:
            here, there = todo.pop()
            for entry in sorted(os.scandir(here), key=lambda e: e.name):
                info = entry.stat(follow_symlinks=False)
                path = os.path.join(there, entry.name)
                if stat.S_ISLNK(info.st_mode):
                    os.symlink(os.readlink(entry.path), path)
                elif stat.S_ISDIR(info.st_mode):
                    os.mkdir(path, 0o700)
                    todo.append((entry.path, path))
                    folders.append((path, info))
                    continue
                elif stat.S_ISREG(info.st_mode):
                    if copied + info.st_size > budget:
                        raise OSError(errno.ENOSPC, f"the files need more than {budget // _MIB} MiB")
                    copied += _copy_file(entry.path, path, info.st_size)
                else:
                    continue
                _keep_owner_mode_times(path, info, 0o600, owner)
    finally:
        for path, info in reversed(folders):
            with contextlib.suppress(OSError):
                _keep_owner_mode_times(path, info, 0o700, owner)
    return copied


def _keep_owner_mode_times(path: str, info: os.stat_result, owner_bits: int, owner: int | None) -> None:
    """Give the copy ``path`` the owner (``owner``, else ``info``'s, where the copier may), mode and times of ``info``.

    The mode gains ``owner_bits``.
    """
    with contextlib.suppress(OSError):  # an owner this user namespace does not map stays the copier
        os.lchown(path, *((info.st_uid, info.st_gid) if owner is None else (owner, owner)))
    if not stat.S_ISLNK(info.st_mode):
        os.chmod(path, (stat.S_IMODE(info.st_mode) & 0o1777) | owner_bits)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns), follow_symlinks=False)


def same_owner_and_mode(source: str, target: str) -> None:
    """Give folder ``target`` the owner (where the copier may) and mode of folder ``source``."""
    info = os.stat(source)
    with contextlib.suppress(OSError):
        os.chown(target, info.st_uid, info.st_gid)
    os.chmod(target, stat.S_IMODE(info.st_mode) & 0o1777)


def _copy_file(source: str, target: str, size: int) -> int:
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            done = 0
            while done < size:
                sent = os.sendfile(dst, src, done, min(size - done, 1 << 24))
                if sent == 0:
                    break
                done += sent
            return done
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(p) for p in f.read().split())
    return kids


def tree_memory(root: int) -> int:
    """Bytes of private memory (anonymous and shared-memory pages) of the processes below ``root``.

    A page shared by a parent and its forked child is counted in each (an over-estimate, never an under-one).
    """
    total, todo, seen = 0, _children(root), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
        todo.extend(_children(pid))
    return total
