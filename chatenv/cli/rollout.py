"""``chatenv rollout``: run a model on a registered env, save each episode as it completes.

Ctrl-C or SIGTERM stops the run and keeps the episodes that finished; the command then exits with 130 (SIGINT) or 143
(SIGTERM), as shells report a process a signal ended, so a scheduler can tell a stopped run from a finished one.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import statistics
import sys
import time
from typing import Any

from chatenv.cli import fail
from chatenv.cli.common import (
    StopSignals,
    build_policy,
    generation_settings,
    model_path,
    reference_model,
    settings_problem,
    task_kwargs,
)
from chatenv.cli.run_dir import RunDir, RunDirError
from chatenv.cli.trackers import open_run_trackers, summary_metrics, tracker_problem
from chatenv.envs import is_token_level
from chatenv.rollout.evaluation import k_values, pass_at_k, pass_at_k_by_group

__all__ = [
    "add_async_argument",
    "add_workers_argument",
    "episodes_from_rollout",
    "pass_at_k",
    "pass_at_k_by_group",
    "run_rollout",
]


def add_async_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--async`` to the ``rollout`` parser: each episode's next turn is requested as soon as its step returns."""
    parser.add_argument(
        "--async",
        dest="async_rollout",
        action="store_true",
        help="async rollout: no turn barrier; each episode's next turn goes to the model as soon as its step returns",
    )


#: arguments that must match for a resumed run's episodes to belong with the earlier ones
_COMPARABLE = (
    "env",
    "task_kwargs",
    "model",
    "backend",
    "input_mode",
    "max_turns",
    "kl_coef",
    "kl_target",
    "max_new_tokens",
    "temperature",
    "group_size",
    "success_threshold",
)


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    import gymnasium as gym

    import chatenv  # noqa: F401  (registers the envs)

    if args.episodes < 1 or args.envs < 1:
        return "--episodes and --envs must be >= 1"
    if args.group_size is not None and args.group_size < 1:
        return f"--group-size must be >= 1, got {args.group_size}"
    if args.group_size is not None and args.episodes % args.group_size:
        return f"--episodes {args.episodes} must be a multiple of --group-size {args.group_size} (whole groups)"
    for name in ("kl_coef", "kl_target", "engine_memory", "success_threshold"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            return f"--{name.replace('_', '-')} must be a finite number, got {value}"
    if args.kl_coef is not None and args.kl_coef < 0:
        return f"--kl-coef must be >= 0, got {args.kl_coef}"
    if args.kl_target is not None and args.kl_target <= 0:
        return f"--kl-target must be > 0, got {args.kl_target}"
    if args.engine_memory <= 0:
        return f"--engine-memory must be > 0 GiB, got {args.engine_memory}"
    problem = settings_problem(args) or _task_problem(args)
    if problem:
        return problem
    if args.env not in gym.registry:
        return f"unknown env {args.env!r}; `chatenv envs` lists them"
    if is_token_level(args.env):
        return "`chatenv rollout` runs turn-level envs; use TokenEnv from Python for token-level ones"
    return None


def _task_problem(args: argparse.Namespace) -> str | None:
    kwargs = task_kwargs(args.task_kwargs, args.env, easy_default=False)
    return kwargs if isinstance(kwargs, str) else None


def run_rollout(args: argparse.Namespace) -> int:
    """Run ``chatenv rollout`` with parsed arguments; returns the exit code."""
    problem = _check_args(args) or tracker_problem(args)
    if problem:
        return fail(problem)
    try:  # before the model loads: a bad --out fails in a second, not after a minute
        run_dir = RunDir(args.out, overwrite=args.overwrite, resume=args.resume)
    except RunDirError as e:
        return fail(str(e))
    problem = run_dir.check_config(vars(args), keys=_COMPARABLE) if args.resume else None
    if problem:
        return fail(problem)
    if not args.resume:
        run_dir.write_config(vars(args))
    trackers = open_run_trackers(args, run_dir)
    if isinstance(trackers, int):
        return trackers
    code = 1
    with StopSignals() as stop:
        try:
            collect = _collect_on_ray if getattr(args, "workers", None) else _collect
            code = collect(args, run_dir, trackers, stop)
        except KeyboardInterrupt:  # while the model was loading: no episode had started
            code = stop.report(f"no episode ran; the run's folder is {run_dir.path}")
        finally:
            trackers.close(failed=code != 0 and not stop.interrupted)
    return code


class _Saved:
    """A run's episodes saved as each ends: counted for the progress bar and the summary."""

    def __init__(self, args: argparse.Namespace, run_dir: RunDir, policy: Any, trackers: Any, stop: StopSignals):
        self.args, self.run_dir, self.policy, self.trackers, self.stop = args, run_dir, policy, trackers, stop
        self.before = len(run_dir.episodes)
        self.groups_before = 1 + max((e.get("group", -1) for e in run_dir.episodes), default=-1)
        # the first seed after those of the episodes (or groups) before: a resumed run draws new problems
        self.seed = args.seed + (self.groups_before if args.group_size else self.before)
        self.start, self.tokens = time.perf_counter(), 0
        self.bar = _progress(args.episodes)

    def __call__(self, episode_td: Any) -> None:
        batch = episodes_from_rollout(
            episode_td,
            self.policy,
            len(self.run_dir.episodes),
            group_offset=self.groups_before,
            success_threshold=self.args.success_threshold,
        )
        self.run_dir.append(batch)
        self.tokens += sum(sum(e["response_tokens"]) for e in batch)
        self.bar.update(len(batch))
        if hasattr(self.bar, "set_postfix_str"):  # tqdm: generated tokens per second so far
            self.bar.set_postfix_str(f"{self.tokens / max(time.perf_counter() - self.start, 1e-9):.1f} tok/s")

    def failed(self, e: BaseException) -> int:
        """Say how the run stopped (what finished is on disk); returns the exit code."""
        done = len(self.run_dir.episodes) - self.before
        if isinstance(e, KeyboardInterrupt):
            return self.stop.report(f"the {done} episodes collected so far are saved in {self.run_dir.path}")
        if isinstance(e, RunDirError):
            return fail(str(e))
        # a task, reward, model or actor failed: say what went wrong
        print(f"\nerror: {type(e).__name__}: {e}\nthe {done} episodes that finished are saved", file=sys.stderr)
        return 1

    def summary(self) -> None:
        self.bar.close()
        curves = self.run_dir.plot()
        wall = time.perf_counter() - self.start
        _summary(self.run_dir, self.before, self.tokens, wall, self.args.group_size)
        episodes, size = self.run_dir.episodes[self.before :], self.args.group_size
        passes = pass_at_k_by_group(episodes, k_values(size)) if size else {}
        self.trackers.log_metrics(summary_metrics(episodes, self.tokens, wall, passes), 0)
        self.trackers.log_figure(curves, 0)


def _collect(args: argparse.Namespace, run_dir: RunDir, trackers: Any, stop: StopSignals) -> int:
    import gymnasium as gym
    import torch

    from chatenv.rollout import rollout

    torch.manual_seed(args.seed)
    policy, ref = _policy(args)
    kwargs: dict[str, Any] = {"input_mode": args.input_mode, "tokenizer": policy.tokenizer}
    if args.max_turns is not None:
        kwargs["max_turns"] = args.max_turns
    if args.task_kwargs is not None:
        kwargs["task_kwargs"] = task_kwargs(args.task_kwargs, args.env)
    controller, n = _controller(args), args.episodes
    try:
        envs = [_with_kl(gym.make(args.env, **kwargs), args, ref, controller) for _ in range(min(args.envs, n))]
    except Exception as e:  # bad task options: say so plainly
        print(f"error: could not make {args.env}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    saved, code = _Saved(args, run_dir, policy, trackers, stop), 0
    try:
        mode = "async" if getattr(args, "async_rollout", False) else "sync"
        rollout(
            envs,
            policy,
            episodes=args.episodes,
            seed=saved.seed,
            group_size=args.group_size,
            on_episode=saved,
            mode=mode,
        )
    except (KeyboardInterrupt, Exception) as e:
        code = saved.failed(e)
    finally:
        for env in envs:
            env.close()
        saved.summary()
    return code


def _policy(args: argparse.Namespace) -> tuple[Any, Any]:
    """The policy (the async engine with ``--async`` and vLLM) and, with a KL term, its reference."""
    policy = build_policy(
        args,
        input_mode=args.input_mode,
        max_num_seqs=args.envs,
        async_engine=bool(getattr(args, "async_rollout", False)),
    )
    kl = args.kl_coef is not None or args.kl_target is not None
    return policy, reference_model(args.model, policy) if kl else None


def _controller(args: argparse.Namespace) -> Any:
    """One adaptive KL controller shared by every env (None for a constant coefficient)."""
    if args.kl_target is None:
        return None
    from wrappers.kl import AdaptiveKLController

    return AdaptiveKLController(0.05, target=args.kl_target, horizon=100)


def _with_kl(env: Any, args: argparse.Namespace, ref: Any, controller: Any) -> Any:
    if ref is None:
        return env
    from wrappers.kl import KLPenalty

    return KLPenalty(env, controller if controller is not None else args.kl_coef, ref_model=ref)


def episodes_from_rollout(
    td: Any,
    policy: Any,
    offset: int,
    *,
    complete_only: bool = False,
    group_offset: int = 0,
    success_threshold: float = 1.0,
) -> list[dict[str, Any]]:
    """One episode record per episode of a rollout TensorDict (:mod:`chatenv.rollout.records`, as JSON dicts).

    Episodes of envs with tools also count their ``tool_calls`` and ``tool_errors``.

    An episode succeeds when one of its turns does: the task's ``correct`` reward component is 1 (Arithmetic,
    GuessNumber), or, for tasks without one, the turn's task reward is at least ``success_threshold``.

    Args:
        td: The rollout's TensorDict (None gives no episodes).
        policy: The policy that produced it (for its tokenizer).
        offset: Number of the first episode.
        complete_only: Keep only episodes whose last turn ended them (for a partial rollout).
        group_offset: Added to the rollout's ``group`` column (rollouts with ``group_size``), so groups of
            several rollouts in one file keep distinct numbers.
        success_threshold: Task reward of a successful turn, for tasks without a ``correct`` component.
    """
    from chatenv.rollout.records import episode_records

    records = episode_records(
        td,
        first_episode=offset,
        group_offset=group_offset,
        complete_only=complete_only,
        success_threshold=success_threshold,
    )
    return [r.to_json() for r in records]


class _Bar:
    def __init__(self, total: int):
        self.total, self.done = total, 0

    def update(self, n: int) -> None:
        self.done += n
        print(f"\r{self.done}/{self.total} episodes", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


def _progress(total: int) -> Any:
    with contextlib.suppress(ImportError):
        return importlib.import_module("tqdm.auto").tqdm(total=total, unit="episode", desc="rollout")
    return _Bar(total)


def _mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}" if values else "-"


def _success_rows(episodes: list[dict[str, Any]], group_size: int | None) -> list[tuple[str, str]]:
    if not episodes:
        return [("success rate", "-")]
    rows = [("success rate", f"{statistics.mean(bool(e.get('success')) for e in episodes):.3f}")]
    if group_size:
        passes = pass_at_k_by_group(episodes, k_values(group_size))
        rows += [(f"pass@{k} (per group of {group_size})", f"{v:.3f}") for k, v in passes.items()]
    return rows


def _summary(run_dir: RunDir, done_before: int, tokens: int, wall: float, group_size: int | None = None) -> None:
    episodes = run_dir.episodes[done_before:]
    totals = [sum(e["task_rewards"]) for e in episodes]
    kls = [k for e in episodes for k in e["kl"] if k is not None]
    rows = [
        ("episodes", f"{len(episodes)}" + (f" (+{done_before} before)" if done_before else "")),
        (
            "task reward (mean ± std)",
            f"{statistics.mean(totals):.3f} ± {statistics.pstdev(totals):.3f}" if totals else "-",
        ),
        *_success_rows(episodes, group_size),
        ("KL per turn (mean)", f"{statistics.mean(kls):.3f}" if kls else "-"),
        ("turns per episode (mean)", f"{statistics.mean(e['turns'] for e in episodes):.2f}" if episodes else "-"),
        ("generated tokens / s", f"{tokens / wall:.1f}" if wall > 0 else "-"),
        ("wall time", f"{wall:.1f} s"),
        ("written to", str(run_dir.path)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


# ------------------------------------------------------------------------------------------- --workers (Ray)


def add_workers_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--workers N`` and ``--inference-actors M`` to the ``rollout`` parser (distributed collection on Ray)."""
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="run the envs on N Ray env workers (--envs each) of a local Ray cluster (extra 'ray')",
    )
    parser.add_argument("--inference-actors", type=int, default=1, help="Ray inference actors (with --workers)")


def _check_workers(args: argparse.Namespace) -> str | None:
    if args.workers < 1 or getattr(args, "inference_actors", 1) < 1:
        return "--workers and --inference-actors must be >= 1"
    if args.backend != "transformers":
        return "--workers runs transformers policies; for vLLM use chatenv.distributed.RayCollector with VLLMFactory"
    if args.kl_target is not None:
        return "--kl-target needs one KL controller shared by every env: use --kl-coef with --workers"
    if args.task_kwargs is not None:
        return "--task-kwargs is not passed to Ray env workers: drop --workers, or leave the task at its defaults"
    return None


def _collect_on_ray(args: argparse.Namespace, run_dir: RunDir, trackers: Any, stop: StopSignals) -> int:
    """``--workers N``: the same run on Ray env workers and inference actors; each episode is saved as it ends."""
    problem = _check_workers(args)
    if problem:
        return fail(problem)
    from wrappers.distributed import collect_on_ray

    saved, code = _Saved(args, run_dir, None, trackers, stop), 0
    try:
        lost = collect_on_ray(
            args.env,
            model_path(args.model),
            saved,
            episodes=args.episodes,
            workers=args.workers,
            envs_per_worker=args.envs,
            inference_actors=args.inference_actors,
            input_mode=args.input_mode,
            generate_kwargs=generation_settings(args).as_kwargs(),
            max_turns=args.max_turns,
            kl=args.kl_coef,
            group_size=args.group_size,
            seed=saved.seed,
        )
        if lost:
            print(f"\nlost with dead env workers: {lost}", file=sys.stderr)
    except (KeyboardInterrupt, Exception) as e:
        code = saved.failed(e)
    finally:
        saved.summary()
    return code
