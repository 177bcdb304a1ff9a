"""PythonSandbox: real worker processes, real limits, real kills (Linux)."""

from __future__ import annotations

import os
import threading
import time
from contextlib import closing

import pytest

from chatenv.tools.base import PerEpisode
from chatenv.tools.sandbox import PythonSandbox, PythonSession, SandboxError, python_tool


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


def test_fd_level_writes_are_captured_and_keep_the_protocol(sandbox, session):
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
    assert after.ok and after.stdout == "next\n" and after.worker_pid == r.worker_pid


def test_runaway_is_killed_and_replaced(sandbox, session):
    before = run(sandbox, session, "pass").worker_pid
    t = time.monotonic()
    r = run(sandbox, session, "print('started', flush=True)\nwhile True: pass", timeout=1.0)
    assert time.monotonic() - t < 2.0
    assert r.timed_out and "timed out after 1 s" in r.killed and r.stdout == "started\n"
    assert r.worker_pid == before and not alive(before)
    assert before not in sandbox.worker_pids()
    again = run(sandbox, session, "print(2 + 2)")
    assert again.ok and again.stdout == "4\n" and again.worker_pid != before


def test_killed_runaway_leaves_no_process(sandbox, session):
    code = (
        "import subprocess\n"
        "p = subprocess.Popen(['sleep', '60'])\n"
        "q = subprocess.Popen(['sh', '-c', 'sleep 60 & echo $!'], stdout=subprocess.PIPE, start_new_session=True)\n"
        "print(p.pid, int(q.stdout.readline()), flush=True)\n"
        "while True: pass\n"
    )
    r = run(sandbox, session, code, timeout=1.0)
    assert r.timed_out
    pids = [int(p) for p in r.stdout.split()] + [r.worker_pid]
    assert len(pids) == 3
    assert not any(alive(p) for p in pids)


def test_crashed_worker_leaves_no_process(sandbox, session):
    r = run(
        sandbox, session, "import os, subprocess\nprint(subprocess.Popen(['sleep', '60']).pid, flush=True)\nos._exit(3)"
    )
    assert r.killed == "the worker exited with status 3 (did the code call os._exit or exec?)"
    assert not alive(int(r.stdout)) and not alive(r.worker_pid)
    assert run(sandbox, session, "print('next')").stdout == "next\n"


def test_processes_do_not_outlive_a_normal_call(sandbox, session):
    r = run(sandbox, session, "import subprocess\nprint(subprocess.Popen(['sleep', '60']).pid)")
    assert r.ok
    assert not os.path.exists(f"/proc/{int(r.stdout)}")  # killed and reaped by the worker
    assert run(sandbox, session, "print(1)").worker_pid == r.worker_pid


def test_memory_bombs_fail_without_harming_the_pool(sandbox, session):
    r = run(sandbox, session, "x = bytearray(4 * 1024**3)")
    assert "MemoryError" in r.error
    assert run(sandbox, session, "print('fine')").stdout == "fine\n"
    r = run(sandbox, session, "chunks = []\nwhile True:\n    chunks.append(bytearray(10**6))")
    assert (r.error and "MemoryError" in r.error) or r.killed
    assert run(sandbox, session, "print('still fine')").stdout == "still fine\n"
    assert len(sandbox.worker_pids()) == 2


def test_network_is_refused(sandbox, session):
    r = run(sandbox, session, "import socket\nsocket.create_connection(('127.0.0.1', 9))")
    assert "PermissionError: network access is disabled in this sandbox" in r.error
    r = run(sandbox, session, "import socket\nsocket.getaddrinfo('localhost', 80)")
    assert "network access is disabled" in r.error


def test_network_file_size_and_fresh_processes_when_allowed():
    with PythonSandbox(workers=1, allow_network=True, file_mb=1, max_calls=1) as sb, closing(sb.session()) as s:
        r = sb.run("import socket\nsocket.create_connection(('127.0.0.1', 9))", workdir=s.workdir)
        assert "ConnectionRefusedError" in r.error
        r2 = sb.run("open('big', 'wb').write(b'x' * 2 * 1024 * 1024)", workdir=s.workdir)
        assert "File too large" in r2.error and r2.killed is None
        assert r2.worker_pid != r.worker_pid  # max_calls=1: a new process per call


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
    r = run(sandbox, session, "import os\nprint(os.getcwd() == os.path.realpath('.'), 'ZZ' in os.environ)")
    assert r.stdout == "True False\n"
    assert (
        r.ok
        and os.path.realpath(session.workdir) == run(sandbox, session, "import os; print(os.getcwd())").stdout.strip()
    )


def test_warm_workers_are_reused(sandbox, session):
    pids = {run(sandbox, session, "pass").worker_pid for _ in range(5)}
    assert len(pids) == 1 and pids <= set(sandbox.worker_pids())


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
    sb.close()
    sb.close()
    assert sb.worker_pids() == [] and not any(os.path.exists(f"/proc/{p}") for p in pids)
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
