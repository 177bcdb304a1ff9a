"""Attacks on the Python sandbox, as model-written code would try them (Linux, kernel namespaces).

Each case asserts that the attack is blocked and that the trainer (a decoy process standing in for it, holding a
secret in its environment), the other episodes and the host's files are untouched. The destructive steps of an
attack run only once the code has checked that it is the init of its own PID namespace, so a broken sandbox fails
the test instead of harming the host running it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import closing

import pytest

from chatenv.tools.sandbox import PythonSandbox
from chatenv.tools.sandbox.procs import descendants

SECRET = "chatenv-test-secret-7f3a9c"
GUARD = "import os\nassert os.getpid() == 1, 'not isolated: the attack is not run'\n"


@pytest.fixture(scope="module")
def decoy():
    """A stand-in for the trainer: a live process with a secret in its environment and on its command line."""
    proc = subprocess.Popen(
        [sys.executable, "-c", f"import time; SECRET = {SECRET!r}; time.sleep(600)"],
        env={**os.environ, "TRAINER_TOKEN": SECRET},
    )
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def sandbox():
    os.environ["TRAINER_TOKEN"] = SECRET  # what the trainer's own environment holds when the sandbox starts
    try:
        with PythonSandbox(workers=2, timeout=10.0, memory_mb=512, max_processes=32) as sb:
            yield sb
    finally:
        del os.environ["TRAINER_TOKEN"]


def attack(sandbox, code: str, timeout: float = 10.0, session=None):
    """Run attack code in a fresh session (or ``session``); the result."""
    own = session is None
    session = session or sandbox.session()
    try:
        guard = code.startswith(GUARD)
        code = (GUARD if guard else "") + textwrap.dedent(code.removeprefix(GUARD) if guard else code)
        return sandbox.run(code, workdir=session.workdir, timeout=timeout)
    finally:
        if own:
            session.close()


def state(pid: int) -> str | None:
    """A process's state letter (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    return stat[stat.rindex(")") + 2]


def trainer_untouched(sandbox, decoy) -> None:
    assert state(decoy.pid) in ("S", "R") and decoy.poll() is None  # alive, not stopped, not traced
    with closing(sandbox.session()) as s:
        assert s.python("print(6 * 7)") == "[stdout]\n42"  # the sandbox still serves


def test_trainer_memory_environment_and_files_are_out_of_reach(sandbox, decoy, tmp_path):
    secret_file = tmp_path / "answers.txt"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o644)
    tmp_path.chmod(0o755)
    r = attack(
        sandbox,
        f"""
        import ctypes, os
        found = []
        for path in ["/proc/{decoy.pid}/mem", "/proc/{decoy.pid}/environ", "/proc/{decoy.pid}/cmdline",
                     "/proc/{os.getpid()}/environ", "/proc/{os.getpid()}/mem", "/proc/self/environ", "/proc/1/environ",
                     "{secret_file}"]:
            try:
                with open(path, "rb") as f:
                    if {SECRET!r}.encode() in f.read(1 << 20):
                        found.append(path)
            except OSError:
                pass
        found += [k for k, v in os.environ.items() if {SECRET!r} in v]
        libc = ctypes.CDLL(None, use_errno=True)
        attached = libc.ptrace(16, {decoy.pid}, 0, 0)  # PTRACE_ATTACH
        buf = ctypes.create_string_buffer(64)
        iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)
        read = libc.process_vm_readv({decoy.pid}, iov, 1, iov, 1, 0)
        print(os.getppid(), sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), found, attached, read)
        """,
    )
    assert r.ok, r.text()
    assert r.stdout == "0 [1] [] -1 -1\n"  # no parent, alone in its /proc, nothing found, ptrace and vm reads fail
    trainer_untouched(sandbox, decoy)


def test_signals_cannot_reach_the_trainer_or_the_sandbox(sandbox, decoy):
    zygotes = sandbox.worker_pids()
    r = attack(
        sandbox,
        GUARD
        + f"""
        import signal
        for pid in ({decoy.pid}, {os.getpid()}, *{zygotes}):
            try:
                os.kill(pid, signal.SIGKILL)
                print("signalled", pid)
            except ProcessLookupError:
                pass
        try:
            os.kill(-1, signal.SIGKILL)  # everything it may signal: nothing but itself in its own namespace
        except ProcessLookupError:
            pass
        print("survived")
        """,
    )
    assert r.ok and r.stdout == "survived\n", r.text()
    assert sandbox.worker_pids() == zygotes
    trainer_untouched(sandbox, decoy)


def test_protocol_descriptors_are_out_of_reach(sandbox, decoy):
    """Junk written to every descriptor the code has (and its own result) cannot reach another call."""
    stop = threading.Event()
    victims: list[str] = []

    def victim():
        with closing(sandbox.session()) as s:
            while not stop.is_set():
                victims.append(s.python("print(40 + 5)"))

    thread = threading.Thread(target=victim)
    thread.start()
    try:
        for _ in range(5):
            r = attack(
                sandbox,
                """
                import os, json, struct
                fds = sorted(map(int, os.listdir("/proc/self/fd")))
                fds = [fd for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]  # not the listing's own
                frame = json.dumps({"done": {"pid": 1, "status": 0, "timed_out": False}, "error": "42"}).encode()
                for fd in range(1024):
                    for data in (struct.pack("!I", len(frame)) + frame, frame, b"\\x00" * 64):
                        try:
                            os.write(fd, data)
                        except OSError:
                            pass
                print(fds)
                """,
            )
            assert r.stdout.rstrip().endswith("[0, 1, 2, 3]"), r.text()  # stdin, stdout, stderr, its result
    finally:
        stop.set()
        thread.join(30)
    assert victims and set(victims) == {"[stdout]\n45"}
    trainer_untouched(sandbox, decoy)


def test_outputs_cannot_be_forged_or_hung_through_files(sandbox, decoy):
    before = sorted(os.listdir(sandbox.root))
    r = attack(
        sandbox,
        f"""
        import os
        made = []
        for path in ["../worker1.out", "/worker1.out", "{sandbox.root}/worker1.out", "/usr/x.out", "/etc/x.out"]:
            try:
                os.mkfifo(path)
                made.append(path)
            except OSError:
                pass
            try:
                open(path, "w").write("forged")
                made.append(path)
            except OSError:
                pass
        print(made)
        """,
    )
    assert r.ok and r.stdout == "[]\n", r.text()
    assert sorted(os.listdir(sandbox.root)) == before
    with closing(sandbox.session()) as s:
        assert s.python("print('mine')") == "[stdout]\nmine"
    trainer_untouched(sandbox, decoy)


def test_network_refusal_cannot_be_switched_off(sandbox, decoy):
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"""
        import socket, sys
        for name, module in list(sys.modules.items()):
            if hasattr(module, "NETWORK_EVENTS"):
                module.NETWORK_EVENTS = frozenset()
        sys.addaudithook(lambda *a: None)
        reached = []
        for address in [("127.0.0.1", {port}), ("10.0.0.1", 80), ("1.1.1.1", 53)]:
            try:
                socket.create_connection(address, timeout=1).close()
                reached.append(address)
            except OSError:
                pass
        print(reached)
        """
        with closing(sandbox.session()) as s:
            assert attack(sandbox, code, session=s).stdout == "[]\n"
            assert attack(sandbox, code, session=s).stdout == "[]\n"  # and not for later calls either
        with pytest.raises(BlockingIOError):
            server.accept()
    trainer_untouched(sandbox, decoy)


@pytest.mark.parametrize("ending", ["return", "timeout"])
def test_no_process_survives_the_call(sandbox, decoy, ending):
    """Daemons (double fork, setsid, no parent-death signal, SIGTERM ignored) and a fork chain racing the kill."""
    code = (
        GUARD
        + """
        import ctypes, signal, time
        def beat(name):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # no parent-death signal
            for _ in range(500):
                with open(name, "a") as f:
                    f.write("x")
                time.sleep(0.01)
            os._exit(0)
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                beat("daemon.beat")
            os._exit(0)
        if os.fork() == 0:  # a chain: each process forks its successor and exits at once
            for _ in range(100000):
                if os.fork():
                    os._exit(0)
                with open("chain.beat", "a") as f:
                    f.write("x")
        time.sleep(0.3)
        print("started")
        """
        + ("while True: pass\n" if ending == "timeout" else "")
    )
    with closing(sandbox.session()) as s:
        r = attack(sandbox, code, timeout=1.0 if ending == "timeout" else 10.0, session=s)
        assert r.stdout == "started\n" and r.timed_out == (ending == "timeout"), r.text()
        sizes = [os.path.getsize(os.path.join(s.workdir, n)) for n in ("daemon.beat", "chain.beat")]
        time.sleep(0.3)
        assert [os.path.getsize(os.path.join(s.workdir, n)) for n in ("daemon.beat", "chain.beat")] == sizes
        assert all(size > 0 for size in sizes)
    live = [pid for z in sandbox.worker_pids() for pid in descendants(z) if state(pid) not in (None, "Z")]
    assert len(live) <= 2 * len(sandbox.worker_pids())  # only each zygote's standby helper and its code process
    trainer_untouched(sandbox, decoy)


def test_leftover_hooks_and_files_cannot_spy_on_later_episodes(sandbox, decoy):
    with closing(sandbox.session()) as spy:
        r = attack(
            sandbox,
            """
            import sys, os
            log = open("spy.log", "a")
            sys.addaudithook(lambda event, args: log.write(f"{event} {args!r}\\n"))
            for path in ["/tmp/sitecustomize.py", "sitecustomize.py", "/usr/lib/sitecustomize.py",
                         os.path.join(os.path.dirname(os.__file__), "sitecustomize.py")]:
                try:
                    open(path, "w").write("import builtins; builtins.SPY = True")
                except OSError:
                    pass
            print("planted")
            """,
            session=spy,
        )
        assert r.stdout == "planted\n", r.text()
        with closing(sandbox.session()) as victim:
            out = victim.python(f"import builtins\nprint(hasattr(builtins, 'SPY'), {SECRET!r}[:4])")
            assert out == "[stdout]\nFalse chat"
        with open(os.path.join(spy.workdir, "spy.log")) as f:
            log = f.read()
        assert SECRET not in log and "SPY" not in log.split("planted")[-1]
        assert attack(sandbox, "print(open('/tmp/sitecustomize.py').read())", session=spy).error  # /tmp is per call
    trainer_untouched(sandbox, decoy)


@pytest.mark.slow
def test_other_live_episodes_are_invisible(sandbox, decoy):
    with closing(sandbox.session()) as victim, closing(sandbox.session()) as spy:
        with open(os.path.join(victim.workdir, "notes.txt"), "w") as f:
            f.write(SECRET)
        os.chmod(os.path.join(victim.workdir, "notes.txt"), 0o644)
        busy = threading.Thread(target=victim.python, args=("import time\ntime.sleep(2)",))
        busy.start()
        time.sleep(0.5)
        try:
            r = attack(
                sandbox,
                f"""
                import os, glob
                seen = []
                for pattern in ["/proc/*/cwd/*", "/proc/*/root/workdir/*", "{victim.workdir}/*", "/*/*.txt",
                                "../*", "/tmp/*"]:
                    for path in glob.glob(pattern):
                        try:
                            if {SECRET!r} in open(path).read():
                                seen.append(path)
                        except OSError:
                            pass
                print(seen, sorted(os.listdir("/workdir")))
                """,
                session=spy,
            )
        finally:
            busy.join(10)
    assert r.ok and r.stdout == "[] []\n", r.text()
    trainer_untouched(sandbox, decoy)


def test_the_host_file_system_is_read_only(sandbox, decoy, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("intact")
    canary.chmod(0o666)
    tmp_path.chmod(0o777)
    marker = f"chatenv-attack-{os.getpid()}"
    r = attack(
        sandbox,
        f"""
        import os
        written = []
        for path in ["{canary}", "{tmp_path}/new.txt", "/etc/{marker}", "/usr/{marker}", "/{marker}",
                     "{os.path.dirname(os.__file__)}/{marker}.py", "/dev/{marker}", "/proc/sys/kernel/{marker}"]:
            try:
                with open(path, "w") as f:
                    f.write("owned")
                written.append(path)
            except OSError:
                pass
        open("/tmp/{marker}", "w").write("private")  # its own /tmp: allowed, and gone after the call
        print(written)
        """,
    )
    assert r.ok and r.stdout == "[]\n", r.text()
    assert canary.read_text() == "intact" and sorted(os.listdir(tmp_path)) == ["canary.txt"]
    for path in (f"/etc/{marker}", f"/usr/{marker}", f"/{marker}", f"/tmp/{marker}"):
        assert not os.path.exists(path)
    trainer_untouched(sandbox, decoy)


def test_privileges_mounts_namespaces_and_kernel_interfaces_are_refused(sandbox, decoy):
    r = attack(
        sandbox,
        GUARD
        + """
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        def call(name, *args):
            result = getattr(libc, name)(*args)
            return errno.errorcode.get(ctypes.get_errno(), "?") if result == -1 else f"ok {result}"
        outcome = {
            "unshare user": call("unshare", 0x10000000),
            "unshare mount": call("unshare", 0x00020000),
            "mount tmpfs": call("mount", b"tmpfs", b"/tmp", b"tmpfs", 0, None),
            "remount /usr rw": call("mount", None, b"/usr", None, 32 | 4096, None),
            "chroot": call("chroot", b"/tmp"),
            "setuid 0": call("setuid", 0),
            "ptrace traceme": call("ptrace", 0, 0, 0, 0),
            "bpf": call("syscall", 321, 0, 0, 0),
            "keyctl": call("syscall", 250, 0, 0, 0),
            "perf_event_open": call("syscall", 298, 0, 0, -1, -1, 0),
            "io_uring_setup": call("syscall", 425, 1, 0),
            "sethostname": call("sethostname", b"x", 1),
        }
        print(sorted(k for k, v in outcome.items() if v.startswith("ok")))
        status = open("/proc/self/status").read()
        keys = ("CapEff", "NoNewPrivs", "Seccomp:")
        print([line.split()[1] for line in status.splitlines() if line.startswith(keys)])
        """,
    )
    assert r.ok, r.text()
    assert r.stdout == "[]\n['0000000000000000', '1', '2']\n"
    trainer_untouched(sandbox, decoy)


def test_fork_bomb_is_bounded(sandbox, decoy):
    r = attack(
        sandbox,
        GUARD
        + """
        import time
        children = 0
        for _ in range(500):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                children += 1
            except OSError:
                break
        print(children)
        """,
    )
    assert r.ok and int(r.stdout) < 32, r.text()  # max_processes=32
    trainer_untouched(sandbox, decoy)


# Bounds for the whole call: the attacks of the acceptance checks (several processes, many files, raised limits).


@pytest.fixture(scope="module")
def watched():
    """A sandbox bounding the call's memory by the watchdog (what runs where no cgroup can be made)."""
    with PythonSandbox(workers=1, timeout=10.0, memory_mb=512, max_processes=32, call_limits="watchdog") as sb:
        yield sb


@pytest.fixture(params=["auto", "watchdog"])
def bounded(request, sandbox, watched):
    """Each way this machine bounds a call: the strongest available (cgroups when allowed), and the watchdog."""
    return sandbox if request.param == "auto" else watched


CHILDREN_ATTACK = (
    GUARD
    + """
    import time
    CHUNK = 16  # MiB; each child claims a chunk in progress.log before touching it
    def child(i):
        held = []
        with open("progress.log", "a", buffering=1) as log:
            while len(held) * CHUNK < 304:  # 304 MiB each: below memory_mb=512 alone, 1216 MiB for the four
                log.write(f"{time.monotonic()} {i} {(len(held) + 1) * CHUNK}\\n")
                block = bytearray(CHUNK << 20)
                block[::4096] = b"\\x01" * ((CHUNK << 20) // 4096)
                held.append(block)
        time.sleep(2)
        os._exit(0)
    kids = {}
    for i in range(4):
        pid = os.fork()
        if pid == 0:
            child(i)
        kids[pid] = i
    with open("deaths.log", "w", buffering=1) as log:
        while kids:
            pid, status = os.wait()
            log.write(f"{time.monotonic()} {kids.pop(pid)} {status}\\n")
    print("all ended")
    """
)


def held_together(workdir: str) -> int:
    """The most MiB the attack's children claimed while alive at the same time (from its own logs).

    A chunk counts from just before it is touched until the parent reaped its child (or, with no record of the
    child's end, for ever): an over-estimate of what was resident at once.
    """
    with open(os.path.join(workdir, "progress.log")) as f:
        claims = sorted((float(t), int(i), int(mib)) for t, i, mib in (line.split() for line in f))
    deaths: dict[int, float] = {}
    if os.path.exists(os.path.join(workdir, "deaths.log")):
        with open(os.path.join(workdir, "deaths.log")) as f:
            deaths = {int(i): float(t) for t, i, _ in (line.split() for line in f)}
    held: dict[int, int] = {}
    peak = 0
    for t, i, mib in claims:
        held[i] = mib
        peak = max(peak, sum(m for j, m in held.items() if deaths.get(j, float("inf")) > t))
    return peak


def resident_mib(sandbox) -> float:
    """MiB of anonymous memory held by the processes below the sandbox's zygotes, read from the host's /proc.

    Proportional counts (``Pss_Anon``): a page a child shares with its parent counts once in all.
    """
    total = 0
    for pid in (p for z in sandbox.worker_pids() for p in descendants(z)):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("Pss_Anon:"))
        except OSError:
            pass
    return total / 1024


def peak_resident_during(sandbox, call) -> tuple[object, float]:
    """Run ``call()`` while sampling :func:`resident_mib`; its result and the most MiB seen over the idle level."""
    idle = resident_mib(sandbox)
    seen: list[float] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            seen.append(resident_mib(sandbox))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = call()
    finally:
        stop.set()
        sampler.join(30)
    return result, max(seen, default=idle) - idle


def test_children_together_stay_within_memory_mb(bounded, decoy):
    with closing(bounded.session()) as s:
        r, resident = peak_resident_during(bounded, lambda: attack(bounded, CHILDREN_ATTACK, session=s))
        claimed = held_together(s.workdir)
    assert r.exceeded == "memory", r
    assert claimed >= 256  # the children did allocate (the control below shows what they reach without a bound)
    assert resident <= 512 + 32, resident  # sampled from outside; the attack shows 1216 MiB unbounded (the control)
    if bounded.limits["memory"] == "watchdog":  # it samples every 10 ms: what the call grew by since can pass
        assert "used more than memory_mb=512 MiB together" in r.killed
        assert 512 < r.memory_peak_mb <= 512 + 64
    else:  # the kernel's count, bounded by the kernel
        assert 256 <= r.memory_peak_mb <= 512
    trainer_untouched(bounded, decoy)


SHARED_MEMORY_ATTACK = (
    GUARD
    + """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    CHUNK, CHUNKS = 128 << 20, 5  # 640 MiB, over memory_mb=512, held by no process once detached
    for _ in range(CHUNKS):
        shm = libc.shmget(0, ctypes.c_size_t(CHUNK), 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
        address = libc.shmat(shm, None, 0) if shm >= 0 else None
        if address in (None, ctypes.c_void_p(-1).value):
            print("shm:", os.strerror(ctypes.get_errno()))
            break
        ctypes.memset(address, 1, CHUNK)
        libc.shmdt(ctypes.c_void_p(address))
    else:
        print("shm filled")
    try:
        fd = os.memfd_create("hidden")  # never mapped at all
    except OSError as e:
        print("memfd_create:", e.strerror)
    else:
        for _ in range(CHUNKS * CHUNK >> 20):
            os.write(fd, b"x" * (1 << 20))
        print("memfd filled")
    """
)


def test_shared_memory_held_by_no_process_is_bounded(bounded, decoy):
    """SysV shared memory and memfds need not be mapped: refused under the watchdog, counted by a memory cgroup."""
    r = attack(bounded, SHARED_MEMORY_ATTACK)
    if bounded.limits["memory"] == "watchdog":
        assert r.stdout == "shm: Operation not permitted\nmemfd_create: Operation not permitted\n", r.text()
    else:
        assert r.exceeded == "memory" and "filled" not in r.stdout, r
    trainer_untouched(bounded, decoy)


def test_children_attack_passes_the_bound_without_call_limits(decoy):
    """The control: with call_limits="process" the same attack holds all 1216 MiB (so the check above can fail)."""
    with PythonSandbox(workers=1, memory_mb=512, call_limits="process") as sb, closing(sb.session()) as s:
        assert sb.limits["memory"] == "process"
        r, resident = peak_resident_during(sb, lambda: attack(sb, CHILDREN_ATTACK, session=s))
        assert r.stdout == "all ended\n" and r.exceeded is None, r
        assert held_together(s.workdir) == 4 * 304 and resident > 1000


def folder_bytes(path: str) -> int:
    """Bytes of every file below ``path`` (links not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.lstat(os.path.join(root, name)).st_size for name in files)
    return total


def test_many_small_files_stop_at_the_disk_quota(sandbox, decoy):
    with closing(sandbox.session()) as s:
        r = attack(
            sandbox,
            """
            import os
            written, error = 0, None
            try:
                for n in range(1000):  # 1 MiB files, far below file_mb each, alternately in /tmp and /workdir
                    for folder in ("/tmp", "."):
                        with open(f"{folder}/f{n}", "wb") as f:
                            f.write(b"x" * (1 << 20))
                        written += 1 << 20
            except OSError as e:
                error = e.errno
            print(written >> 20, error)
            """,
            session=s,
        )
        written, error = map(int, r.stdout.split())
        assert error == 28 and r.exceeded == "disk", r  # ENOSPC
        assert 32 <= written <= 64  # file_mb=64 is the quota of /tmp and /workdir together
        on_disk = folder_bytes(s.workdir)
        assert 16 << 20 <= on_disk <= 64 << 20
        # /tmp is new per call (it may hold mount points of the interpreter's folders when those lie under the
        # host's /tmp, never a file a call wrote); the folder persists
        after = s.python("import os\nprint([n for n in os.listdir('/tmp') if n[:1] == 'f'], len(os.listdir('.')))")
        assert after == f"[stdout]\n[] {len(os.listdir(s.workdir))}"
    trainer_untouched(sandbox, decoy)


def test_sparse_files_cannot_pass_the_quota_on_the_way_out(sandbox, decoy):
    with closing(sandbox.session()) as s:
        code = "for i in range(8):\n    with open(f'sparse{i}', 'wb') as f:\n        f.truncate(60 << 20)\nprint('ok')"
        r = attack(sandbox, code, session=s)
        assert r.stdout == "ok\n" and r.exceeded == "disk" and "need more than disk_mb=64 MiB" in r.killed, r
        assert folder_bytes(s.workdir) <= 64 << 20
    trainer_untouched(sandbox, decoy)


def test_resource_limits_cannot_be_raised(sandbox, decoy):
    r = attack(
        sandbox,
        """
        import resource
        report = {}
        for name in ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE"):
            which = getattr(resource, name)
            soft, hard = resource.getrlimit(which)
            refused = 0
            for wanted in ((resource.RLIM_INFINITY, resource.RLIM_INFINITY), (soft, hard + 1), (hard + 1, hard + 1)):
                try:
                    resource.setrlimit(which, wanted)
                except ValueError:
                    refused += 1
                try:
                    resource.prlimit(0, which, wanted)
                except (ValueError, PermissionError):
                    refused += 1
            report[name] = (soft == hard != resource.RLIM_INFINITY, refused, resource.getrlimit(which) == (soft, hard))
        print(report)
        """,
    )
    assert r.ok, r.text()
    names = ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE")
    assert r.stdout == str(dict.fromkeys(names, (True, 6, True))) + "\n"
    trainer_untouched(sandbox, decoy)


def test_fork_bomb_of_every_process_is_bounded_for_the_whole_call(bounded, decoy):
    r = attack(
        bounded,
        GUARD
        + """
        import time
        end, init = time.monotonic() + 1.0, os.getpid() == 1
        while time.monotonic() < end:  # every process forks, children included
            try:
                if os.fork() == 0:
                    init = False
            except OSError:
                time.sleep(0.001)
        if init:
            time.sleep(0.3)
            print(len([p for p in os.listdir("/proc") if p.isdigit()]))
        else:
            time.sleep(30)
        """,
    )
    assert r.ok and 16 <= int(r.stdout) <= 32, r.text()  # max_processes=32 for the call, its init included
    if bounded.limits["processes"].startswith("cgroup"):
        assert r.exceeded == "pids"
    trainer_untouched(bounded, decoy)
