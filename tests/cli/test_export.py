"""`chatenv export`: a real run's episodes as Parquet, a Hugging Face dataset and JSON lines, read back losslessly."""

import json
import sys

import pytest
import torch

import chatenv
from chatenv import ChatEnv, MissingDependencyError, rollout
from chatenv.cli import main
from chatenv.cli.rollout import episodes_from_rollout
from chatenv.cli.run_dir import RunDir
from chatenv.exports import SCHEMA, export_episodes, load_episodes, record_row, row_record
from chatenv.rollout.records import EpisodeRecord, records_view
from wrappers.policies import TransformersWrapper


@pytest.fixture(scope="module")
def run(tiny_model, tokenizer, tmp_path_factory):
    """A short real rollout (tiny model, two-turn arithmetic, groups) written as `chatenv rollout` writes it."""
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 6, "seed": 0}
    )
    envs = [ChatEnv("arithmetic", input_mode="tokens", max_turns=2, tokenizer=tokenizer) for _ in range(2)]
    td = rollout(envs, policy, episodes=4, group_size=2, seed=3)
    folder = tmp_path_factory.mktemp("runs") / "run"
    run_dir = RunDir(folder)
    run_dir.append(episodes_from_rollout(td, policy, 0, success_threshold=1.0))
    run_dir.write_config({"env": "arithmetic"})
    return folder, chatenv.episodes(td, pad_token_id=0)


def _assert_same_view(back, view):
    for key in ("turn_start", "turn_length", "num_turns", "terminated", "truncated", "episode", "reward"):
        assert torch.equal(back[key], view[key]), key
    torch.testing.assert_close(back["turn_reward"], view["turn_reward"], equal_nan=True)
    assert torch.equal(back["tokens"].full, view["tokens"].full)
    assert torch.equal(back["masks"].all_assistant_mask, view["masks"].all_assistant_mask)
    lp_back, lp_view = back["log_probs"].full, view["log_probs"].full
    assert torch.equal(lp_back.isnan(), lp_view.isnan()) and lp_view.isnan().any() and not lp_view.isnan().all()
    torch.testing.assert_close(lp_back, lp_view, equal_nan=True, rtol=0, atol=0)


def _raw_rows(path, fmt):
    """The rows as the format's own reader gives them."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if fmt == "hf-dataset":
        import datasets

        return datasets.load_from_disk(str(path)).to_list()
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("fmt", ["parquet", "hf-dataset", "jsonl"])
def test_export_round_trips_to_the_episode_view(run, tmp_path, fmt, capsys):
    folder, view = run
    out = tmp_path / f"export-{fmt}"
    assert main(["export", str(folder), "--format", fmt, "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    rows = _raw_rows(out, fmt)
    records = [EpisodeRecord.from_json(r) if fmt == "jsonl" else row_record(r) for r in rows]
    lines = [json.loads(line) for line in (folder / "episodes.jsonl").read_text().splitlines()]
    assert [r.to_json() for r in records] == lines  # every key and value of every line, None where NaN
    assert [r.to_json() for r in load_episodes(out, fmt)] == lines
    _assert_same_view(records_view(records), view)
    if fmt != "jsonl":  # one column per field; ids, masks and log-probs as list columns, NaN log-probs as null
        assert list(rows[0]) == list(SCHEMA) and len(rows) == 4
        first = rows[0]
        assert isinstance(first["prompt"], list) and isinstance(first["assistant_mask"][0], bool)
        assert first["log_probs"][-1] is None or isinstance(first["log_probs"][-1], float)
        assert any(v is None for r in rows for v in r["log_probs"])  # the env's feedback between the replies
        assert all(isinstance(r["group"], int) and r["kl"] == [None] * r["turns"] for r in rows)


def test_default_output_goes_into_the_run_folder_and_is_never_replaced_by_accident(run, tmp_path, capsys):
    folder, _ = run
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    assert main(["export", str(copy)]) == 0
    assert (copy / "episodes.parquet").is_file()
    assert main(["export", str(copy)]) == 2
    assert "exists; pass overwrite=True (--overwrite)" in capsys.readouterr().err
    assert main(["export", str(copy), "--overwrite"]) == 0
    assert main(["export", str(copy), "--format", "hf-dataset"]) == 0 and (copy / "episodes_dataset").is_dir()
    assert main(["export", str(copy), "--format", "hf-dataset", "--overwrite"]) == 0
    # --overwrite replaces an earlier export only: never a folder or file of another kind
    (tmp_path / "notes").mkdir()
    assert main(["export", str(copy), "--format", "hf-dataset", "--out", str(tmp_path / "notes"), "--overwrite"]) == 2
    assert "is not a saved dataset" in capsys.readouterr().err and (tmp_path / "notes").is_dir()
    assert main(["export", str(copy), "--out", str(tmp_path / "notes"), "--overwrite"]) == 2
    assert "is not a file" in capsys.readouterr().err


def test_bad_input_gets_clear_errors(run, tmp_path, capsys, monkeypatch):
    folder, _ = run
    assert main(["export", str(tmp_path)]) == 2
    assert "is not a run folder (no episodes.jsonl)" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing")]) == 2
    assert "is not a run folder" in capsys.readouterr().err
    assert main(["export", str(folder), "--format", "csv", "--out", str(tmp_path / "x")]) == 2
    assert "unknown export format 'csv'; choose one of parquet, hf-dataset, jsonl" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "episodes.jsonl").write_text('{"episode": 0}\n')
    assert main(["export", str(bad)]) == 2
    assert "episodes.jsonl:1 is not an episode record" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if the extra were not installed
    assert main(["export", str(folder), "--out", str(tmp_path / "p.parquet")]) == 2
    err = capsys.readouterr().err
    assert "needs pyarrow: pip install 'chatenv-gym[export]'" in err and not (tmp_path / "p.parquet").exists()
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(MissingDependencyError, match=r"datasets package: pip install 'chatenv-gym\[export\]'"):
        export_episodes(folder / "episodes.jsonl", tmp_path / "d", "hf-dataset")
    assert export_episodes(folder / "episodes.jsonl", tmp_path / "e.jsonl", "jsonl").is_file()  # needs neither


def test_records_without_a_token_chain_and_unknown_keys_survive(run, tmp_path):
    folder, _ = run
    line = json.loads((folder / "episodes.jsonl").read_text().splitlines()[0])
    for key in ("prompt", "completion", "assistant_mask", "log_probs", "turn_start", "group", "env_index"):
        line.pop(key, None)
    line.update(messages=None, note={"kept": [1, None]}, session="s1", segment=2)
    for fmt in ("parquet", "hf-dataset", "jsonl"):
        out = export_episodes([line], tmp_path / fmt, fmt)
        assert [r.to_json() for r in load_episodes(out, fmt)] == [line]
    assert row_record(record_row(line)).to_json() == line
