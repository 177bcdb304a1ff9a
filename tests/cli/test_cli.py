"""The `chatenv` command on a tiny model saved to disk."""

import json
import re

import pytest

from chatenv.cli import main


def test_envs_lists_registered(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "chatenv/Arithmetic-v0" in out and "chatenv/GuessNumber-v0" in out


@pytest.mark.slow
def test_rollout_writes_trajectories_summary_and_plot(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "rollout",
            "--env",
            "chatenv/Arithmetic-v0",
            "--episodes",
            "3",
            "--max-turns",
            "2",
            "--envs",
            "2",
            "--model",
            str(tiny_model_dir),
            "--kl-coef",
            "0.05",
            "--max-new-tokens",
            "8",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    lines = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    # each episode is written as it ends (in that order), numbered from 0
    assert len(lines) == 3 and sorted(e["episode"] for e in lines) == [0, 1, 2]
    for e in lines:
        assert 1 <= e["turns"] <= 2 and len(e["rewards"]) == len(e["kl"]) == e["turns"]
        assert e["messages"][0]["role"] in ("system", "user") and e["messages"][-1]["role"] in ("assistant", "user")
        assert all(k is not None for k in e["kl"])
    assert (out / "curves.png").stat().st_size > 1000
    summary = capsys.readouterr().out
    assert "episodes" in summary and "KL per turn" in summary and "generated tokens / s" in summary
    assert main(["rollout", "--env", "chatenv/Nope-v0", "--out", str(out)]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_ctrl_c_writes_what_was_collected(tiny_model_dir, tmp_path, signame):
    """SIGINT (Ctrl-C) or SIGTERM after the first episodes: the command keeps them, says so, and exits with
    128 + the signal's number (130, 143), as shells report it, so a scheduler can tell it from a finished run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "interrupted"
    cmd = [
        sys.executable,
        "-m",
        "chatenv.cli",
        "rollout",
        "--episodes",
        "100000",  # far more than a loaded machine could finish between the progress line and the signal
        "--envs",
        "1",
        "--max-turns",
        "1",
        "--model",
        str(tiny_model_dir),
        "--max-new-tokens",
        "4",
        "--out",
        str(out),
    ]

    def default_sigint() -> None:  # a runner started in the background ignores SIGINT, and children inherit that
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        preexec_fn=default_sigint,
    )
    seen = b""
    deadline = time.time() + 300
    import re

    def progress() -> int:
        return max((int(m) for m in re.findall(rb"(\d+)/100000", seen)), default=0)

    try:
        while progress() < 2 and time.time() < deadline and proc.poll() is None:
            seen += os.read(proc.stderr.fileno(), 4096)
        proc.send_signal(getattr(signal, signame))
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + getattr(signal, signame), seen[-2000:]
    lines = (out / "episodes.jsonl").read_text().splitlines()
    assert 2 <= len(lines) < 100000
    assert b"episodes" in stdout
    said = stderr.decode().split(f"interrupted by {signame}")[-1]  # which signal, what was kept and where
    assert f"the {len(lines)} episodes collected so far are saved in {out}" in said
    assert f"exit code {128 + getattr(signal, signame)}" in said


def _run(tiny_model_dir, out, *extra, episodes=2):
    return main(
        [
            "rollout",
            "--episodes",
            str(episodes),
            "--envs",
            "2",
            "--max-turns",
            "1",
            "--model",
            str(tiny_model_dir),
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
            *extra,
        ]
    )


@pytest.mark.slow
def test_an_existing_run_is_never_replaced(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(tiny_model_dir, out) == 0
    first = (out / "episodes.jsonl").read_text()
    assert len(first.splitlines()) == 2
    capsys.readouterr()
    assert _run(tiny_model_dir, out) == 2
    assert "already holds a run; pass --resume" in capsys.readouterr().err
    assert (out / "episodes.jsonl").read_text() == first
    assert _run(tiny_model_dir, out, "--resume", episodes=3) == 0
    lines = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert sorted(e["episode"] for e in lines) == [0, 1, 2, 3, 4]
    assert (out / "episodes.jsonl").read_text().startswith(first)
    capsys.readouterr()
    assert _run(tiny_model_dir, out, "--resume", "--temperature", "0.3") == 2
    assert "made with other settings (--temperature 0.7 -> 0.3)" in capsys.readouterr().err
    assert _run(tiny_model_dir, out, "--overwrite", episodes=1) == 0
    assert len((out / "episodes.jsonl").read_text().splitlines()) == 1


def test_bad_out_and_arguments_fail_before_the_model_loads(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # the model path does not exist: an argument error must come first
    missing = str(tmp_path / "no-model")
    base = ["rollout", "--model", missing, "--episodes", "1"]
    assert main([*base, "--out", str(blocker / "sub")]) == 2
    assert "is not writable" in capsys.readouterr().err
    assert main([*base, "--out", str(blocker)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    for flag, value, match in [
        ("--kl-coef", "nan", "--kl-coef must be a finite number"),
        ("--kl-coef", "-1", "--kl-coef must be >= 0"),
        ("--kl-target", "0", "--kl-target must be > 0"),
        ("--temperature", "inf", "--temperature must be a finite number"),
        ("--engine-memory", "0", "--engine-memory must be > 0"),
    ]:
        assert main([*base, flag, value, "--out", str(tmp_path / "ok")]) == 2
        assert match in capsys.readouterr().err
    assert not (tmp_path / "ok").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-1"], "--temperature must be in [0.0, inf], got -1.0"),
        (["--temperature", "1e-5"], "--temperature is too small to sample with (1e-05"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--seed", "-2"], "--seed must be >= 0, got -2"),
    ],
)
def test_every_command_refuses_bad_sampling_flags_in_the_same_words(tmp_path, capsys, flags, message):
    missing = str(tmp_path / "no-model")  # refused before any model loads
    for command in (["rollout", "--out", str(tmp_path / "r")], ["train", "--out", str(tmp_path / "t")], ["serve"]):
        assert main([*command, "--model", missing, *flags]) == 2, command
        assert f"error: {message}" in capsys.readouterr().err, command
    assert not (tmp_path / "r").exists() and not (tmp_path / "t").exists()


@pytest.mark.slow
def test_policies_sample_as_their_flags_say_and_references_score_at_their_temperature(tiny_model_dir):
    import argparse

    from chatenv.cli.common import build_policy, engine_kwargs, reference_model

    for temperature, scored_at in ((0.7, 0.7), (0.0, 1.0)):  # greedy decoding reports the model's own log-probs
        args = argparse.Namespace(model=str(tiny_model_dir), max_new_tokens=5, temperature=temperature, seed=3)
        policy = build_policy(args)
        assert policy.settings.as_kwargs() == {"max_new_tokens": 5, "temperature": temperature, "seed": 3}
        assert policy.input_mode == "tokens"
        assert reference_model(args.model, policy, kv_cache_size=0).temperature == scored_at
    engine = engine_kwargs(str(tiny_model_dir), 0.5, 0)
    assert engine == {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 29, "max_model_len": 1024, "max_num_seqs": 1}
    assert engine_kwargs(str(tiny_model_dir), 1, 8, context=512)["max_model_len"] == 512


def test_a_full_disk_keeps_the_file_readable(tmp_path):
    from chatenv.cli.run_dir import RunDir, RunDirError

    run = RunDir(tmp_path / "run")
    run.append([{"episode": 0}])
    good = (tmp_path / "run" / "episodes.jsonl").read_text()
    full = RunDir(tmp_path / "full")
    full.episodes_file = "/dev/full"  # every write fails with ENOSPC
    with pytest.raises(RunDirError, match="No space left on device"):
        full.append([{"episode": 0}])
    assert full.episodes == []
    resumed = RunDir(tmp_path / "run", resume=True)
    assert resumed.episodes == [{"episode": 0}] and (tmp_path / "run" / "episodes.jsonl").read_text() == good
    # an incomplete last line (a crash mid-write) is dropped on resume, so appends start on a line boundary
    with open(tmp_path / "run" / "episodes.jsonl", "a") as f:
        f.write('{"episode": 1, "rew')
    resumed = RunDir(tmp_path / "run", resume=True)
    assert resumed.episodes == [{"episode": 0}]
    resumed.append([{"episode": 1}])
    assert [json.loads(x) for x in (tmp_path / "run" / "episodes.jsonl").read_text().splitlines()] == [
        {"episode": 0},
        {"episode": 1},
    ]


@pytest.mark.slow
def test_rollout_with_the_vllm_backend_starts_with_cpu_safe_defaults(tiny_model_dir, tmp_path):
    """`--backend vllm` starts a real engine with a bounded KV cache (--engine-memory), not ~92 % of the RAM."""
    import os
    import subprocess
    import sys

    pytest.importorskip("vllm")
    out = tmp_path / "vllm-run"
    cmd = [sys.executable, "-m", "chatenv.cli", "rollout", "--backend", "vllm", "--engine-memory", "0.0625"]
    cmd += ["--model", str(tiny_model_dir), "--episodes", "2", "--envs", "2", "--max-turns", "1"]
    cmd += ["--max-new-tokens", "4", "--out", str(out)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (out / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == 2 and "generated tokens / s" in done.stdout


def test_overwrite_replaces_only_run_folders(tmp_path):
    from chatenv.cli.run_dir import MARKER, RunDir, RunDirError

    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    for kwargs in ({"overwrite": True}, {"resume": True}, {}):
        with pytest.raises(RunDirError, match="not a chatenv run"):
            RunDir(precious, **kwargs)
    assert (precious / "thesis.tex").read_text() == "years of work"
    run = RunDir(tmp_path / "run")
    assert (tmp_path / "run" / MARKER).is_file()
    run.append([{"episode": 0}])
    with pytest.raises(RunDirError, match="already holds a run"):
        RunDir(tmp_path / "run")
    assert RunDir(tmp_path / "run", overwrite=True).episodes == []
    assert not (tmp_path / "run" / "episodes.jsonl").exists()


def test_a_run_that_failed_at_the_start_does_not_block_its_folder(tmp_path):
    from chatenv.cli.run_dir import RunDir

    first = RunDir(tmp_path / "run")
    first.write_config({"max_turns": 0})  # the run then failed before any episode
    again = RunDir(tmp_path / "run")  # the corrected re-run needs no --overwrite
    again.write_config({"max_turns": 2})
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"max_turns": 2}


def test_resume_keeps_every_valid_episode_and_quarantines_bad_lines(tmp_path, capsys):
    from chatenv.cli.run_dir import RunDir

    run = RunDir(tmp_path / "run")
    run.append([{"episode": 0}, {"episode": 1}])
    path = tmp_path / "run" / "episodes.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], '{"episode": 9, "oops"', "[1, 2]", lines[1], '{"episode": 2, "rew']))
    resumed = RunDir(tmp_path / "run", resume=True)
    assert resumed.episodes == [{"episode": 0}, {"episode": 1}]  # the valid line after the bad ones is kept
    quarantine = [json.loads(x) for x in (tmp_path / "run" / "episodes.quarantine.jsonl").read_text().splitlines()]
    assert [q["line"] for q in quarantine] == [2, 3, 5]
    assert quarantine[0]["text"] == '{"episode": 9, "oops"'
    assert "3 line(s) that do not parse (2, 3, 5)" in capsys.readouterr().err
    resumed.append([{"episode": 2}])
    assert [json.loads(x)["episode"] for x in path.read_text().splitlines()] == [0, 1, 2]


@pytest.mark.slow
def test_rollout_task_kwargs_reach_the_env(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _run(tiny_model_dir, out, "--task-kwargs", '{"operations": ["*"], "max_operand": 3}') == 0
    episodes = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert all(re.match(r"What is [0-3] \* [0-3]\?", e["messages"][0]["content"]) for e in episodes)
    assert json.loads((out / "config.json").read_text())["task_kwargs"] == '{"operations": ["*"], "max_operand": 3}'
    for value, match in (("{oops", "--task-kwargs is not valid JSON"), ("[1]", "must be a JSON object")):
        assert _run(tiny_model_dir, tmp_path / "bad", "--task-kwargs", value) == 2
        assert match in capsys.readouterr().err
    assert _run(tiny_model_dir, tmp_path / "bad", "--task-kwargs", '{"max_operand": 0}') == 1
    assert "max_operand must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--temperature", "-1"], "--temperature must be in [0.0, inf], got -1.0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--seed", "-2"], "--seed must be >= 0, got -2"),
    ],
)
def test_eval_refuses_bad_sampling_flags_in_the_same_words(tmp_path, capsys, flags, message):
    assert main(["eval", "--model", str(tmp_path / "no-model"), *flags]) == 2
    assert f"error: {message}" in capsys.readouterr().err
