"""Episode records as tables: Parquet, a Hugging Face ``datasets`` dataset, or JSON lines; and read back losslessly.

One row per episode, one column per :class:`~chatenv.rollout.records.EpisodeRecord` field (:data:`SCHEMA`): the
token ids, the assistant mask and the log-probs as list columns (a NaN log-prob is a null), the per-turn offsets
and rewards as list columns, ``reward`` and ``turns``. ``messages`` (message dicts differ in their keys) and the
keys a record does not know (``extra``) are JSON text. A field a record lacks is a null.

    >>> from chatenv.exports import FORMATS
    >>> FORMATS
    ('parquet', 'hf-dataset', 'jsonl')

:func:`export_episodes` writes records (or an episodes JSONL file, e.g. a run's ``episodes.jsonl``) in one format;
:func:`load_episodes` reads any of them back as records, equal to the ones written
(:func:`~chatenv.rollout.records.records_view` turns them into :func:`chatenv.episodes`'s layout). Parquet needs
``pyarrow``, the dataset ``datasets`` as well: the ``export`` extra (``pip install 'chatenv-gym[export]'``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from chatenv.errors import MissingDependencyError
from chatenv.rollout.records import EpisodeRecord

__all__ = [
    "FORMATS",
    "SCHEMA",
    "arrow_table",
    "export_episodes",
    "load_episodes",
    "read_jsonl",
    "record_row",
    "row_record",
]

#: the export formats
FORMATS = ("parquet", "hf-dataset", "jsonl")

_EXTRA = "pip install 'chatenv-gym[export]'"

#: column name -> type: int, float, bool, str, list[...] (of values that may be null), json (JSON text)
SCHEMA: dict[str, str] = {
    "episode": "int",
    "group": "int",
    "env_index": "int",
    "session": "str",
    "segment": "int",
    "step": "int",
    "prompt": "list[int]",
    "completion": "list[int]",
    "assistant_mask": "list[bool]",
    "log_probs": "list[float]",
    "turn_start": "list[int]",
    "response_tokens": "list[int]",
    "rewards": "list[float]",
    "task_rewards": "list[float]",
    "kl": "list[float]",
    "policy_version": "list[int]",
    "reward": "float",
    "turns": "int",
    "terminated": "bool",
    "truncated": "bool",
    "success": "bool",
    "tool_calls": "int",
    "tool_errors": "int",
    "messages": "json",
    "extra": "json",
}

#: marks a ``datasets`` folder saved with ``save_to_disk``
_DATASET_FILES = ("dataset_info.json", "state.json")


def record_row(record: EpisodeRecord | Mapping[str, Any] | str) -> dict[str, Any]:
    """One table row (every :data:`SCHEMA` column) of a record, a record's dict or a JSON line."""
    data = (record if isinstance(record, EpisodeRecord) else EpisodeRecord.from_json(record)).to_json()
    row: dict[str, Any] = {name: data.pop(name, None) for name in SCHEMA if name != "extra"}
    row["messages"] = None if row["messages"] is None else json.dumps(row["messages"], ensure_ascii=False)
    row["extra"] = json.dumps(data, ensure_ascii=False) if data else None
    return row


def row_record(row: Mapping[str, Any]) -> EpisodeRecord:
    """The record of one table row (:func:`record_row`'s inverse)."""
    data = {k: v for k, v in row.items() if v is not None and k not in ("messages", "extra")}
    if "messages" in row:
        data["messages"] = None if row["messages"] is None else json.loads(row["messages"])
    extra = json.loads(row["extra"]) if row.get("extra") is not None else {}
    return EpisodeRecord.from_json({**data, **extra})


def read_jsonl(path: str | os.PathLike[str]) -> list[EpisodeRecord]:
    """The records of an episodes JSONL file (a run's ``episodes.jsonl``, a session's export).

    Raises:
        FileNotFoundError: If there is no such file.
        ValueError: For a line that is not an episode record (naming the line).
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(EpisodeRecord.from_json(line))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{n} is not an episode record: {e}") from e
    return out


def _pyarrow(what: str) -> Any:
    try:
        import pyarrow
    except ImportError as e:
        raise MissingDependencyError(f"{what} needs pyarrow: {_EXTRA}") from e
    return pyarrow


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise MissingDependencyError(f"a Hugging Face dataset export needs the datasets package: {_EXTRA}") from e
    return datasets


def _arrow_type(pa: Any, kind: str) -> Any:
    scalar = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string(), "json": pa.string()}
    if kind.startswith("list["):
        return pa.list_(scalar[kind[5:-1]])
    return scalar[kind]


def arrow_table(records: Iterable[EpisodeRecord | Mapping[str, Any] | str]) -> Any:
    """A ``pyarrow.Table`` of records, one row each, in :data:`SCHEMA`.

    Raises:
        MissingDependencyError: Without pyarrow.
        ValueError: For a record whose values do not fit their columns.
    """
    pa = _pyarrow("an Arrow table")
    schema = pa.schema([(name, _arrow_type(pa, kind)) for name, kind in SCHEMA.items()])
    rows = [record_row(r) for r in records]
    try:
        return pa.Table.from_pylist(rows, schema=schema)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"episode records that do not fit the export's columns: {e}") from e


def _check_out(out: Path, fmt: str, overwrite: bool) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True (--overwrite) to replace it, or choose another path")
    is_dataset = out.is_dir() and all((out / name).is_file() for name in _DATASET_FILES)
    if fmt == "hf-dataset" and not is_dataset:
        raise FileExistsError(f"{out} exists and is not a saved dataset: it is never replaced; choose another path")
    if fmt != "hf-dataset" and not out.is_file():
        raise FileExistsError(f"{out} exists and is not a file: it is never replaced; choose another path")


def export_episodes(
    source: str | os.PathLike[str] | Iterable[EpisodeRecord | Mapping[str, Any] | str],
    out: str | os.PathLike[str],
    format: str = "parquet",  # noqa: A002  (the CLI's word)
    *,
    overwrite: bool = False,
) -> Path:
    """Write episode records as Parquet, a Hugging Face dataset (``save_to_disk``) or JSON lines.

    The output appears whole or not at all (written next to it, then moved into place).

    Args:
        source: Records (or their dicts or JSON lines), or the path of an episodes JSONL file.
        out: The file (Parquet, JSONL) or folder (dataset) to write.
        format: One of :data:`FORMATS`.
        overwrite: Replace an earlier export at ``out`` (a file, or a saved dataset; never anything else).

    Returns:
        ``out``.

    Raises:
        ValueError: For an unknown format, or records that are not episode records.
        FileExistsError: If ``out`` exists (without ``overwrite``, or when it is not an earlier export).
        MissingDependencyError: Without pyarrow (Parquet, dataset) or datasets (dataset): the ``export`` extra.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    out = Path(out)
    _check_out(out, format, overwrite)
    if format != "jsonl":  # the missing package is named before any reading
        _pyarrow("a Parquet export" if format == "parquet" else "a Hugging Face dataset export")
        if format == "hf-dataset":
            _datasets()
    records = read_jsonl(source) if isinstance(source, (str, os.PathLike)) else source
    rows = [r if isinstance(r, EpisodeRecord) else EpisodeRecord.from_json(r) for r in records]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        written = _write(rows, tmp / out.name, format)
        if out.is_dir():
            shutil.rmtree(out)
        os.replace(written, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(records: list[EpisodeRecord], path: Path, fmt: str) -> Path:
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r.to_json(), ensure_ascii=False) + "\n" for r in records), "utf-8")
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(arrow_table(records), path)
    else:
        _datasets().Dataset(arrow_table(records)).save_to_disk(str(path))
    return path


def _guess(path: Path) -> str:
    if path.is_dir():
        return "hf-dataset"
    return "parquet" if path.suffix == ".parquet" else "jsonl"


def load_episodes(path: str | os.PathLike[str], format: str | None = None) -> list[EpisodeRecord]:  # noqa: A002
    """The records of an export (:func:`export_episodes`), equal to those written.

    Args:
        path: The export.
        format: One of :data:`FORMATS` (default: a folder is a dataset, ``*.parquet`` Parquet, else JSON lines).

    Raises:
        ValueError: For an unknown format.
        FileNotFoundError: If ``path`` does not exist.
        MissingDependencyError: Without the package the format needs.
    """
    path = Path(path)
    fmt = format or _guess(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not path.exists():
        raise FileNotFoundError(f"no export at {path}")
    if fmt == "jsonl":
        return read_jsonl(path)
    if fmt == "parquet":
        _pyarrow("reading Parquet")
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        rows = _datasets().load_from_disk(str(path)).to_list()
    return [row_record(r) for r in rows]
