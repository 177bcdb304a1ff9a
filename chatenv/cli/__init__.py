"""The ``chatenv`` command: the application layer (the one part of chatenv that imports ``wrappers``, lazily).

- ``chatenv envs`` lists the registered environments.
- ``chatenv rollout --env chatenv/Arithmetic-v0 --episodes 16 --max-turns 3 --out runs/demo`` runs episodes with
  the embedded SmolLM2 (or ``--model PATH``), optionally with a KL penalty to the model's own frozen copy, shows
  a progress bar, prints a summary table, and writes ``episodes.jsonl`` (one line per episode, written as each
  completes), ``config.json`` and ``curves.png`` (reward and KL per turn) under ``--out``. An existing run is
  never replaced unless ``--overwrite`` (or extended with ``--resume``). Ctrl-C or SIGTERM stops early and
  keeps what was collected.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _rollout_parser(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("rollout", help="run episodes with a model and save them")
    run.add_argument("--env", default="chatenv/Arithmetic-v0", help="registered env id (see `chatenv envs`)")
    run.add_argument("--episodes", type=int, default=16, help="episodes to run")
    run.add_argument("--max-turns", type=int, default=None, help="assistant turns per episode (default: the task's)")
    run.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct) or a model path")
    run.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    run.add_argument(
        "--engine-memory", type=float, default=1.0, help="vLLM KV-cache memory in GiB (--backend vllm; default 1)"
    )
    run.add_argument("--input-mode", choices=("history", "text", "tokens"), default="tokens")
    kl = run.add_mutually_exclusive_group()
    kl.add_argument("--kl-coef", type=float, default=None, help="constant KL coefficient (reference: the model itself)")
    kl.add_argument("--kl-target", type=float, default=None, help="adaptive KL controller with this target KL")
    run.add_argument("--envs", type=int, default=4, help="envs stepped together (one model call per turn)")
    run.add_argument("--max-new-tokens", type=int, default=96)
    run.add_argument("--temperature", type=float, default=0.7)
    run.add_argument("--seed", type=int, default=0)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``chatenv`` console script; returns the exit code (2 for bad arguments)."""
    args = _parser().parse_args(argv)
    if args.command == "envs":
        return _list_envs()
    from chatenv.cli.rollout import run_rollout

    return run_rollout(args)


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
