"""``--tracker NAME`` of ``chatenv rollout`` and ``chatenv train``: the run logged (:mod:`chatenv.tracking`)."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from chatenv.cli import fail
from chatenv.cli.run_dir import RunDir

__all__ = ["add_tracker_argument", "open_run_trackers", "summary_metrics", "tracker_problem"]


def add_tracker_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--tracker NAME`` (repeatable) to a parser: log the run to TensorBoard, W&B or MLflow."""
    from chatenv.tracking import TRACKERS

    parser.add_argument(
        "--tracker",
        action="append",
        choices=tuple(TRACKERS),
        default=None,
        help="also log the config, metrics and curves to this tracker (repeat for several; see chatenv.tracking)",
    )


def tracker_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--tracker`` (a tracker whose package is missing), or None."""
    from chatenv.errors import MissingDependencyError
    from chatenv.tracking import check_trackers

    try:
        check_trackers(getattr(args, "tracker", None))
    except (ValueError, MissingDependencyError) as e:
        return str(e)
    return None


def open_run_trackers(args: argparse.Namespace, run_dir: RunDir) -> Any:
    """The run's trackers (:class:`chatenv.tracking.Trackers`, config logged), or the exit code if one fails."""
    from chatenv.tracking import Trackers

    try:
        return Trackers(getattr(args, "tracker", None), run_dir.path, vars(args))
    except Exception as e:  # a tracker's own set-up (credentials, a tracking URI) failed: before the model loads
        return fail(f"could not start the trackers: {type(e).__name__}: {e}")


def summary_metrics(
    episodes: list[dict[str, Any]], tokens: int, wall: float, pass_at_k: dict[int, float] | None = None
) -> dict[str, float]:
    """The numbers of ``chatenv rollout``'s summary (what ``--tracker`` logs) from its episode records.

    Args:
        episodes: The run's episode records (dicts).
        tokens: Generated tokens.
        wall: Wall time in seconds.
        pass_at_k: ``{k: pass@k}`` (rollouts with groups), logged as ``pass_at_<k>``.
    """
    if not episodes:
        return {"episodes": 0.0, "wall_seconds": wall}
    totals = [sum(t for t in e["task_rewards"] if t is not None) for e in episodes]
    kls = [k for e in episodes for k in e["kl"] if k is not None]
    out = {
        "episodes": float(len(episodes)),
        "task_reward": statistics.mean(totals),
        "task_reward_std": statistics.pstdev(totals),
        "success": statistics.mean(bool(e.get("success")) for e in episodes),
        "turns": statistics.mean(e["turns"] for e in episodes),
        "tokens": float(tokens),
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
        "wall_seconds": wall,
    }
    if kls:
        out["kl_per_turn"] = statistics.mean(kls)
    out.update({f"pass_at_{k}": v for k, v in (pass_at_k or {}).items()})
    return out
