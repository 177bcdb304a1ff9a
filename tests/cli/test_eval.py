"""`chatenv eval`: held-out seeds, greedy and sampled success, pass@k and success by turn."""

import itertools
import json
import math
import re

import pytest
import torch
from conftest import make_tiny_llama

from chatenv.cli import main
from chatenv.cli.eval import HELD_OUT_SEED
from chatenv.rollout.evaluation import pass_at_k_by_group, reward_by_turn, success_by_turn, summarize

torch.set_num_threads(1)

#: problems whose answer is 0 (three times in four) or 1: a reply of one digit is right about half the time
TINY_TASK = '{"max_operand": 1, "operations": ["*"], "max_attempts": 2}'


@pytest.fixture(scope="module")
def digit_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama whose every next token is "0" or "1" (equal logits, ~99% of the mass between them).

    A large bias in the last MLP makes the final hidden state point along one direction ``u`` at every position;
    the lm_head rows of "0" and "1" are ``u`` scaled up, so greedy decoding always says "0" (the lower id of a tie)
    and sampling says "0" or "1" about half the time each.
    """
    model = make_tiny_llama(0)
    gen = torch.Generator().manual_seed(7)
    u = torch.randn(64, generator=gen)
    u /= u.norm()
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.bias.copy_(1000.0 * u)
        for digit in ("0", "1"):
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(digit)] = 2.0 * u
    path = tmp_path_factory.mktemp("digit-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _eval(model_dir, out, *extra):
    return main(
        [
            "eval",
            "--model",
            str(model_dir),
            "--task-kwargs",
            TINY_TASK,
            "--max-new-tokens",
            "1",
            "--episodes",
            "8",
            "--out",
            str(out),
            *extra,
        ]
    )


def _answer(messages):
    a, b = (int(x) for x in re.search(r"What is (\d+) \* (\d+)\?", messages[0]["content"]).groups())
    return a * b


def _solved_from_chat(messages):
    """The turns (1-based) whose reply text is the problem's answer, read from the chat alone."""
    replies = [m["content"].strip() for m in messages if m["role"] == "assistant"]
    return [t + 1 for t, r in enumerate(replies) if r == str(_answer(messages))]


def _brute_pass_at_k(successes, k):
    """pass@k of one problem by enumerating every k-subset of its samples."""
    subsets = list(itertools.combinations(successes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.slow
def test_eval_reports_greedy_and_sampled_success_from_the_replies(digit_model_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert _eval(digit_model_dir, out, "--temperature", "0", "1", "--samples", "4", "--seed", "5") == 0
    table = capsys.readouterr().out
    head = ["env", "decoding", "problems", "distinct", "episodes", "pass@1", "pass@2"]
    assert table.splitlines()[0].split()[:7] == head
    results = json.loads(out.read_text())["results"]
    greedy, sampled = results
    assert [r["decoding"] for r in results] == ["greedy", "T=1"] and [r["episodes"] for r in results] == [8, 32]
    for r in results:  # held-out seeds, recorded, one per problem, every episode on its problem's seed
        assert r["seeds"] == [HELD_OUT_SEED + 5 + i for i in range(8)]
        assert all(e["seed"] == r["seeds"][e["group"]] for e in r["episodes_detail"])
        for e in r["episodes_detail"]:  # --task-kwargs reached the env: one-digit products
            assert re.fullmatch(r"What is [01] \* [01]\? .*", e["messages"][0]["content"])
            solved = _solved_from_chat(e["messages"])
            assert e["success"] == bool(solved) and e["first_success"] == (solved[0] if solved else None)
        details = r["episodes_detail"]
        # success by turn t: the episodes whose chat shows a right reply at turn t or before
        by_turn = [sum(any(s <= t for s in _solved_from_chat(e["messages"])) for e in details) for t in (1, 2)]
        assert r["success_by_turn"] == pytest.approx([n / len(details) for n in by_turn])
        # disjoint seeds, yet 4 one-digit products: the 8 held-out seeds repeat problems
        operands = {re.match(r"What is (\d) \* (\d)\?", e["messages"][0]["content"]).groups() for e in details}
        assert r["distinct_problems"] == len(operands) < 8
        assert table.splitlines()[results.index(r) + 1].split()[2:4] == ["8", str(len(operands))]
    # greedy always answers "0": right exactly on the problems whose answer is 0, at the first try
    for e in greedy["episodes_detail"]:
        assert {m["content"] for m in e["messages"] if m["role"] == "assistant"} == {"0"}
        assert e["first_success"] == (1 if _answer(e["messages"]) == 0 else None)
    # pass@k from the per-episode records, by enumeration
    groups = {}
    for e in sampled["episodes_detail"]:
        groups.setdefault(e["group"], []).append(e["success"])
    assert sorted(len(s) for s in groups.values()) == [4] * 8
    for k in (1, 2, 4):
        expected = sum(_brute_pass_at_k(s, k) for s in groups.values()) / len(groups)
        assert sampled["pass_at_k"][str(k)] == pytest.approx(expected)
    assert 0 < sampled["success"] < 1  # the sampled replies are right some of the time, not always
    assert greedy["pass_at_k"] == {"1": pytest.approx(greedy["success"])}


@pytest.mark.slow
def test_greedy_eval_is_deterministic(digit_model_dir, tmp_path):
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    for out in outs:
        assert _eval(digit_model_dir, out, "--temperature", "0", "--max-new-tokens", "3", "--envs", "3") == 0
    a, b = (json.loads(o.read_text())["results"][0] for o in outs)
    assert a["episodes_detail"] == b["episodes_detail"]
    assert (a["success"], a["success_by_turn"], a["seeds"]) == (b["success"], b["success_by_turn"], b["seeds"])


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--task-kwargs", "{oops"], "--task-kwargs is not valid JSON"),
        (["--env", "chatenv/Nope-v0"], "unknown env 'chatenv/Nope-v0'"),
        (["--env", "chatenv/TokenArithmetic-v0"], "turn-level envs"),
        (["--samples", "0"], "--samples must be >= 1"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--temperature", "0.7", "0.7"], "lists a temperature twice"),
        (["--temperature", "1e-9"], "--temperature"),
        (
            ["--env", "chatenv/Arithmetic-v0", "--env", "chatenv/GuessNumber-v0", *["--task-kwargs", "{}"] * 3],
            "once per --env (2), not 3",
        ),
    ],
)
def test_eval_refuses_bad_arguments_before_loading_a_model(tmp_path, capsys, extra, match):
    args = ["eval", "--model", str(tmp_path / "no-model"), *extra]
    assert main(args) == 2
    assert match in capsys.readouterr().err


def test_eval_refuses_a_folder_as_out(tmp_path, capsys):
    assert main(["eval", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_metrics_match_an_independent_count():
    episodes = [
        {"group": 0, "success": True, "first_success": 2, "task_rewards": [0.1, 1.1], "response_tokens": [3, 4]},
        {"group": 0, "success": True, "first_success": 1, "task_rewards": [1.0], "response_tokens": [2]},
        {"group": 0, "success": False, "first_success": None, "task_rewards": [0.0, None], "response_tokens": [5, 1]},
        {"group": 1, "success": False, "first_success": None, "task_rewards": [0.0, 0.1], "response_tokens": [1, 1]},
        {"group": 1, "success": False, "first_success": None, "task_rewards": [0.1, 0.0], "response_tokens": [2, 2]},
        {"group": 1, "success": True, "first_success": 1, "task_rewards": [1.1], "response_tokens": [9]},
    ]
    s = summarize(episodes, samples=3, turns=2)
    assert (s["episodes"], s["problems"], s["samples"]) == (6, 2, 3)
    assert s["success"] == pytest.approx(3 / 6)
    # pass@1: 2/3 and 1/3; pass@2: 1 - C(1,2)/C(3,2) = 1 and 1 - C(2,2)/C(3,2) = 2/3
    assert s["pass_at_k"] == pytest.approx({1: (2 / 3 + 1 / 3) / 2, 2: (1 + 2 / 3) / 2, 3: 1.0})
    assert s["success_by_turn"] == pytest.approx([2 / 6, 3 / 6])
    assert s["reward_by_turn"] == pytest.approx(
        [(0.1 + 1.0 + 0.0 + 0.0 + 0.1 + 1.1) / 6, (1.2 + 1.0 + 0.1 + 0.1 + 1.1) / 6]
    )
    assert s["reward"] == pytest.approx(s["reward_by_turn"][-1]) and s["turns"] == pytest.approx(10 / 6)
    assert s["response_tokens"] == pytest.approx(30 / 6)
    assert all(math.isnan(v) for v in success_by_turn([], 2))  # NaN: nothing to count
    assert reward_by_turn([[None, 2.0]], 1) == [0.0]
    assert pass_at_k_by_group(episodes, [4]) == {}  # no group holds 4 samples
