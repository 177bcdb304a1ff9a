"""The `chatenv` command on a tiny model saved to disk."""

import json

from chatenv.cli import main


def test_envs_lists_registered(capsys):
    assert main(["envs"]) == 0
    out = capsys.readouterr().out
    assert "chatenv/Arithmetic-v0" in out and "chatenv/GuessNumber-v0" in out


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
    assert len(lines) == 3 and [e["episode"] for e in lines] == [0, 1, 2]
    for e in lines:
        assert 1 <= e["turns"] <= 2 and len(e["rewards"]) == len(e["kl"]) == e["turns"]
        assert e["messages"][0]["role"] in ("system", "user")
        assert all(k is not None for k in e["kl"])
    assert (out / "curves.png").stat().st_size > 1000
    summary = capsys.readouterr().out
    assert "episodes" in summary and "KL per turn" in summary and "generated tokens / s" in summary
    assert main(["rollout", "--env", "chatenv/Nope-v0", "--out", str(out)]) == 2


def test_ctrl_c_writes_what_was_collected(tiny_model_dir, tmp_path):
    """SIGINT after the first episodes: the command exits cleanly and keeps them."""
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
        "400",
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
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONWARNINGS": "ignore"}
    )
    seen = b""
    deadline = time.time() + 300
    import re

    def progress() -> int:
        return max((int(m) for m in re.findall(rb"(\d+)/400", seen)), default=0)

    while progress() < 2 and time.time() < deadline and proc.poll() is None:
        seen += os.read(proc.stderr.fileno(), 4096)
    proc.send_signal(signal.SIGINT)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, seen[-2000:]
    lines = (out / "episodes.jsonl").read_text().splitlines()
    assert 2 <= len(lines) < 400
    assert b"episodes" in stdout
