"""``chatenv export RUN_DIR --format parquet|hf-dataset|jsonl``: a run's episodes as one table (:mod:`chatenv.exports`).

One row per episode of the run's ``episodes.jsonl``, written to ``--out`` (default: ``RUN_DIR/episodes.parquet``,
``RUN_DIR/episodes_dataset/`` or ``RUN_DIR/episodes.export.jsonl``). An existing output is replaced only with
``--overwrite``, and only when it is an earlier export.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from chatenv.cli import fail
from chatenv.cli.run_dir import EPISODES, MARKER
from chatenv.errors import MissingDependencyError

__all__ = ["add_export_parser", "export_run", "run_export"]

#: where each format goes in the run folder unless ``--out`` says otherwise
DEFAULT_OUT = {"parquet": "episodes.parquet", "hf-dataset": "episodes_dataset", "jsonl": "episodes.export.jsonl"}


def add_export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``export`` subcommand to the ``chatenv`` parser."""
    run = sub.add_parser("export", help="write a run's episodes as Parquet, a Hugging Face dataset or JSON lines")
    run.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (chatenv rollout/train --out)")
    run.add_argument(
        "--format", default="parquet", help="parquet (default), hf-dataset (datasets' save_to_disk) or jsonl"
    )
    run.add_argument("--out", default=None, help="output path (default: in RUN_DIR, e.g. episodes.parquet)")
    run.add_argument("--overwrite", action="store_true", help="replace an earlier export at the output path")


def export_run(
    run_dir: str | os.PathLike[str],
    format: str = "parquet",  # noqa: A002  (the flag's word)
    out: str | os.PathLike[str] | None = None,
    *,
    overwrite: bool = False,
) -> Path:
    """Export a run folder's ``episodes.jsonl`` (:func:`chatenv.exports.export_episodes`); returns the output path.

    Raises:
        NotADirectoryError: If ``run_dir`` is not a run folder (a folder with ``episodes.jsonl``).
        ValueError, FileExistsError, MissingDependencyError: As :func:`chatenv.exports.export_episodes` raises them.
    """
    from chatenv.exports import FORMATS, export_episodes

    folder = Path(run_dir)
    if not (folder / EPISODES).is_file():
        marked = (folder / MARKER).is_file()
        raise NotADirectoryError(
            f"{folder} is a run folder whose run wrote no episode yet (no {EPISODES})"
            if marked
            else f"{folder} is not a run folder (no {EPISODES}): pass the --out folder of chatenv rollout or train"
        )
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    target = folder / DEFAULT_OUT[format] if out is None else Path(out)
    return export_episodes(folder / EPISODES, target, format, overwrite=overwrite)


def run_export(args: argparse.Namespace) -> int:
    """Run ``chatenv export`` with parsed arguments; returns the exit code (2 for bad input)."""
    try:
        path = export_run(args.run_dir, args.format, args.out, overwrite=args.overwrite)
    except (OSError, ValueError, MissingDependencyError) as e:  # not a run, exists, unwritable, bad line, no extra
        return fail(str(e))
    print(f"episodes written to {path} ({args.format})")
    return 0
