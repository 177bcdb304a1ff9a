"""A run's output folder: never overwritten by accident, each episode written as it completes.

``episodes.jsonl`` holds one episode record per line (:mod:`chatenv.rollout.records`: the one episode JSONL schema
of the project). It is appended to one complete line at a time, flushed and synced, so a crash loses at most the
episodes in flight and the file stays readable up to its last complete line (a failed write, e.g. a full disk,
is cut back to that line). ``config.json`` records the arguments; ``curves.png`` plots reward and KL per turn
(``chatenv rollout``) or per training step (``chatenv train``, whose per-step metrics go to ``metrics.jsonl`` the
same way; its held-out evaluations, ``--eval-every``, to ``eval.jsonl``).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

from chatenv.errors import RunDirError

__all__ = ["RunDir", "RunDirError"]

EPISODES = "episodes.jsonl"
#: the file that marks a folder as a chatenv run (``--overwrite`` replaces only such folders)
MARKER = ".chatenv-run"
METRICS = "metrics.jsonl"
EVALS = "eval.jsonl"


class RunDir:
    """The output folder of one ``chatenv rollout``.

    A run folder carries a ``.chatenv-run`` marker. A folder with other files and no marker is never used (nor
    deleted); a marked folder whose run never wrote an episode (it failed at the start) is reused as it is.

    Args:
        path: The folder (created).
        overwrite: Replace an existing run (only a folder with the marker).
        resume: Append to an existing run's ``episodes.jsonl``: every valid line is kept and counted; lines that
            do not parse move to ``episodes.quarantine.jsonl`` (with their line numbers), never lost.

    Raises:
        RunDirError: For a non-empty folder that is not a run, an existing run without ``overwrite``/``resume``,
            or a folder that is not writable.
    """

    def __init__(self, path: str | os.PathLike[str], *, overwrite: bool = False, resume: bool = False):
        if overwrite and resume:
            raise RunDirError("--overwrite and --resume exclude each other")
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"--out {self.path} exists and is not a folder")
        existing = self.path.is_dir() and any(self.path.iterdir())
        # a run written before runs were marked: its config and its episodes or metrics
        legacy = (self.path / "config.json").is_file() and any((self.path / n).is_file() for n in (EPISODES, METRICS))
        marked = (self.path / MARKER).is_file() or legacy
        if existing and not marked:
            raise RunDirError(
                f"--out {self.path} holds files that are not a chatenv run (no {MARKER} marker); nothing in it is "
                "touched: choose an empty or new folder"
            )
        started = existing and any((self.path / name).exists() for name in (EPISODES, METRICS))
        if started and not (overwrite or resume):
            raise RunDirError(
                f"--out {self.path} already holds a run; pass --resume to add episodes to it, --overwrite to replace "
                "it, or choose another folder"
            )
        if overwrite and existing:
            shutil.rmtree(self.path)  # a marked run folder, and only one
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / MARKER).write_text("a chatenv run folder: --overwrite may replace it\n")
        except OSError as e:
            raise RunDirError(f"--out {self.path} is not writable: {e.strerror or e}") from e
        self.episodes_file = self.path / EPISODES
        self.metrics_file = self.path / METRICS
        self.evals_file = self.path / EVALS
        self.episodes: list[dict[str, Any]] = self._read_existing(self.episodes_file) if resume else []
        #: one dict per training step (``chatenv train``)
        self.metrics: list[dict[str, Any]] = self._read_existing(self.metrics_file) if resume else []
        #: one dict per held-out evaluation and temperature (``chatenv train --eval-every``)
        self.evals: list[dict[str, Any]] = self._read_existing(self.evals_file) if resume else []

    def _read_existing(self, path: Path) -> list[dict[str, Any]]:
        """Every valid line of a run's JSONL file; lines that do not parse move to ``<name>.quarantine.jsonl``."""
        if not path.exists():
            return []
        out, bad = [], []
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="surrogateescape").splitlines(), 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                out.append(row)
            elif line.strip():
                bad.append((n, line))
        if bad:
            quarantine = path.with_suffix(".quarantine.jsonl")
            with open(quarantine, "a", encoding="utf-8", errors="surrogateescape") as f:
                for n, line in bad:
                    f.write(json.dumps({"line": n, "text": line}, ensure_ascii=False) + "\n")
            lines = ", ".join(str(n) for n, _ in bad[:10]) + (" ..." if len(bad) > 10 else "")
            print(
                f"warning: {path}: {len(bad)} line(s) that do not parse ({lines}) moved to {quarantine}; the "
                f"{len(out)} valid ones are kept",
                file=sys.stderr,
            )
            self._rewrite(path, out)  # appends start on a line boundary; what did not parse is kept aside
        elif not path.read_bytes().endswith(b"\n") and out:
            self._rewrite(path, out)
        return out

    @staticmethod
    def _rewrite(path: Path, rows: list[dict[str, Any]]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in rows), encoding="utf-8")
        os.replace(tmp, path)

    def append(self, episodes: list[dict[str, Any]]) -> None:
        """Write episodes (one line each) and sync them to disk.

        Raises:
            RunDirError: If the write fails (e.g. a full disk); the file is cut back to its last complete line.
        """
        self._append(self.episodes_file, episodes, self.episodes)

    def append_metrics(self, row: dict[str, Any]) -> None:
        """Write one training step's metrics to ``metrics.jsonl`` and sync it (see :meth:`append`)."""
        self._append(self.metrics_file, [row], self.metrics)

    def append_evals(self, rows: list[dict[str, Any]]) -> None:
        """Write held-out evaluation rows to ``eval.jsonl`` and sync them (see :meth:`append`)."""
        self._append(self.evals_file, rows, self.evals)

    @staticmethod
    def _append(path: Path, rows: list[dict[str, Any]], kept: list[dict[str, Any]]) -> None:
        if not rows:
            return
        data = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in rows).encode("utf-8")
        with open(path, "ab", buffering=0) as f:
            size = f.tell()
            try:
                if f.write(data) != len(data):
                    raise OSError(errno.ENOSPC, "short write")
                os.fsync(f.fileno())
            except OSError as e:
                with contextlib.suppress(OSError):  # cut back to the last complete line where the file allows it
                    f.truncate(size)
                raise RunDirError(
                    f"could not write to {path}: {e.strerror or e}; the {len(kept)} lines written before are intact"
                ) from e
        kept.extend(rows)

    def check_config(self, config: dict[str, Any], keys: tuple[str, ...]) -> str | None:
        """For a resumed run: what differs from the saved ``config.json`` in ``keys`` (None if nothing)."""
        path = self.path / "config.json"
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        diff = [
            f"--{k.replace('_', '-')} {saved.get(k)!r} -> {config.get(k)!r}"
            for k in keys
            if saved.get(k) != config.get(k)
        ]
        if diff:
            return f"--resume: the run in {self.path} was made with other settings ({'; '.join(diff)}); use a new --out"
        return None

    def write_config(self, config: dict[str, Any]) -> None:
        """Save the run's arguments as ``config.json``."""
        (self.path / "config.json").write_text(json.dumps(config, indent=2))

    def plot(self) -> Path | None:
        """``curves.png``: mean task reward and mean KL per turn (needs matplotlib, the ``plot`` extra)."""
        episodes = self.episodes
        if not episodes:
            return None
        plt = _pyplot()
        if plt is None:
            return None
        turns = max(e["turns"] for e in episodes)
        x = range(1, turns + 1)
        reward = [statistics.mean(e["task_rewards"][t] for e in episodes if e["turns"] > t) for t in range(turns)]
        kls = [[e["kl"][t] for e in episodes if e["turns"] > t and e["kl"][t] is not None] for t in range(turns)]
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        axes[0].plot(x, reward, marker="o")
        axes[0].set(xlabel="turn", ylabel="mean task reward", title="reward per turn")
        if any(kls):
            axes[1].plot(x, [statistics.mean(k) if k else float("nan") for k in kls], marker="o")
        axes[1].set(xlabel="turn", ylabel="mean KL (sum over the turn)", title="KL per turn")
        return self._save(fig, plt)

    def _save(self, fig: Any, plt: Any) -> Path:
        fig.tight_layout()
        path = self.path / "curves.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

    def plot_steps(self, title: str = "") -> Path | None:
        """``curves.png`` of a training run: task reward (and success rate) and KL per step, from :attr:`metrics`.

        Held-out evaluations (:attr:`evals`) add their success per decoding, at the number of updates made.
        """
        rows = self.metrics
        if not rows:
            return None
        plt = _pyplot()
        if plt is None:
            return None
        x = [r["step"] for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
        axes[0].plot(x, [r.get("task_reward", r.get("reward")) for r in rows], marker="o", label="task reward")
        if all("success" in r for r in rows):
            axes[0].plot(x, [r["success"] for r in rows], marker="s", label="success rate")
        for decoding in dict.fromkeys(r["decoding"] for r in self.evals):
            held = [r for r in self.evals if r["decoding"] == decoding]
            points = ([r["step"] for r in held], [r["success"] for r in held])
            axes[0].plot(*points, marker="^", linestyle="--", label=f"held-out success ({decoding})")
        axes[0].set(xlabel="step", ylabel="mean per episode", title=title or "reward per step")
        axes[0].legend()
        axes[1].plot(x, [r.get("kl") for r in rows], marker="o", color="tab:red")
        axes[1].set(xlabel="step", ylabel="KL to the frozen start (per token)", title="KL per step")
        return self._save(fig, plt)


def _pyplot() -> Any:
    """Matplotlib's pyplot on the Agg backend, or None (with a note) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install 'chatenv-gym[plot]')", file=sys.stderr)
        return None
    return plt
