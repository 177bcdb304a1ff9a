"""Experiment trackers: a run's config, metrics and curves sent to TensorBoard, Weights & Biases or MLflow.

``chatenv train --tracker NAME`` logs the config as hyperparameters, each step's metrics (the row
``metrics.jsonl`` gets) and, at the end, ``curves.png``; ``chatenv rollout --tracker NAME`` logs its summary.
Several trackers may be named. Each is configured as its library is (environment variables): ``WANDB_MODE``,
``WANDB_DIR``, ``WANDB_PROJECT`` (default ``chatenv``); ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``.
TensorBoard's event files go to ``<run folder>/tensorboard``.

A tracker never stops the run: one whose ``log_metrics``/``log_figure`` raises (a network error) gets a
:class:`TrackerWarning` and is logged to no more, and errors of ``close`` are warnings too (the run's own exit
code or error stands). A tracker that fails while it starts closes what it had opened (an MLflow run ends
``FAILED``), as do the trackers started before it.

=============== ================================ ============================ ==================================
tracker         package (extra)                  config                       curves.png
=============== ================================ ============================ ==================================
``tensorboard`` tensorboard (``tensorboard``)    hparams + a ``config`` text  an image (``curves``)
``wandb``       wandb (``wandb``)                the run's config             an image (``curves``)
``mlflow``      mlflow-skinny (``mlflow``)       params                       an artifact (``curves.png``)
=============== ================================ ============================ ==================================

    >>> check_trackers([])
    []
"""

from __future__ import annotations

import importlib.util
import json
import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, cast

from chatenv.errors import MissingDependencyError

__all__ = ["TRACKERS", "Tracker", "TrackerWarning", "Trackers", "check_trackers", "numeric_metrics", "open_trackers"]

#: tracker name -> (module that must be importable, pip extra)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}


class TrackerWarning(UserWarning):
    """A tracker failed (logging or closing); the run goes on without it."""


class Tracker(Protocol):
    """What a run sends to one tracker."""

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log one step's numbers."""

    def log_figure(self, path: Path, step: int) -> None:
        """Log a figure (a PNG file)."""

    def close(self, failed: bool = False) -> None:
        """Finish the run (``failed``: it stopped on an error)."""


def check_trackers(names: Iterable[str] | None) -> list[str]:
    """The tracker names, checked: each known and its package installed (without importing it).

    Raises:
        ValueError: For an unknown name.
        MissingDependencyError: For a tracker whose package is not installed (naming the extra).
    """
    out: list[str] = []
    for name in names or ():
        if name not in TRACKERS:
            raise ValueError(f"unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        module, extra = TRACKERS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingDependencyError(
                f"--tracker {name} needs the {module} package: pip install 'chatenv-gym[{extra}]' "
                "(or 'chatenv-gym[track]' for every tracker)"
            )
        if name not in out:
            out.append(name)
    return out


def numeric_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row (booleans as 0/1); other values are left out."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float))}


def _param(value: Any) -> Any:
    """A hyperparameter value trackers take: numbers, strings and booleans as they are, the rest as JSON text."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value)


class _TensorBoard:
    def __init__(self, log_dir: Path, config: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer: Any = cast(Any, SummaryWriter(log_dir=str(log_dir)))
        make_hparams: Any = hparams
        try:
            self.writer.add_text("config", "```\n" + json.dumps(dict(config), indent=2) + "\n```", 0)
            params = {k: _param(v) for k, v in config.items() if v is not None}
            for summary in make_hparams(params, {}):  # the hparams dashboard's view of the config, same event file
                self.writer.file_writer.add_summary(summary)
        except BaseException:
            self.writer.close()  # its file and its writer thread
            raise

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_figure(self, path: Path, step: int) -> None:
        from matplotlib.image import imread

        image = imread(str(path))[..., :3]
        self.writer.add_image("curves", image, step, dataformats="HWC")
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, name: str, config: Mapping[str, Any]):
        import wandb

        self.wandb = wandb
        project = os.environ.get("WANDB_PROJECT", "chatenv")
        self.run = wandb.init(project=project, name=name, config=dict(config), reinit="create_new")

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_figure(self, path: Path, step: int) -> None:
        self.run.log({"curves": self.wandb.Image(str(path))}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _MLflow:
    def __init__(self, name: str, config: Mapping[str, Any]):
        import mlflow

        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=name, nested=mlflow.active_run() is not None)
        self.run_id = self.run.info.run_id
        try:
            mlflow.log_params({k: _param(v) for k, v in config.items()})
        except BaseException:
            mlflow.end_run(status="FAILED")  # left active, the next run would start as its child
            raise

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.mlflow.log_metrics(dict(metrics), step=step, run_id=self.run_id)

    def log_figure(self, path: Path, step: int) -> None:
        self.mlflow.log_artifact(str(path), run_id=self.run_id)

    def close(self, failed: bool = False) -> None:
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


class Trackers:
    """Every tracker of a run, called together.

    Args:
        names: Tracker names (:data:`TRACKERS`), checked with :func:`check_trackers`.
        run_dir: The run folder (TensorBoard writes to ``run_dir/tensorboard``).
        config: The run's settings, logged as hyperparameters.
        name: The run's name in the trackers (default: the folder's name).

    A tracker whose logging raises is warned about (:class:`TrackerWarning`, once) and dropped: the run goes on.
    When one fails to start, the trackers already started are closed (as failed) and its error is raised.

    Raises:
        ValueError, MissingDependencyError: As :func:`check_trackers`.
    """

    def __init__(
        self,
        names: Iterable[str] | None,
        run_dir: str | os.PathLike[str],
        config: Mapping[str, Any],
        name: str | None = None,
    ):
        self.names = check_trackers(names)
        self.run_dir = Path(run_dir)
        title = name or self.run_dir.resolve().name
        self.trackers: dict[str, Tracker] = {}  # the trackers still logged to
        self._dropped: dict[str, Tracker] = {}  # those whose logging failed: closed at the end
        try:
            for tracker in self.names:
                self.trackers[tracker] = self._open(tracker, title, config)
        except BaseException:
            self.close(failed=True)
            raise

    def _open(self, tracker: str, title: str, config: Mapping[str, Any]) -> Tracker:
        if tracker == "tensorboard":
            return _TensorBoard(self.run_dir / "tensorboard", config)
        if tracker == "wandb":
            return _Wandb(title, config)
        return _MLflow(title, config)

    def log_metrics(self, row: Mapping[str, Any], step: int) -> None:
        """Log the numbers of one metrics row (:func:`numeric_metrics`) at ``step``."""
        metrics = numeric_metrics(row)
        if metrics:
            for name, tracker in list(self.trackers.items()):
                try:
                    tracker.log_metrics(metrics, step)
                except Exception as e:
                    self._drop(name, "log the metrics", e)

    def log_figure(self, path: str | os.PathLike[str] | None, step: int) -> None:
        """Log a PNG figure (``curves.png``; nothing when ``path`` is None or missing)."""
        if path is not None and Path(path).is_file():
            for name, tracker in list(self.trackers.items()):
                try:
                    tracker.log_figure(Path(path), step)
                except Exception as e:
                    self._drop(name, "log the figure", e)

    def _drop(self, name: str, what: str, error: Exception) -> None:
        """Warn that tracker ``name`` failed and log nothing more to it."""
        self._dropped[name] = self.trackers.pop(name)
        message = f"tracker {name} could not {what} ({type(error).__name__}: {error}); the run goes on without it"
        warnings.warn(message, TrackerWarning, stacklevel=3)

    def close(self, failed: bool = False) -> None:
        """Finish every tracker's run (once), each even when another's ``close`` raises.

        A tracker whose ``close`` raises is warned about (:class:`TrackerWarning`), not raised: the run's own
        exit code or error stands. A tracker dropped for a logging error is closed as failed.
        """
        trackers = [(name, tracker, failed) for name, tracker in self.trackers.items()]
        trackers += [(name, tracker, True) for name, tracker in self._dropped.items()]
        self.trackers, self._dropped = {}, {}
        for name, tracker, tracker_failed in trackers:
            try:
                tracker.close(tracker_failed)
            except Exception as e:
                message = f"tracker {name} could not close ({type(e).__name__}: {e})"
                warnings.warn(message, TrackerWarning, stacklevel=2)


def open_trackers(
    names: Iterable[str] | None, run_dir: str | os.PathLike[str], config: Mapping[str, Any], name: str | None = None
) -> Trackers:
    """:class:`Trackers` of a run (none for no names): see its arguments."""
    return Trackers(names, run_dir, config, name)
