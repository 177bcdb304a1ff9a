"""`--tracker tensorboard|wandb|mlflow`: what train and rollout log (offline), read back and compared with the run."""

import json
import math
import sys

import pytest

from chatenv import MissingDependencyError
from chatenv.cli import main
from chatenv.tracking import Trackers, TrackerWarning, check_trackers

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker offline, writing under tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "chatenv-test")
    (tmp_path / "wandb").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return tmp_path


def _tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    return scalars, events.Tags()["images"], config


def _wandb_records(folder):
    """The records of an offline W&B run (its .wandb file: a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunk, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out


def _wandb(folder):
    history, config = {}, {}
    for record in _wandb_records(folder):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(row.get("_step"), {}).update(row)
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({u.key: json.loads(u.value_json) for u in updates})
    return history, config


def _mlflow(folder):
    import mlflow

    client = mlflow.tracking.MlflowClient(f"file:{folder / 'mlruns'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "Default"]
    (run,) = client.search_runs([experiment.experiment_id])
    metrics = {
        key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in run.data.metrics
    }
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    return metrics, run.data.params, artifacts, run.info.status


def _same(logged, expected):
    assert logged == pytest.approx(expected, rel=1e-6, abs=1e-9) or (math.isnan(logged) and math.isnan(expected))


@pytest.mark.slow
def test_train_logs_every_step_config_and_curves_to_each_tracker(tiny_model_dir, offline):
    out = offline / "run"
    args = ["train", "--model", str(tiny_model_dir), "--steps", "2", "--prompts", "2", "--group-size", "2"]
    args += ["--max-new-tokens", "6", "--threads", "1", "--out", str(out)]
    assert main([*args, "--tracker", "tensorboard", "--tracker", "wandb", "--tracker", "mlflow"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and "train/loss" in rows[0]

    scalars, images, config = _tensorboard(out)
    history, wandb_config = _wandb(offline / "wandb")
    metrics, params, artifacts, status = _mlflow(offline)
    for row in rows:
        step = row["step"]
        for key, value in row.items():
            _same(scalars[key][step], value)
            _same(history[step][key], value)
            _same(metrics[key][step], value)
    assert images == ["curves"] and artifacts == ["curves.png"]
    assert history[1]["curves/_type"] == "image-file" and history[1]["curves/path"].endswith(".png")
    assert list((offline / "wandb").glob("wandb/offline-run-*/files/" + history[1]["curves/path"]))
    assert json.loads(config.strip("`\n"))["group_size"] == 2
    assert wandb_config["group_size"] == 2 and wandb_config["tracker"] == ["tensorboard", "wandb", "mlflow"]
    assert params["group_size"] == "2" and params["env"] == "chatenv/Arithmetic-v0" and status == "FINISHED"


@pytest.mark.slow
def test_rollout_logs_its_summary(tiny_model_dir, offline):
    out = offline / "eval"
    args = ["rollout", "--episodes", "4", "--group-size", "2", "--envs", "2", "--max-turns", "2"]
    args += ["--model", str(tiny_model_dir), "--max-new-tokens", "6", "--out", str(out)]
    assert main([*args, "--tracker", "tensorboard", "--tracker", "mlflow"]) == 0
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    totals = [sum(e["task_rewards"]) for e in episodes]
    expected = {
        "episodes": 4,
        "task_reward": sum(totals) / 4,
        "success": sum(bool(e["success"]) for e in episodes) / 4,
        "turns": sum(e["turns"] for e in episodes) / 4,
        "tokens": sum(sum(e["response_tokens"]) for e in episodes),
    }
    scalars, images, config = _tensorboard(out)
    metrics, params, artifacts, _ = _mlflow(offline)
    for key, value in expected.items():
        _same(scalars[key][0], value)
        _same(metrics[key][0], value)
    assert "pass_at_1" in scalars and "pass_at_2" in metrics and "kl_per_turn" not in scalars  # no KL term in this run
    assert images == ["curves"] and artifacts == ["curves.png"] and params["episodes"] == "4"


def test_a_missing_tracker_fails_before_the_run_starts_naming_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(MissingDependencyError, match=r"pip install 'chatenv-gym\[wandb\]'"):
        check_trackers(["tensorboard", "wandb"])
    for command in ("rollout", "train"):
        out = tmp_path / command
        assert main([command, "--model", "/nonexistent", "--tracker", "wandb", "--out", str(out)]) == 2
        assert "--tracker wandb needs the wandb package: pip install 'chatenv-gym[wandb]'" in capsys.readouterr().err
        assert not out.exists()  # nothing was started
    with pytest.raises(ValueError, match="unknown tracker 'comet'"):
        check_trackers(["comet"])
    assert check_trackers(["mlflow", "mlflow"]) == ["mlflow"]


def test_a_tracker_that_cannot_start_fails_before_the_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nowhere://tracking")  # a store mlflow does not know
    monkeypatch.setattr("chatenv.cli.rollout.build_policy", lambda *a, **k: pytest.fail("the model was loaded"))
    code = main(["rollout", "--model", "/nonexistent", "--tracker", "mlflow", "--out", str(tmp_path / "run")])
    assert code == 2 and "could not start the trackers" in capsys.readouterr().err


def _mlflow_runs(folder):
    """``{run name: status}`` of the offline MLflow store."""
    import mlflow

    client = mlflow.tracking.MlflowClient(f"file:{folder / 'mlruns'}")
    ids = [e.experiment_id for e in client.search_experiments()]
    return {run.info.run_name: run.info.status for run in client.search_runs(ids)}


@pytest.fixture
def writers_closed(monkeypatch):
    """The SummaryWriters closed (a list that grows as each closes)."""
    from torch.utils.tensorboard import SummaryWriter

    closed, close = [], SummaryWriter.close

    def recorded(self):
        closed.append(self)
        close(self)

    monkeypatch.setattr(SummaryWriter, "close", recorded)
    return closed


def test_a_tracker_failing_in_its_set_up_closes_what_it_and_the_trackers_before_it_opened(
    offline, monkeypatch, writers_closed
):
    import mlflow
    from torch.utils.tensorboard import SummaryWriter

    def broken(*args, **kwargs):
        raise OSError("disk full")

    with monkeypatch.context() as m:  # tensorboard fails after mlflow started: both closed
        m.setattr(SummaryWriter, "add_text", broken)
        with pytest.raises(OSError, match="disk full"):
            Trackers(["mlflow", "tensorboard"], offline / "a", {"seed": 1})
    assert len(writers_closed) == 1 and mlflow.active_run() is None
    assert _mlflow_runs(offline) == {"a": "FAILED"}

    with monkeypatch.context() as m:  # mlflow's params fail: its run ended FAILED, not left active
        m.setattr(mlflow, "log_params", broken)
        with pytest.raises(OSError, match="disk full"):
            Trackers(["tensorboard", "mlflow"], offline / "b", {"seed": 1})
    assert len(writers_closed) == 2 and mlflow.active_run() is None
    trackers = Trackers(["mlflow"], offline / "c", {"seed": 1})  # a run of its own, not the failed one's child
    assert mlflow.active_run().data.tags.get("mlflow.parentRunId") is None
    trackers.close()
    assert _mlflow_runs(offline) == {"a": "FAILED", "b": "FAILED", "c": "FINISHED"}


def test_a_tracker_whose_close_raises_leaves_the_others_closed_and_only_warns(offline, monkeypatch, writers_closed):
    import mlflow

    trackers = Trackers(["wandb", "tensorboard", "mlflow"], offline / "run", {"seed": 1})

    def broken(failed=False):
        raise ConnectionError("wandb is unreachable")

    monkeypatch.setattr(trackers.trackers["wandb"], "close", broken)
    with pytest.warns(TrackerWarning, match=r"tracker wandb could not close \(ConnectionError: wandb is unreachable"):
        trackers.close()
    assert len(writers_closed) == 1 and mlflow.active_run() is None
    assert _mlflow_runs(offline) == {"run": "FINISHED"}
    trackers.close()  # once: nothing left to close


def test_a_tracker_whose_logging_raises_is_warned_about_once_and_dropped(offline, monkeypatch, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure = tmp_path / "curves.png"
    plt.figure(figsize=(1, 1))
    plt.savefig(figure)
    plt.close("all")
    trackers = Trackers(["tensorboard", "mlflow"], offline / "run", {"seed": 1})
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise OSError("read-only file system")

    monkeypatch.setattr(trackers.trackers["mlflow"], "log_metrics", broken)
    with pytest.warns(TrackerWarning, match=r"tracker mlflow could not log the metrics \(OSError: read-only") as seen:
        trackers.log_metrics({"loss": 1.0}, 0)
    assert len(seen) == 1
    trackers.log_metrics({"loss": 0.5}, 1)  # no second warning (warnings are errors here), mlflow not called again
    trackers.log_figure(figure, 1)
    trackers.close()
    assert len(calls) == 1
    scalars, images, _ = _tensorboard(offline / "run")
    assert scalars["loss"] == {0: 1.0, 1: 0.5} and images == ["curves"]
    assert _mlflow_runs(offline) == {"run": "FAILED"}  # its metrics are incomplete

    trackers = Trackers(["tensorboard"], offline / "figure", {"seed": 1})
    monkeypatch.setattr(trackers.trackers["tensorboard"], "log_figure", broken)
    with pytest.warns(TrackerWarning, match="tracker tensorboard could not log the figure"):
        trackers.log_figure(figure, 0)
    trackers.log_metrics({"loss": 1.0}, 0)  # dropped: nothing more to it
    trackers.close()
    assert _tensorboard(offline / "figure")[0] == {}


@pytest.mark.slow
def test_train_goes_on_when_a_tracker_cannot_log(tiny_model_dir, offline, monkeypatch):
    import mlflow

    def unreachable(*args, **kwargs):
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(mlflow, "log_metrics", unreachable)  # as a network error would
    out = offline / "run"
    args = ["train", "--model", str(tiny_model_dir), "--steps", "2", "--prompts", "2", "--group-size", "2"]
    args += ["--max-new-tokens", "6", "--threads", "1", "--out", str(out), "--tracker", "mlflow"]
    with pytest.warns(TrackerWarning, match="tracker mlflow could not log the metrics") as seen:
        assert main([*args, "--tracker", "tensorboard"]) == 0
    assert len([w for w in seen if issubclass(w.category, TrackerWarning)]) == 1
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert sorted(_tensorboard(out)[0]["train/loss"]) == [0, 1]  # the other tracker got every step
