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
