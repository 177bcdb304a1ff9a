"""Torch threads never exceed the cores this process may use: its real CPU affinity, and cgroup quotas (v1, v2)."""

import os

import pytest
import torch

from chatenv.cpus import cgroup_cpu_limit, set_torch_threads, torch_threads, usable_cpus


@pytest.fixture
def one_core():
    """This process held to one core (its real affinity, restored afterwards) and torch at two threads."""
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {min(affinity)})
    torch.set_num_threads(2)
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def test_threads_above_the_affinity_are_lowered_with_a_warning(one_core):
    assert usable_cpus() == 1
    assert torch_threads(1) == (1, None)
    threads, note = torch_threads(4, name="--threads")
    assert threads == 1 and note.startswith("--threads 4 is more than the 1 core this process may use (CPU affinity")
    assert torch_threads(None)[0] == 1  # torch's own count (2 here) is capped too
    with pytest.warns(RuntimeWarning, match="threads 3 is more than the 1 core"):
        assert set_torch_threads(3) == 1
    assert torch.get_num_threads() == 1
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="--threads must be an int >= 1"):
            torch_threads(bad, name="--threads")


@pytest.mark.slow
def test_the_train_command_lowers_its_threads_and_says_so(one_core, tmp_path, capsys):
    from chatenv.cli import main

    # no model there: the run stops at set-up, after the threads are set
    code = main(["train", "--threads", "4", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "run")])
    assert code == 1
    err = capsys.readouterr().err
    assert "warning: --threads 4 is more than the 1 core this process may use" in err and "using 1 thread:" in err
    assert torch.get_num_threads() == 1


def _write(root, files):
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # cgroup v2: the smallest quota of the process's cgroup and its parents
        ({"proc": "0::/jobs/run\n", "fs/cpu.max": "max 100000\n", "fs/jobs/cpu.max": "150000 100000\n",
          "fs/jobs/run/cpu.max": "max 100000\n"}, 1.5),
        ({"proc": "0::/\n", "fs/cpu.max": "50000 100000\n"}, 0.5),  # a container's own root
        ({"proc": "0::/jobs\n", "fs/unified/jobs/cpu.max": "300000 100000\n"}, 3.0),  # hybrid: v2 at unified/
        ({"proc": "0::/jobs\n", "fs/jobs/cpu.max": "max 100000\n"}, None),
        # cgroup v1: cfs quota / period of the cpu controller; -1 is no quota
        ({"proc": "4:cpu,cpuacct:/docker/x\n1:cpuset:/\n", "fs/cpu,cpuacct/docker/x/cpu.cfs_quota_us": "200000\n",
          "fs/cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}, 2.0),
        ({"proc": "1:cpu:/\n", "fs/cpu/cpu.cfs_quota_us": "-1\n", "fs/cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"proc": "0::/\n", "fs/cpu.max": "garbage\n"}, None),
        ({}, None),  # no /proc/self/cgroup
    ],
)  # fmt: skip
def test_cgroup_cpu_quotas_are_read(tmp_path, files, expected):
    _write(tmp_path, files)
    assert cgroup_cpu_limit(tmp_path / "fs", tmp_path / "proc") == expected


def test_this_machine_has_a_limit():
    limit = cgroup_cpu_limit()
    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
    assert limit is None or usable_cpus() <= max(1, int(limit))
