"""PythonSandbox: real processes in real namespaces, real limits, real kills (Linux). Attacks: tests/security/."""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import closing

import pytest

from chatenv.tools.base import PerEpisode
from chatenv.tools.sandbox import PythonSandbox, PythonSession, SandboxError, cgroups, python_tool
from chatenv.tools.sandbox.procs import descendants


def alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie (killed processes may stay zombies under an init that
    does not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.fixture(scope="module")
def sandbox():
    with PythonSandbox(workers=2, timeout=5.0, memory_mb=512, max_output_chars=1000) as sb:
        yield sb


@pytest.fixture
def session(sandbox):
    s = sandbox.session()
    yield s
    s.close()


def run(sandbox, session, code, **kw):
    return sandbox.run(code, workdir=session.workdir, **kw)


def test_stdout_stderr_and_exception(sandbox, session):
    r = run(sandbox, session, "import sys\nprint('out')\nprint('err', file=sys.stderr)\nprint(__name__)\n1/0")
    assert r.stdout == "out\n__main__\n" and r.stderr == "err\n"
    assert r.error.startswith("Traceback") and r.error.rstrip().endswith("ZeroDivisionError: division by zero")
    assert 'File "<sandbox>", line 5' in r.error and "sandbox_worker" not in r.error
    assert not r.ok and not r.timed_out and r.killed is None
    assert r.text() == f"[stdout]\nout\n__main__\n[stderr]\nerr\n[error]\n{r.error.rstrip()}"
    ok = run(sandbox, session, "x = 1")
    assert ok.ok and ok.text() == "(no output)"
    syntax = run(sandbox, session, "def f(:")
    assert "SyntaxError" in syntax.error
    assert run(sandbox, session, "import sys; sys.exit(0)").ok
    assert run(sandbox, session, "raise SystemExit(3)").error == "SystemExit: 3"


def test_output_over_the_cap_is_cut_with_a_marker(sandbox, session):
    r = run(sandbox, session, "print('x' * 5000)\nimport sys; sys.stderr.write('é' * 1500)")
    assert r.stdout_chars == 5001 and r.stderr_chars == 1500
    assert r.stdout.startswith("x" * 1000)
    assert r.stdout[1000:] == "\n[... 4001 more characters cut: output is limited to 1000 characters ...]"
    assert r.stderr.startswith("é" * 1000) and "500 more characters cut" in r.stderr
    small = run(sandbox, session, "print('y' * 10)")
    assert small.stdout == "y" * 10 + "\n" and small.stdout_chars == 11


def test_fd_level_writes_are_captured(sandbox, session):
    code = (
        "import os, subprocess, ctypes\n"
        "os.write(1, b'hi')\n"
        "os.write(2, b'raw err')\n"
        "subprocess.run(['echo', 'from child'])\n"
        "ctypes.CDLL(None).printf(b' from C')\n"
    )
    r = run(sandbox, session, code)
    assert r.ok, r.text()
    assert r.stdout == "hifrom child\n from C" and r.stderr == "raw err"
    after = run(sandbox, session, "print('next')")
    assert after.ok and after.stdout == "next\n" and after.worker_pid != r.worker_pid  # a fresh process per call


def below_zygotes(sandbox) -> list[str]:
    """The command names of every process below the sandbox's zygotes (their standby helpers included)."""
    names = []
    for pid in (p for z in sandbox.worker_pids() for p in descendants(z)):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as f:
            names.append(f.read().strip())
    return names


def test_runaway_is_killed(sandbox, session):
    zygotes = sandbox.worker_pids()
    t = time.monotonic()
    r = run(sandbox, session, "print('started', flush=True)\nwhile True: pass", timeout=1.0)
    # The code never ends on its own and the sandbox's default limit is 10 s: returning within 8 s shows the 1 s
    # limit killed it (the rest is room for a loaded machine).
    assert time.monotonic() - t < 8
    assert r.timed_out and "timed out after 1 s" in r.killed and r.stdout == "started\n"
    assert not alive(r.worker_pid) and sandbox.worker_pids() == zygotes  # the zygotes stay
    again = run(sandbox, session, "print(2 + 2)")
    assert again.ok and again.stdout == "4\n"


def test_killed_runaway_leaves_no_process(sandbox, session):
    code = (
        "import subprocess\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        "q = subprocess.Popen(['sh', '-c', 'sleep 60 & echo $!'], stdout=subprocess.PIPE, start_new_session=True)\n"
        "print(p.pid, int(q.stdout.readline()), flush=True)\n"
        "while True: pass\n"
    )
    r = run(sandbox, session, code, timeout=1.0)
    assert r.timed_out and len(r.stdout.split()) == 2
    assert not alive(r.worker_pid) and "sleep" not in below_zygotes(sandbox)


def test_exited_code_leaves_no_process(sandbox, session):
    r = run(sandbox, session, "import os, subprocess\nsubprocess.Popen(['sleep', '60'])\nos._exit(3)")
    assert r.killed == (
        "the code's process exited with status 3 before the code finished (did it call os._exit or exec?)"
    )
    assert not alive(r.worker_pid) and "sleep" not in below_zygotes(sandbox)
    assert run(sandbox, session, "print('next')").stdout == "next\n"


def test_processes_do_not_outlive_a_normal_call(sandbox, session):
    r = run(sandbox, session, "import subprocess\nprint(subprocess.Popen(['sleep', '60']).pid)")
    assert r.ok and int(r.stdout) > 1
    assert not alive(r.worker_pid) and "sleep" not in below_zygotes(sandbox)


def test_memory_bombs_fail_without_harming_the_pool(sandbox, session):
    r = run(sandbox, session, "x = bytearray(4 * 1024**3)")
    assert "MemoryError" in r.error
    assert run(sandbox, session, "print('fine')").stdout == "fine\n"
    r = run(sandbox, session, "chunks = []\nwhile True:\n    chunks.append(bytearray(10**6))")
    assert (r.error and "MemoryError" in r.error) or r.killed
    assert run(sandbox, session, "print('still fine')").stdout == "still fine\n"
    assert len(sandbox.worker_pids()) == 2


def test_network_is_refused_by_the_kernel(sandbox, session):
    r = run(sandbox, session, "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)")
    assert "ConnectionRefusedError" in r.error  # its own loopback, with nothing listening
    r = run(sandbox, session, "import socket\nsocket.create_connection(('10.1.2.3', 80), timeout=2)")
    assert "Network is unreachable" in r.error
    r = run(sandbox, session, "import socket\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\nprint('ok')")
    assert r.ok and r.stdout == "ok\n"  # local sockets still work inside the call


def test_network_and_file_size_when_allowed():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with PythonSandbox(workers=1, allow_network=True, file_mb=1) as sb, closing(sb.session()) as s:
            r = sb.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port})).close()", workdir=s.workdir)
            assert r.ok, r.text()
            server.settimeout(5)
            server.accept()[0].close()
            r2 = sb.run("open('big', 'wb').write(b'x' * 2 * 1024 * 1024)", workdir=s.workdir)
            assert "File too large" in r2.error and r2.killed is None


def test_sessions_have_private_persistent_workdirs(sandbox):
    a, b = sandbox.session(), sandbox.session()
    try:
        assert a.workdir != b.workdir
        assert a.python("open('notes.txt', 'w').write('kept')\nx = 1") == "(no output)"
        assert a.python("import os\nprint(open('notes.txt').read(), os.getcwd() == os.path.realpath('.'))") == (
            "[stdout]\nkept True"
        )
        assert "NameError" in a.python("print(x)")  # variables do not carry over
        assert "FileNotFoundError" in b.python("open('notes.txt')")
        a.python("with open('helper.py', 'w') as f: f.write('VALUE = 7')")
        assert a.python("import helper; print(helper.VALUE)") == "[stdout]\n7"
        assert "ModuleNotFoundError" in b.python("import helper")
    finally:
        a.close()
        b.close()
    assert not os.path.exists(a.workdir)
    a.close()


def test_state_changes_do_not_leak_into_later_calls(sandbox, session):
    run(sandbox, session, "import builtins, os, sys\nbuiltins.print = None\nos.chdir('/')\nos.environ['ZZ'] = '1'")
    r = run(sandbox, session, "import os\nprint(os.getcwd(), 'ZZ' in os.environ, os.environ['HOME'])")
    assert r.stdout == "/workdir False /workdir\n"


def test_code_sees_a_fresh_minimal_environment(sandbox, session, monkeypatch):
    r = run(sandbox, session, "import os\nprint(sorted(os.environ))")
    assert r.stdout == str(sorted(["HOME", "LANG", "MKL_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                   "PATH", "TMPDIR"])) + "\n"  # fmt: skip
    with PythonSandbox(workers=1, env={"MY_SETTING": "on"}) as sb, closing(sb.session()) as s:
        assert sb.run("import os\nprint(os.environ['MY_SETTING'])", workdir=s.workdir).stdout == "on\n"


def test_concurrent_calls_share_the_pool(sandbox):
    results, errors = {}, []

    def work(i):
        with closing(sandbox.session()) as s:
            try:
                for j in range(3):
                    results[i, j] = s.python(f"import time\ntime.sleep(0.05)\nprint({i} * 100 + {j})")
            except Exception as e:  # surfaced below
                errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert results == {(i, j): f"[stdout]\n{i * 100 + j}" for i in range(4) for j in range(3)}
    assert len(sandbox.worker_pids()) == 2


def test_session_timeout_raises_timeout_error(sandbox):
    with closing(sandbox.session(timeout=0.5)) as s:
        with pytest.raises(TimeoutError, match=r"longer than 0.5 s.*\n\[stdout\]\nbegun"):
            s.python("print('begun', flush=True)\nwhile True: pass")
        assert s.python("print('ok')") == "[stdout]\nok"


def test_python_tool_is_a_per_episode_tool(sandbox):
    per_episode = python_tool(sandbox)
    assert isinstance(per_episode, PerEpisode)
    obj, tools = per_episode.create()
    try:
        assert isinstance(obj, PythonSession) and [t.name for t in tools] == ["python"]
        assert tools[0].parameters["required"] == ["code"]
        assert tools[0].check_arguments({"code": "print(1)"}) is None
        assert tools[0].fn(code="print(3 * 3)") == "[stdout]\n9"
    finally:
        obj.close()


def test_close_kills_every_worker():
    sb = PythonSandbox(workers=2)
    s = sb.session()
    sb.run("pass", workdir=s.workdir)
    pids = sb.worker_pids()
    assert len(pids) == 2 and all(alive(p) for p in pids)
    pids += [p for z in pids for p in descendants(z)]  # the standby helpers and their code processes
    sb.close()
    sb.close()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)  # the kernel delivers the kills of the helpers' code processes right after theirs
    assert sb.worker_pids() == [] and not any(alive(p) for p in pids)
    assert not os.path.exists(sb.root)
    with pytest.raises(SandboxError, match="closed"):
        sb.run("pass", workdir=".")
    s.close()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"timeout": 0}, ValueError),
        ({"timeout": -1}, ValueError),
        ({"timeout": "1"}, TypeError),
        ({"timeout": float("inf")}, TypeError),
        ({"memory_mb": 16}, ValueError),
        ({"workers": 0}, ValueError),
        ({"workers": 1.5}, TypeError),
        ({"max_output_chars": 0}, ValueError),
        ({"disk_mb": 0}, ValueError),
        ({"call_limits": "cgroups"}, ValueError),
    ],
)
def test_bad_construction(kwargs, error):
    with pytest.raises(error, match=next(iter(kwargs))):
        PythonSandbox(**kwargs)


def test_bad_calls(sandbox, session, tmp_path):
    with pytest.raises(TypeError, match="code must be a str"):
        sandbox.run(b"print(1)", workdir=session.workdir)
    with pytest.raises(ValueError, match="timeout"):
        sandbox.run("pass", workdir=session.workdir, timeout=0)
    with pytest.raises(TypeError, match="timeout"):
        sandbox.run("pass", workdir=session.workdir, timeout=True)
    with pytest.raises(ValueError, match="existing directory"):
        sandbox.run("pass", workdir=tmp_path / "missing")
    with pytest.raises(TypeError, match="PythonSandbox"):
        python_tool(object())


NO_NAMESPACES = """
import ctypes, os, warnings
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.geteuid(), os.getegid()
assert libc.unshare(0x10000000) == 0, os.strerror(ctypes.get_errno())  # a user namespace of its own, in which
for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
with open("/proc/sys/user/max_user_namespaces", "w") as f:  # ... no further user namespace may be made
    f.write("0")
from chatenv.tools.sandbox import PythonSandbox, SandboxError
try:
    PythonSandbox(workers=1)
    print("started")
except SandboxError as e:
    print("refused:", e)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with PythonSandbox(workers=1, isolation="none") as sb:
        s = sb.session()
        code = "import os, socket\\nprint(os.getpid() > 1)\\nsocket.create_connection(('127.0.0.1', 9))"
        r = sb.run(code, workdir=s.workdir)
        print(r.stdout.strip(), r.error.splitlines()[-1])
        print(*(str(w.message) for w in caught))
"""


@pytest.mark.slow
def test_without_namespaces_it_refuses_unless_told_isolation_none():
    out = subprocess.run([sys.executable, "-c", NO_NAMESPACES], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    refused, ran, warned = out.stdout.splitlines()[0], out.stdout.splitlines()[-2], out.stdout.splitlines()[-1]
    assert refused.startswith("refused: the sandbox could not start: the sandbox could not isolate the code:")
    assert 'pass isolation="none"' in out.stdout
    assert ran == "True PermissionError: network access is disabled in this sandbox (socket.getaddrinfo was refused)"
    assert warned.startswith('PythonSandbox(isolation="none"): the code is bound only by rlimits')


def test_bad_isolation_and_paths():
    with pytest.raises(ValueError, match="isolation must be one of"):
        PythonSandbox(isolation="docker")
    with pytest.raises(TypeError, match="paths must be a list of absolute paths"):
        PythonSandbox(paths="relative/dir")
    with pytest.raises(ValueError, match="the sandbox.s own"):
        PythonSandbox(paths=["/proc/1"])


def test_extra_paths_are_visible_read_only(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "table.csv").write_text("a,b\n")
    tmp_path.chmod(0o755)
    data.chmod(0o755)
    (data / "table.csv").chmod(0o644)
    with PythonSandbox(workers=1, paths=[str(data)]) as sb, closing(sb.session()) as s:
        r = sb.run(f"print(open('{data}/table.csv').read().strip())\nopen('{data}/new', 'w')", workdir=s.workdir)
        assert r.stdout == "a,b\n" and "Read-only file system" in r.error


def test_limits_are_reported_and_the_peak_is_counted(sandbox, session):
    assert set(sandbox.limits) == {"memory", "processes", "disk", "cpu"}
    assert sandbox.limits["disk"] == "tmpfs" and sandbox.limits["memory"] in ("cgroup1", "cgroup2", "watchdog")
    r = run(sandbox, session, "block = bytearray(100 << 20)\nblock[::4096] = b'1' * ((100 << 20) // 4096)")
    assert r.ok and r.limits == sandbox.limits and r.exceeded is None
    assert 100 <= r.memory_peak_mb <= 512  # the code touched 100 MiB; memory_mb=512 bounds the call
    small = run(sandbox, session, "print(1)")
    assert small.memory_peak_mb < 100


def test_one_allocation_over_memory_mb_is_a_memory_result(sandbox, session):
    r = run(sandbox, session, "x = bytearray(600 << 20)")
    assert r.error.rstrip().endswith("MemoryError") and r.exceeded == "memory" and r.killed is None


def test_files_travel_as_files_links_as_links(sandbox, session, tmp_path):
    target = tmp_path / "outside.txt"
    target.write_text("host file")
    code = (
        "import os\n"
        "os.makedirs('sub/deeper')\n"
        "open('sub/deeper/data.bin', 'wb').write(bytes(range(256)) * 4)\n"
        "os.chmod('sub/deeper/data.bin', 0o640)\n"
        "os.utime('sub/deeper/data.bin', (1_000_000_000, 1_000_000_000))\n"
        f"os.symlink({str(target)!r}, 'link')\n"
        "os.mkfifo('pipe')\n"
        "print(sorted(os.listdir('.')))"
    )
    r = run(sandbox, session, code)
    assert r.ok and r.stdout == "['link', 'pipe', 'sub']\n", r.text()
    data = os.path.join(session.workdir, "sub", "deeper", "data.bin")
    with open(data, "rb") as f:
        assert f.read() == bytes(range(256)) * 4
    info = os.stat(data)
    assert info.st_mode & 0o777 == 0o640 and info.st_mtime == 1_000_000_000
    link = os.path.join(session.workdir, "link")
    assert os.path.islink(link) and os.readlink(link) == str(target)  # kept as a link, never read through
    assert not os.path.exists(os.path.join(session.workdir, "pipe"))  # FIFOs, devices, sockets are not kept
    again = run(
        sandbox, session, "import os\nprint(sorted(os.listdir('.')), len(open('sub/deeper/data.bin', 'rb').read()))"
    )
    assert again.stdout == "['link', 'sub'] 1024\n"
    assert target.read_text() == "host file"


def test_an_episode_folder_over_the_quota_is_refused(tmp_path):
    with PythonSandbox(workers=1, file_mb=4, disk_mb=2) as sb, closing(sb.session()) as s:
        with open(os.path.join(s.workdir, "big.bin"), "wb") as f:
            f.write(b"x" * (3 << 20))
        r = sb.run("print('ran')", workdir=s.workdir)
        assert r.stdout == "" and r.exceeded == "disk" and "holds more than disk_mb=2 MiB" in r.killed
        os.remove(os.path.join(s.workdir, "big.bin"))
        assert sb.run("print('ran')", workdir=s.workdir).stdout == "ran\n"


NO_CGROUPS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x00020000) == 0  # a mount namespace of its own, in which no cgroup file system is mounted
assert libc.mount(None, b"/", None, (1 << 14) | (1 << 18), None) == 0  # MS_REC | MS_PRIVATE
if os.path.ismount("/sys/fs/cgroup"):
    assert libc.umount2(b"/sys/fs/cgroup", 2) == 0, os.strerror(ctypes.get_errno())
from chatenv.tools.sandbox import PythonSandbox, SandboxError
try:
    PythonSandbox(workers=1, call_limits="cgroup")
    print("started")
except SandboxError as e:
    print("refused:", e)
with PythonSandbox(workers=1, max_processes=16) as sb:
    s = sb.session()
    r = sb.run("print('ran')", workdir=s.workdir)
    print(sb.limits, r.stdout.strip(), r.limits == sb.limits)
"""


@pytest.mark.slow
def test_without_cgroups_auto_falls_back_and_cgroup_is_refused():
    out = subprocess.run([sys.executable, "-c", NO_CGROUPS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    refused, report = out.stdout.splitlines()
    assert refused.startswith('refused: call_limits="cgroup": this process may not make memory and pids cgroups')
    assert 'pass call_limits="auto"' in refused and "(no cgroup hierarchy found)" in refused  # says why
    limits = {"memory": "watchdog", "processes": "rlimit", "disk": "tmpfs", "cpu": "rlimit"}
    assert report == f"{limits} ran True"


def test_the_trainers_files_keep_their_owner_and_protection(sandbox, session):
    reference = os.path.join(session.workdir, "reference.txt")
    with open(reference, "w") as f:
        f.write("given")
    os.chmod(reference, 0o644)
    r = run(sandbox, session, "open('reference.txt', 'a').write('changed')\nprint('written')")
    if sandbox.code_uid != os.geteuid():  # a root trainer: the code is nobody and may not write the trainer's file
        assert "PermissionError" in r.error and r.stdout == ""
    else:  # the code runs as the trainer's own user
        assert r.ok and r.stdout == "written\n"
    assert os.stat(reference).st_uid == os.geteuid() and os.stat(reference).st_mode & 0o777 == 0o644
    with open(reference) as f:
        assert f.read() == ("given" if sandbox.code_uid != os.geteuid() else "givenchanged")


LOCKED = (
    "import os\n"
    "os.makedirs('locked/inner')\n"
    "open('locked/inner/notes.txt', 'w').write('kept')\n"
    "for path in ('locked/inner/notes.txt', 'locked/inner', 'locked'):\n"
    "    os.chmod(path, 0)\n"
    "print(oct(os.stat('locked').st_mode & 0o777))"
)


def test_folders_the_code_locks_stay_readable_and_removable_by_the_host(sandbox):
    s = sandbox.session()
    r = run(sandbox, s, LOCKED)
    assert r.ok and r.stdout == "0o0\n", r.text()
    locked = os.path.join(s.workdir, "locked")
    assert os.stat(locked).st_mode & 0o777 == 0o700 and os.stat(f"{locked}/inner").st_mode & 0o777 == 0o700
    assert os.stat(f"{locked}/inner/notes.txt").st_mode & 0o777 == 0o600
    fork = copy.deepcopy(s)  # a forked episode copies the folder: a mode-0 file or folder would stop it
    with open(os.path.join(fork.workdir, "locked", "inner", "notes.txt")) as f:
        assert f.read() == "kept"
    assert run(sandbox, s, "print(open('locked/inner/notes.txt').read())").stdout == "kept\n"  # copied in again
    for done in (s, fork):
        done.close()
        assert not os.path.exists(done.workdir)


REMOVE_AS_CODE_USER = """
import os, shutil, sys
from chatenv.tools.sandbox import quota
top = sys.argv[1]
if os.geteuid() == 0:
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
for name in ("plain", "fixed"):
    os.makedirs(f"{top}/{name}/a/b")
    open(f"{top}/{name}/a/b/f", "w").write("x")
    os.chmod(f"{top}/{name}/a/b", 0)
    os.chmod(f"{top}/{name}/a", 0)
shutil.rmtree(f"{top}/plain", ignore_errors=True)
quota.remove_tree(f"{top}/fixed")
print(os.path.exists(f"{top}/plain"), os.path.exists(f"{top}/fixed"))
"""


def test_remove_tree_removes_folders_of_mode_zero_without_privilege():
    """As a user without CAP_DAC_OVERRIDE (nobody, where the test runs as root) a plain rmtree leaves them behind."""
    top = tempfile.mkdtemp(dir="/tmp")  # a folder every user can reach
    os.chmod(top, 0o777)
    try:
        out = subprocess.run(
            [sys.executable, "-c", REMOVE_AS_CODE_USER, top], capture_output=True, text=True, timeout=60
        )
    finally:
        subprocess.run(["rm", "-rf", top], check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "True False\n"  # the control (shutil.rmtree) kept its tree; remove_tree removed all


DEEP = "import os\nfor _ in range(1100):\n    os.mkdir('d')\n    os.chdir('d')\nprint('made')"
DEPTH = "import os\nn, p = 0, 'd'\nwhile os.path.isdir(p):\n    n, p = n + 1, p + '/d'\nprint(n)"


def test_a_tree_deeper_than_the_recursion_limit_travels_and_goes(sandbox):
    s = sandbox.session()
    r = run(sandbox, s, DEEP)
    assert r.ok and r.stdout == "made\n" and r.killed is None, r.text()
    assert run(sandbox, s, DEPTH).stdout == "1100\n"  # copied back whole, copied in again whole
    assert run(sandbox, s, "import shutil; shutil.rmtree('d', ignore_errors=True); print('ok')").ok
    run(sandbox, s, DEEP)
    s.close()  # removed at any depth
    assert not os.path.exists(s.workdir)


def test_call_cgroups_are_never_reused():
    groups = cgroups.detect(f"chatenv-test-{os.getpid()}")
    if set(groups) != set(cgroups.CONTROLLERS):
        pytest.skip("this process may not make memory and pids cgroups")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cgroups.make_call(groups, "one", 256, 16, sleeper.pid)
        with pytest.raises(FileExistsError):
            cgroups.make_call(groups, "one", 256, 16, sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
        cgroups.remove_base(groups)
    assert not any(os.path.exists(str(base)) for _, base in groups.values())
