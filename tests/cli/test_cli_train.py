"""`chatenv train` and `chatenv rollout --group-size` (pass@k) on a tiny model saved to disk."""

import itertools
import json

import pytest

from chatenv.cli import main
from chatenv.cli.rollout import pass_at_k, pass_at_k_by_group


def _train(model_dir, out, *extra, steps=2):
    return main(
        [
            "train",
            "--model",
            str(model_dir),
            "--steps",
            str(steps),
            "--prompts",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "6",
            "--threads",
            "1",
            "--out",
            str(out),
            *extra,
        ]
    )


@pytest.mark.slow
def test_train_prints_a_row_per_step_and_writes_the_run(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(tiny_model_dir, out, "--save-model") == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].split() == ["step", "reward", "success", "KL", "loss", "tokens", "seconds"]
    assert [line.split()[0] for line in printed.splitlines()[1:3]] == ["0", "1"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the first step samples from the frozen start
    assert all(m["train/groups_with_signal"] >= 0 and m["tokens"] > 0 for m in metrics)
    episodes = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 8 and [e["step"] for e in episodes].count(1) == 4
    assert sorted({e["group"] for e in episodes}) == [0, 1, 2, 3] and all("success" in e for e in episodes)
    config = json.loads((out / "config.json").read_text())
    assert config["group_size"] == 2 and config["task_kwargs"] is None
    assert (out / "curves.png").stat().st_size > 1000 and (out / "model" / "config.json").exists()
    # --resume continues from the saved weights, with the step numbers after the earlier ones
    assert _train(tiny_model_dir, out, "--resume", steps=1) == 0
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert _train(tiny_model_dir, out) == 2  # an existing run is never replaced by accident
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_an_interrupted_training_keeps_the_steps_that_finished(tiny_model_dir, tmp_path, monkeypatch, capsys, signame):
    """Ctrl-C or SIGTERM in the second step: the run keeps what finished, says so, and exits 130 or 143 (not 0)."""
    import os
    import signal

    from wrappers.grpo import GRPOLearner

    real = GRPOLearner.step

    def interrupted_second_time(self, view, **kwargs):
        if self.steps == 1:
            if signame == "SIGINT":
                raise KeyboardInterrupt  # what Ctrl-C raises (a runner in the background may ignore SIGINT itself)
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal, to this process's handler
        return real(self, view, **kwargs)

    monkeypatch.setattr(GRPOLearner, "step", interrupted_second_time)
    out, handler = tmp_path / "run", signal.getsignal(signal.SIGTERM)
    assert _train(tiny_model_dir, out, steps=3) == 128 + getattr(signal, signame)
    err = capsys.readouterr().err
    assert f"interrupted by {signame}" in err and f"are saved in {out}" in err
    assert signal.getsignal(signal.SIGTERM) == handler  # the command's handler is gone
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    steps = [json.loads(x)["step"] for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert steps.count(0) == 4 and steps.count(1) == 4  # the interrupted step's episodes are on disk too
    assert (out / "curves.png").exists()


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--group-size", "0"], "--group-size must be >= 1"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--lr", "nan"], "--lr must be a finite number"),
        (["--kl-coef", "-1"], "--kl-coef must be >= 0"),
        (["--task-kwargs", "{oops"], "--task-kwargs is not valid JSON"),
        (["--task-kwargs", "[1]"], "must be a JSON object"),
        (["--env", "chatenv/TokenArithmetic-v0"], "turn-level envs"),
        (["--resume"], "holds none"),
    ],
)
def test_train_refuses_bad_arguments_before_loading_a_model(tmp_path, capsys, extra, match):
    assert _train(tmp_path / "no-model", tmp_path / "out", *extra) == 2
    assert match in capsys.readouterr().err


@pytest.mark.slow
def test_bad_task_options_are_reported(tiny_model_dir, tmp_path, capsys):
    assert _train(tiny_model_dir, tmp_path / "out", "--task-kwargs", '{"max_operand": 0}') == 1
    assert "max_operand must be >= 1" in capsys.readouterr().err


def _brute_force(n, c, k):
    """pass@k by enumerating every k-subset of n samples, c of them successes."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_force(n, c, k))
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    eps = [{"group": 0, "success": s} for s in (True, False, False, False)]
    eps += [{"group": 1, "success": s} for s in (True, True, False, False)] + [{"group": 2, "success": True}]
    assert pass_at_k_by_group(eps, [1, 2, 4]) == pytest.approx(
        {1: (0.25 + 0.5 + 1) / 3, 2: (0.5 + 5 / 6) / 2, 4: 1.0}  # a group of one counts for k = 1 only
    )


@pytest.mark.slow
def test_rollout_with_groups_reports_pass_at_k(tiny_model_dir, tmp_path, capsys):
    base = ["rollout", "--model", str(tiny_model_dir), "--max-turns", "1", "--envs", "2", "--max-new-tokens", "4"]
    out = tmp_path / "run"
    assert main([*base, "--episodes", "4", "--group-size", "2", "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "success rate" in summary and "pass@1 (per group of 2)" in summary and "pass@2 (per group of 2)" in summary
    episodes = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert sorted(e["group"] for e in episodes) == [0, 0, 1, 1]
    assert all(e["success"] is False for e in episodes)  # a random model does not do arithmetic
    # the two episodes of a group start from the same problem
    for g in (0, 1):
        firsts = {json.dumps(e["messages"][:-1][:1]) for e in episodes if e["group"] == g}
        assert len(firsts) == 1
    assert main([*base, "--episodes", "2", "--group-size", "2", "--resume", "--out", str(out)]) == 0
    groups = [json.loads(x)["group"] for x in (out / "episodes.jsonl").read_text().splitlines()]
    assert sorted(groups) == [0, 0, 1, 1, 2, 2]  # resumed groups keep numbering after the earlier ones
    for extra, match in (
        (["--group-size", "0"], "--group-size must be >= 1"),
        (["--episodes", "3", "--group-size", "2"], "multiple of --group-size"),
    ):
        assert main([*base, *extra, "--out", str(tmp_path / "bad")]) == 2
        assert match in capsys.readouterr().err


@pytest.mark.slow
def test_train_with_turn_credit(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "turns"
    assert _train(tiny_model_dir, out, "--credit", "turn", steps=1) == 0
    assert json.loads((out / "config.json").read_text())["credit"] == "turn"
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["tokens"] > 0
    with pytest.raises(SystemExit):  # argparse refuses an unknown credit before anything runs
        main(["train", "--credit", "token", "--out", str(tmp_path / "bad")])
    assert "invalid choice: 'token'" in capsys.readouterr().err and not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_train_with_branch_credit(tiny_model_dir, tmp_path):
    out = tmp_path / "branches"
    assert _train(tiny_model_dir, out, "--credit", "branch", "--branches", "2", steps=1) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["credit"] == "branch" and config["branches"] == 2
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    episodes = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    replies = sum(sum(e["response_tokens"]) for e in episodes)
    # the branches' tokens count in the step's tokens (equal-token comparisons with the other credits)
    two_turns = sum(len(e["response_tokens"]) > 1 for e in episodes)
    assert metrics[0]["tokens"] >= replies and (metrics[0]["tokens"] > replies) == (two_turns > 0)


@pytest.mark.slow
def test_train_evaluates_on_held_out_seeds_it_never_trains_on(tiny_model_dir, tmp_path, capsys):
    from chatenv.cli.eval import HELD_OUT_SEED

    out, plain = tmp_path / "run", tmp_path / "plain"
    extra = ["--eval-every", "1", "--eval-episodes", "3", "--eval-temperature", "0", "0.5"]
    assert _train(tiny_model_dir, out, *extra) == 0
    printed = capsys.readouterr().out
    assert [line.split(",")[0] for line in printed.splitlines() if line.startswith("held-out after")] == [
        "held-out after 0 steps",
        "held-out after 1 steps",
        "held-out after 2 steps",
    ]
    assert "held-out success (greedy, 3 problems): step 0" in printed
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["decoding"], r["episodes"]) for r in evals] == [
        (s, d, 3) for s in (0, 1, 2) for d in ("greedy", "T=0.5")
    ]
    assert all(r["task_kwargs"] == {"max_operand": 9, "operations": ["+"], "max_attempts": 2} for r in evals)
    episodes = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    trained_on = {0 + e["group"] for e in episodes}  # --seed 0: group g resets with seed g
    held_out = {s for r in evals for s in r["seeds"]}
    assert trained_on == {0, 1, 2, 3} and held_out == {HELD_OUT_SEED, HELD_OUT_SEED + 1, HELD_OUT_SEED + 2}
    assert len(episodes) == 8  # the held-out episodes are not among the training ones
    # the evaluation leaves training as it was: the same episodes and steps as a run without it
    assert _train(tiny_model_dir, plain) == 0
    assert (plain / "episodes.jsonl").read_text() == (out / "episodes.jsonl").read_text()
    assert not (plain / "eval.jsonl").exists()


def test_train_refuses_seeds_that_reach_the_held_out_ones(tmp_path, capsys):
    from chatenv.cli.eval import HELD_OUT_SEED

    assert _train(tmp_path / "no-model", tmp_path / "out", "--seed", str(HELD_OUT_SEED - 3)) == 2
    assert f"training problems use seeds below {HELD_OUT_SEED}" in capsys.readouterr().err
    assert _train(tmp_path / "no-model", tmp_path / "out", "--eval-every", "0") == 2
    assert "--eval-every must be >= 1" in capsys.readouterr().err


@pytest.mark.slow
def test_train_logs_the_off_policy_numbers_and_takes_the_correction_flags(tiny_model_dir, tmp_path, capsys):
    assert _train(tiny_model_dir, tmp_path / "run") == 0
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for step, m in enumerate(metrics):
        # on-policy: the step's replies came from the weights it trains (lag 0) and the engines agree closely
        assert m["train/version_lag_max"] == 0 and m["train/policy_version"] == step + 1
        assert 0 <= m["train/mismatch_kl"] < 1e-4 and abs(m["train/is_ratio_max"] - 1) < 1e-2
        assert m["train/is_truncated_frac"] == 0 and m["train/stale_frac"] == 0 and m["train/is_masked_frac"] == 0
    flags = ("--is-level", "sequence", "--is-mode", "mask", "--is-cap", "1.5", "--max-staleness", "0")
    assert _train(tiny_model_dir, tmp_path / "masked", *flags, steps=1) == 0
    row = json.loads((tmp_path / "masked" / "metrics.jsonl").read_text())
    assert row["train/is_masked_frac"] == 0 and row["train/tokens"] == row["tokens"] > 0
    with pytest.raises(SystemExit):  # argparse refuses a cap that would weigh nothing
        _train(tiny_model_dir, tmp_path / "bad", "--is-cap", "1.0", steps=1)
    assert "argument --is-cap: expected a finite number > 1, got '1.0'" in capsys.readouterr().err


@pytest.mark.slow
def test_held_out_problems_seen_in_training_are_counted_and_resume_keeps_the_held_out_set(
    tiny_model_dir, tmp_path, capsys
):
    import gymnasium as gym

    import chatenv  # noqa: F401  (registers the envs)

    # one-digit sums of 0 and 1: 4 problems, so the 6 held-out seeds must repeat problems training saw
    task = {"max_operand": 1, "operations": ["+"], "max_attempts": 2}
    out = tmp_path / "run"
    extra = ["--task-kwargs", json.dumps(task), "--eval-every", "1", "--eval-episodes", "6", "--eval-temperature", "0"]
    assert _train(tiny_model_dir, out, *extra, "--save-model") == 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("held-out after")]
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    episodes = [json.loads(x) for x in (out / "episodes.jsonl").read_text().splitlines()]
    env = gym.make("chatenv/Arithmetic-v0", task_kwargs=task)
    for r, line in zip(evals, printed, strict=True):
        # independently: the question each held-out seed poses, against the first user message of every
        # training episode collected before the evaluation
        trained = {e["messages"][0]["content"] for e in episodes if e["step"] < r["step"]}
        held_out = [env.reset(seed=s)[0][0]["content"] for s in r["seeds"]]
        assert r["seen_in_training"] == sum(q in trained for q in held_out)
        assert r["distinct_problems"] == len(set(held_out)) <= 4
        assert f"{r['seen_in_training']} seen in training" in line
        if r["seen_in_training"] == 0:
            assert r["success_unseen"] == r["success"]
        elif r["seen_in_training"] == r["problems"]:
            assert r["success_unseen"] is None and "unseen: -" in line
        else:
            assert f"unseen: {r['success_unseen']:.3f}" in line
    assert evals[0]["seen_in_training"] == 0 and evals[-1]["seen_in_training"] > 0
    # a resumed run keeps the held-out set: another --seed or --eval-episodes is refused
    for changed in (["--seed", "1"], ["--eval-episodes", "5"]):
        assert _train(tiny_model_dir, out, *extra, *changed, "--resume", steps=1) == 2
        assert "other settings" in capsys.readouterr().err
    # and does not evaluate again the weights the earlier run evaluated last
    assert _train(tiny_model_dir, out, *extra, "--resume", steps=1) == 0
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals] == [0, 1, 2, 3]
