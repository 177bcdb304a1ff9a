"""``chatenv train``: GRPO on whole multi-turn episodes, with a KL term to the model's frozen starting copy.

Each step runs ``--prompts`` problems x ``--group-size`` episodes with :func:`chatenv.rollout` (``group_size=G``: the
G episodes of a problem start from the same reset), the envs wrapped by :class:`wrappers.kl.RefLogProbs` so the
frozen reference scores every reply in one batch per round; :func:`chatenv.episodes` turns the turns into one row
per episode (the replies *and* the env's feedback between them, with the assistant mask), and one
:class:`wrappers.grpo.GRPOLearner` step updates the policy: group-normalised advantages, the policy-gradient loss
on the assistant tokens of every turn, ``--kl-coef`` x the k3 KL per token (or, with ``--kl-in-reward``, the
KL penalty of :class:`wrappers.kl.KLPenalty` in the reward).

It prints one row per step (task reward, success rate, KL, loss, tokens, seconds) and writes under ``--out``:
``episodes.jsonl`` (every episode with its step, written as it ends), ``metrics.jsonl`` (one line per step),
``config.json`` and ``curves.png`` (task reward, success rate and KL per step). With ``--eval-every N`` the policy is
also evaluated on ``--eval-episodes`` held-out problems (:mod:`chatenv.cli.eval`: seeds no training step uses) before
the first step, every N steps and after the last, greedy and at each ``--eval-temperature``: a line after the step's
row, a row per temperature in ``eval.jsonl`` (its seeds included), ``eval/...`` metrics for the trackers and the
held-out success in ``curves.png``; those episodes are never trained on nor written to ``episodes.jsonl``. The seeds
differ, yet a small task space repeats problems (one-digit additions have 100): each evaluation counts the held-out
problems whose opening chat a training episode so far had (``seen_in_training``) and gives the success on the others
(``success_unseen``).

Ctrl-C or SIGTERM stops and keeps what was collected, and the command then exits with 130 (SIGINT) or 143 (SIGTERM),
not 0; ``--save-model`` saves the trained weights to ``--out``/model, which ``--resume`` continues from.

The default task is ``chatenv/Arithmetic-v0`` with one-digit additions and two tries (:data:`EASY_ARITHMETIC`):
the untrained SmolLM2-135M-Instruct answers about a quarter of them at the first try, so the groups have
something to compare from the first step.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from chatenv.cli import fail
from chatenv.cli.common import (
    EASY_ARITHMETIC,
    StopSignals,
    add_model_arguments,
    build_policy,
    reference_model,
    settings_problem,
    task_kwargs,
)
from chatenv.cli.eval import add_eval_arguments
from chatenv.cli.rollout import episodes_from_rollout
from chatenv.cli.run_dir import RunDir, RunDirError
from chatenv.cli.trackers import add_tracker_argument, open_run_trackers, tracker_problem
from chatenv.envs import is_token_level
from chatenv.rollout.offpolicy import add_arguments as add_off_policy_arguments

__all__ = ["EASY_ARITHMETIC", "add_train_parser", "run_train"]

#: arguments that must match for a resumed run to continue the earlier one
_COMPARABLE = (
    "env",
    "task_kwargs",
    "model",
    "max_turns",
    "prompts",
    "group_size",
    "max_new_tokens",
    "temperature",
    "lr",
    "kl_coef",
    "kl_target",
    "kl_in_reward",
    "seed",  # with the two below: a resumed run keeps its training problems and its held-out set
    "eval_episodes",
    "eval_temperature",
)
_MODEL_DIR = "model"


def add_train_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``train`` subcommand and its options to the ``chatenv`` parser."""
    run = sub.add_parser("train", help="train the model with GRPO on multi-turn episodes (KL to its frozen start)")
    run.add_argument("--env", default="chatenv/Arithmetic-v0", help="registered turn-level env id")
    run.add_argument(
        "--task-kwargs",
        default=None,
        help="task options as JSON (default for Arithmetic-v0: one-digit additions, two tries: "
        f"'{json.dumps(EASY_ARITHMETIC)}'; for other envs: none)",
    )
    run.add_argument("--max-turns", type=int, default=2, help="assistant turns per episode (default 2)")
    add_model_arguments(run, backends=False)
    run.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    run.add_argument("--prompts", type=int, default=4, help="problems per step (default 4)")
    run.add_argument("--group-size", type=int, default=4, help="episodes per problem, G (default 4)")
    run.add_argument("--envs", type=int, default=None, help="envs stepped together (default: prompts x group size)")
    run.add_argument("--max-new-tokens", type=int, default=40)
    run.add_argument("--temperature", type=float, default=0.7)
    run.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate (default 3e-5)")
    run.add_argument("--kl-coef", type=float, default=0.05, help="KL coefficient (start value with --kl-target)")
    run.add_argument("--kl-target", type=float, default=None, help="adapt the coefficient to this KL per episode")
    run.add_argument(
        "--kl-in-reward", action="store_true", help="subtract coef x KL from the reward (KLPenalty), not in the loss"
    )
    run.add_argument("--micro-batch", type=int, default=4, help="episodes per forward/backward pass")
    run.add_argument(
        "--credit",
        choices=("episode", "turn", "branch"),
        default="episode",
        help="advantage per episode (default); per turn: each reply's return-to-go against the same turn of its "
        "group (unbiased leave-one-out baseline); branch: each reply's change of the state value, sampled by "
        "--branches continuations of forks kept between the turns",
    )
    run.add_argument(
        "--branches", type=int, default=2, help="with --credit branch: continuations per state (default 2)"
    )
    add_off_policy_arguments(run)  # --is-level, --is-mode, --is-cap, --max-staleness
    run.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's choice); never more than the cores this process may use (CPU "
        "affinity, cgroup CPU quota): a higher count is lowered with a warning",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--save-model", action="store_true", help="save the trained weights to --out/model at the end")
    add_eval_arguments(run)
    add_tracker_argument(run)
    run.add_argument("--out", required=True, help="output folder (created; an existing run is never replaced)")
    again = run.add_mutually_exclusive_group()
    again.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    again.add_argument("--resume", action="store_true", help="continue a run saved with --save-model")


def _check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, or None."""
    import gymnasium as gym

    import chatenv  # noqa: F401  (registers the envs)

    for name in ("steps", "prompts", "group_size", "max_turns", "micro_batch", "branches"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    for name in ("envs", "threads", "eval_every", "eval_episodes"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    for name in ("lr", "kl_coef", "kl_target"):
        value = getattr(args, name)
        if value is not None and not math.isfinite(value):
            return f"--{name.replace('_', '-')} must be a finite number, got {value}"
    problem = settings_problem(args) or _eval_problem(args)
    if problem:
        return problem
    if args.lr <= 0 or args.temperature <= 0:
        return "--lr and --temperature must be > 0 (GRPO samples several different replies per problem)"
    if args.kl_coef < 0 or (args.kl_target is not None and (args.kl_target <= 0 or args.kl_coef == 0)):
        return "--kl-coef must be >= 0 (> 0 with --kl-target), and --kl-target > 0"
    if args.env not in gym.registry:
        return f"unknown env {args.env!r}; `chatenv envs` lists them"
    if is_token_level(args.env):
        return "`chatenv train` runs turn-level envs; use TokenEnv from Python for token-level ones"
    return None


def _eval_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the evaluation flags or the training seeds, or None."""
    from chatenv.cli.eval import temperatures_problem, training_seeds_problem

    problem = training_seeds_problem(args.seed, args.steps * args.prompts)
    if problem is None and args.eval_temperature is not None:
        problem = temperatures_problem(args.eval_temperature, "--eval-temperature")
    return problem


def run_train(args: argparse.Namespace) -> int:
    """Run ``chatenv train`` with parsed arguments; returns the exit code."""
    problem = _check_args(args) or tracker_problem(args)
    kwargs = task_kwargs(args.task_kwargs, args.env) if problem is None else problem
    if isinstance(kwargs, str):
        return fail(kwargs)
    try:  # before the model loads: a bad --out fails in a second
        run_dir = RunDir(args.out, overwrite=args.overwrite, resume=args.resume)
    except RunDirError as e:
        return fail(str(e))
    if args.resume:
        problem = run_dir.check_config(vars(args), keys=_COMPARABLE)
        if problem is None and not (run_dir.path / _MODEL_DIR / "config.json").exists():
            problem = (
                f"--resume continues from the weights a run saved with --save-model, and {run_dir.path / _MODEL_DIR} "
                "holds none; start a new run (--overwrite) instead"
            )
        if problem:
            return fail(problem)
    else:
        run_dir.write_config(vars(args))
    trackers = open_run_trackers(args, run_dir)  # before the model loads
    if isinstance(trackers, int):
        return trackers
    code = 1
    with StopSignals() as stop:
        try:
            code = _train(args, run_dir, kwargs, trackers, stop)
        except KeyboardInterrupt:  # while the run was being set up: no step had started
            code = stop.report(f"no step ran; the run's folder is {run_dir.path}")
        finally:
            trackers.close(failed=code != 0 and not stop.interrupted)
    return code


class _Run:
    """The pieces of a training run: policy, learner (with its reference), envs."""

    def __init__(self, args: argparse.Namespace, run_dir: RunDir, task_kwargs: dict[str, Any]):
        import gymnasium as gym

        from wrappers.grpo import GRPOConfig, GRPOLearner
        from wrappers.kl import AdaptiveKLController, KLPenalty, RefLogProbs

        start = str(run_dir.path / _MODEL_DIR) if args.resume else None
        self.policy = build_policy(args, model=start)
        # the frozen start: a copy of its own, at the policy's temperature (its log-probs are of the tempered model)
        self.ref = reference_model(args.model, self.policy, kv_cache_size=0)
        coef: Any = args.kl_coef
        if args.kl_target is not None:
            coef = AdaptiveKLController(
                args.kl_coef, target=args.kl_target, horizon=10 * args.prompts * args.group_size
            )
        env_kwargs = {"input_mode": "tokens", "tokenizer": self.policy.tokenizer, "max_turns": args.max_turns}
        if task_kwargs:
            env_kwargs["task_kwargs"] = task_kwargs
        n_envs = args.envs or args.prompts * args.group_size
        self.envs: list[Any]
        if args.kl_in_reward:  # the penalty is in the env's reward: the loss has no KL term
            self.envs = [KLPenalty(gym.make(args.env, **env_kwargs), coef, ref_model=self.ref) for _ in range(n_envs)]
            coef = 0.0
        else:
            self.envs = [RefLogProbs(gym.make(args.env, **env_kwargs), self.ref) for _ in range(n_envs)]
        off_policy = {k: getattr(args, k) for k in ("is_level", "is_mode", "is_cap", "max_staleness")}
        config = GRPOConfig(lr=args.lr, kl=coef, micro_batch=args.micro_batch, credit=args.credit, **off_policy)
        self.learner = GRPOLearner(self.policy, config)

    def close(self) -> None:
        for env in self.envs:
            env.close()


def _train(
    args: argparse.Namespace, run_dir: RunDir, task_kwargs: dict[str, Any], trackers: Any, stop: StopSignals
) -> int:
    import torch

    from chatenv.cpus import torch_threads

    threads, lowered = torch_threads(args.threads, name="--threads")
    if lowered:
        print(f"warning: {lowered}", file=sys.stderr)
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    began = time.perf_counter()
    try:
        run = _Run(args, run_dir, task_kwargs)
    except Exception as e:  # bad task options, a model that does not load: say so plainly
        print(f"error: could not set the run up: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    first = 1 + max((m["step"] for m in run_dir.metrics), default=-1)
    held_out = None
    code = 0
    try:
        held_out = _held_out(args, run, task_kwargs, first)
        print(_HEADER)
        _evaluate(held_out, run_dir, trackers, first)
        for step in range(first, first + args.steps):
            row = _step(args, run, run_dir, step)
            run_dir.append_metrics(row)
            trackers.log_metrics(row, step)
            print(_format(row), flush=True)
            if (step + 1 - first) % (args.eval_every or 1) == 0 or step + 1 == first + args.steps:
                _evaluate(held_out, run_dir, trackers, step + 1)
            run_dir.plot_steps(f"GRPO on {args.env.split('/')[-1]}")
    except KeyboardInterrupt:
        code = stop.report(f"the steps and episodes collected so far are saved in {run_dir.path}")
    except RunDirError as e:
        code = fail(str(e))
    except Exception as e:  # a task, reward or model failed: what finished is on disk
        print(f"\nerror: {type(e).__name__}: {e}\nthe steps and episodes that finished are saved", file=sys.stderr)
        code = 1
    finally:
        run.close()
        if held_out is not None:
            held_out.close()
    if args.save_model:
        run.policy.model.save_pretrained(run_dir.path / _MODEL_DIR)
        run.policy.tokenizer.save_pretrained(run_dir.path / _MODEL_DIR)
    curves = run_dir.plot_steps(f"GRPO on {args.env.split('/')[-1]}")
    trackers.log_figure(curves, max((m["step"] for m in run_dir.metrics), default=0))
    _summary(run_dir, first, time.perf_counter() - began)
    return code


def _held_out(args: argparse.Namespace, run: _Run, task_kwargs: dict[str, Any], first: int) -> Any:
    """With ``--eval-every``: the held-out problems (seeds checked apart from every training seed); else None."""
    if args.eval_every is None:
        return None
    from chatenv.cli.eval import HeldOut, training_seeds_problem

    groups = (first + args.steps) * args.prompts  # a resumed run's earlier steps too
    problem = training_seeds_problem(args.seed, groups)
    if problem:
        raise RunDirError(problem)
    held_out = HeldOut(
        run.policy,
        args.env,
        task_kwargs,
        problems=args.eval_episodes,
        temperatures=args.eval_temperature or [0.0, args.temperature],
        seed=args.seed,
        max_turns=args.max_turns,
    )
    held_out.check_disjoint(range(args.seed, args.seed + groups))
    return held_out


def _evaluate(held_out: Any, run_dir: RunDir, trackers: Any, step: int) -> None:
    """Run the held-out problems with the weights after ``step`` updates; save, log and print the results."""
    if held_out is None:
        return
    from chatenv.cli.eval import flat_metrics
    from chatenv.rollout.evaluation import problem_text, seen_split

    if any(r["step"] == step for r in run_dir.evals):  # a resumed run: the earlier run evaluated these weights
        return
    trained = {t for t in map(problem_text, run_dir.episodes) if t is not None}
    rows = [
        {
            "step": step,
            **{k: v for k, v in r.items() if k != "episodes_detail"},
            **seen_split(r["episodes_detail"], trained),
        }
        for r in held_out.run()
    ]
    run_dir.append_evals(rows)
    for r in rows:
        trackers.log_metrics(flat_metrics(r), step)
    parts = [
        f"{r['decoding']} {r['success']:.3f} ("
        + ", ".join(f"turn {t + 1} {v:.3f}" for t, v in enumerate(r["success_by_turn"]))
        + ("; unseen: -)" if r["success_unseen"] is None else f"; unseen: {r['success_unseen']:.3f})")
        for r in rows
    ]
    seconds = sum(r["seconds"] for r in rows)
    print(
        f"held-out after {step} steps, success: {'; '.join(parts)}  [{rows[0]['problems']} problems, "
        f"{rows[0]['seen_in_training']} seen in training, {seconds:.1f} s]"
    )


def _step(args: argparse.Namespace, run: _Run, run_dir: RunDir, step: int) -> dict[str, Any]:
    """One rollout of grouped episodes and one GRPO update; returns the step's row."""
    import chatenv

    start = time.perf_counter()
    before = len(run_dir.episodes)
    groups = step * args.prompts

    def save(episode_td: Any) -> None:  # each episode is on disk as soon as it ends
        batch = episodes_from_rollout(episode_td, run.policy, len(run_dir.episodes), group_offset=groups)
        run_dir.append([{"step": step, **e} for e in batch])

    points: list[Any] = []  # with --credit branch: a fork of every episode between its turns

    def keep(env: Any, episode: int, turn: int) -> None:
        points.append(((episode, turn), chatenv.fork(env)))

    try:
        td = chatenv.rollout(
            run.envs,
            run.policy,
            episodes=args.prompts * args.group_size,
            group_size=args.group_size,
            seed=args.seed + groups,  # new problems every step
            on_episode=save,
            on_turn=keep if args.credit == "branch" else None,
        )
        view = chatenv.episodes(td)
        values, branch_tokens = _branch_values(args, run, view, points) if args.credit == "branch" else (None, 0)
    finally:
        for _, env in points:  # the kept forks are this step's own: their tool objects are released here
            env.close()
    metrics = run.learner.step(view, values=values)
    episodes = run_dir.episodes[before:]
    return {
        "step": step,
        "task_reward": statistics.mean(sum(e["task_rewards"]) for e in episodes),
        "success": statistics.mean(bool(e["success"]) for e in episodes),
        "kl": metrics["kl"],
        "loss": metrics["loss"],
        "tokens": sum(sum(e["response_tokens"]) for e in episodes) + branch_tokens,
        "seconds": time.perf_counter() - start,
        **{f"train/{k}": v for k, v in metrics.items()},
    }


def _branch_values(args: argparse.Namespace, run: _Run, view: Any, points: list[Any]) -> tuple[list[Any], int]:
    """State values of the kept points, from ``--branches`` continuations each; and the tokens they generated."""
    import chatenv
    from chatenv.rollout import branch_rollout
    from chatenv.rollout.credit import branch_values

    if not points:  # every episode ended after its first turn: no state between turns to value
        return branch_values(view, [], None, gamma=1.0), 0
    branches = branch_rollout([env for _, env in points], run.policy, n=args.branches)
    tokens = sum(len(r) for r in branches["tokens"].unpadded("response"))
    return branch_values(view, [key for key, _ in points], chatenv.episodes(branches)), tokens


_HEADER = f"{'step':>4}  {'reward':>7}  {'success':>7}  {'KL':>8}  {'loss':>8}  {'tokens':>6}  {'seconds':>7}"


def _format(row: dict[str, Any]) -> str:
    return (
        f"{row['step']:>4d}  {row['task_reward']:>7.3f}  {row['success']:>7.3f}  {row['kl']:>8.4f}  "
        f"{row['loss']:>8.4f}  {row['tokens']:>6d}  {row['seconds']:>7.1f}"
    )


def _summary(run_dir: RunDir, first: int, wall: float) -> None:
    rows = [m for m in run_dir.metrics if m["step"] >= first]
    if not rows:
        print(f"no step finished; wall time {wall:.1f} s; written to {run_dir.path}")
        return
    tail = rows[-min(3, len(rows)) :]
    print(
        f"task reward: step {rows[0]['step']} {rows[0]['task_reward']:.3f} -> last {len(tail)} steps "
        f"{statistics.mean(r['task_reward'] for r in tail):.3f}; success {rows[0]['success']:.3f} -> "
        f"{statistics.mean(r['success'] for r in tail):.3f}; KL {rows[0]['kl']:.4f} -> {rows[-1]['kl']:.4f}; "
        f"wall time {wall:.1f} s; written to {Path(run_dir.path)}"
    )
    evals = [r for r in run_dir.evals if r["step"] >= first]
    for decoding in dict.fromkeys(r["decoding"] for r in evals):
        mine = [r for r in evals if r["decoding"] == decoding]
        print(
            f"held-out success ({decoding}, {mine[0]['problems']} problems): step {mine[0]['step']} "
            f"{mine[0]['success']:.3f} -> step {mine[-1]['step']} {mine[-1]['success']:.3f}"
        )
