"""The ``chatenv`` command: the application layer (the one part of chatenv that imports ``wrappers``, lazily).

- ``chatenv envs`` lists the registered environments.
- ``chatenv check [ENV_ID]`` runs :func:`chatenv.check` on an env (or every registered one, in every input mode).
- ``chatenv rollout --env chatenv/Arithmetic-v0 --episodes 16 --max-turns 3 --out runs/demo`` runs episodes with
  the embedded SmolLM2 (or ``--model PATH``), optionally with a KL penalty to the model's own frozen copy, shows
  a progress bar, prints a summary table (with ``--group-size G``: success rate and pass@k per group of G samples
  of one problem), and writes ``episodes.jsonl`` (one line per episode, written as each completes),
  ``config.json`` and ``curves.png`` (reward and KL per turn) under ``--out``. An existing run is never replaced
  unless ``--overwrite`` (or extended with ``--resume``). Ctrl-C or SIGTERM stops early and keeps what was
  collected.
- ``chatenv train --out runs/train`` trains the model with GRPO on whole multi-turn episodes, with a KL term to its
  frozen starting copy (:mod:`wrappers.grpo`), printing a row per step and writing ``episodes.jsonl``,
  ``metrics.jsonl``, ``config.json`` and ``curves.png`` (reward and KL per step); see :mod:`chatenv.cli.train`.
- ``chatenv eval --model runs/demo/model --temperature 0 0.7 --samples 4`` evaluates a model on held-out problems
  (reset seeds from 2**30 on, which ``chatenv train`` never trains on; a dataset of your own, such as
  :func:`chatenv.integrations.trl.prompt_dataset`'s, uses the seeds you give it; in a small task space the problems
  themselves repeat across seeds): success greedy and sampled, pass@1 and pass@k, success by turn, and the number of
  distinct problems; see :mod:`chatenv.cli.eval`.
- ``chatenv export RUN_DIR --format parquet|hf-dataset|jsonl`` writes a run's episodes as one table (one row per
  episode; extra ``export``); see :mod:`chatenv.cli.export`.
- ``chatenv serve --port 8000`` serves the model behind an OpenAI-compatible endpoint that records each session's
  token-exact trajectory (extra ``serve``); see :mod:`chatenv.cli.serve`.
- ``chatenv serve-env ENV_ID`` serves a registered env over HTTP and WebSocket, one env per client session
  (``chatenv.envserver.EnvClient`` is a Gymnasium env on it; extra ``serve``); see :mod:`chatenv.cli.serve_env`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

__all__ = ["main"]


def _rollout_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser("rollout", help="run episodes with a model and save them")
    run.add_argument("--env", default="chatenv/Arithmetic-v0", help="registered env id (see `chatenv envs`)")
    run.add_argument("--episodes", type=int, default=16, help="episodes to run")
    run.add_argument("--task-kwargs", default=None, help="task options as JSON (default: the task's own)")
    run.add_argument("--max-turns", type=int, default=None, help="assistant turns per episode (default: the task's)")
    from chatenv.cli.common import add_model_arguments

    add_model_arguments(run)
    run.add_argument("--input-mode", choices=("history", "text", "tokens"), default="tokens")
    kl = run.add_mutually_exclusive_group()
    kl.add_argument("--kl-coef", type=float, default=None, help="constant KL coefficient (reference: the model itself)")
    kl.add_argument("--kl-target", type=float, default=None, help="adaptive KL controller with this target KL")
    run.add_argument("--envs", type=int, default=4, help="envs stepped together (one model call per turn)")
    run.add_argument("--max-new-tokens", type=int, default=96)
    run.add_argument("--temperature", type=float, default=0.7)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="run episodes in groups of G from the same reset (G samples per problem) and report pass@k per group",
    )
    run.add_argument(
        "--success-threshold",
        type=float,
        default=1.0,
        help="task reward of a successful turn, for tasks without a 'correct' reward component (default 1.0)",
    )
    from chatenv.cli.rollout import add_async_argument, add_workers_argument
    from chatenv.cli.trackers import add_tracker_argument

    add_async_argument(run)
    add_workers_argument(run)
    add_tracker_argument(run)
    run.add_argument("--out", required=True, help="output folder (created; an existing run is never replaced)")
    again = run.add_mutually_exclusive_group()
    again.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    again.add_argument("--resume", action="store_true", help="add episodes to an existing run in --out")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chatenv", description="LLM chats as Gymnasium environments: run policies, save trajectories."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("envs", help="list the registered environments")
    _rollout_parser(sub)
    from chatenv.cli.train import add_train_parser

    add_train_parser(sub)
    from chatenv.cli.eval import add_eval_parser

    add_eval_parser(sub)
    from chatenv.cli.serve import add_serve_parser

    add_serve_parser(sub)
    from chatenv.cli.serve_env import add_serve_env_parser

    add_serve_env_parser(sub)
    from chatenv.cli.export import add_export_parser

    add_export_parser(sub)
    chk = sub.add_parser("check", help="check that an env keeps what an LLM env must keep (chatenv.check)")
    chk.add_argument("env", nargs="?", default=None, help="registered env id (default: every registered env)")
    chk.add_argument(
        "--input-mode", choices=("history", "text", "tokens"), default=None, help="turn-level envs (default: all)"
    )
    chk.add_argument("--seed", type=int, default=0)
    chk.add_argument(
        "--template",
        metavar="FILE_OR_TOKENIZER_DIR",
        default=None,
        help="certify a chat template (a .jinja file, or a tokenizer folder) and print what was derived from it",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``chatenv`` console script; returns the exit code (2 for bad arguments)."""
    args = _parser().parse_args(argv)
    if args.command == "envs":
        return _list_envs()
    if args.command == "check":
        return _check(args)
    if args.command == "train":
        from chatenv.cli.train import run_train

        return run_train(args)
    if args.command == "eval":
        from chatenv.cli.eval import run_eval

        return run_eval(args)
    if args.command == "export":
        from chatenv.cli.export import run_export

        return run_export(args)
    if args.command == "serve":
        from chatenv.cli.serve import run_serve

        return run_serve(args)
    if args.command == "serve-env":
        from chatenv.cli.serve_env import run_serve_env

        return run_serve_env(args)
    from chatenv.cli.rollout import run_rollout

    return run_rollout(args)


def _check(args: argparse.Namespace) -> int:
    import gymnasium as gym

    if args.template is not None:
        from chatenv.cli.template_check import check_template

        return check_template(args.template, seed=args.seed)
    from chatenv.checker import check
    from chatenv.envs import ENVS, is_token_level

    ids = list(ENVS) if args.env is None else [args.env]
    if args.env is not None and args.env not in gym.registry:
        return fail(f"unknown env {args.env!r}; `chatenv envs` lists them")
    failed = 0
    for env_id in ids:
        token_level = is_token_level(env_id)
        modes = [None] if token_level else ([args.input_mode] if args.input_mode else ["history", "text", "tokens"])
        for mode in modes:
            kwargs: dict[str, Any] = {} if mode is None else {"input_mode": mode}
            report = check(functools.partial(gym.make, env_id, **kwargs), seed=args.seed, raise_on_failure=False)
            report.env = env_id + (f" (input_mode={mode})" if mode else "")
            print(report)
            failed += not report.ok
    return 1 if failed else 0


def _list_envs() -> int:
    from chatenv.envs import ENVS

    width = max(len(k) for k in ENVS)
    for env_id, (_, description) in ENVS.items():
        print(f"{env_id:<{width}}  {description}")
    return 0


def fail(message: str) -> int:
    """Print a usage error and return exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2
