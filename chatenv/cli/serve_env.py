"""``chatenv serve-env``: a registered env over HTTP and WebSocket, one env per client session.

``chatenv serve-env chatenv/Arithmetic-v0 --env-kwargs '{"input_mode": "tokens"}' --port 8001`` serves the env at
``http://127.0.0.1:8001`` in OpenEnv's protocol (``POST /reset``, ``POST /step``, ``GET /state``, ``GET /schema``,
``WS /ws``...; see :mod:`chatenv.envserver.app`): openenv-core's clients work on it, and
``chatenv.envserver.EnvClient("http://127.0.0.1:8001")`` is a Gymnasium env on it.
Needs the ``serve`` extra (fastapi, uvicorn).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["add_serve_env_parser", "run_serve_env"]


def add_serve_env_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``serve-env`` subcommand to the ``chatenv`` parser."""
    from chatenv.cli.serve import add_key_arguments

    run = sub.add_parser("serve-env", help="serve a registered env over HTTP and WebSocket (one env per session)")
    run.add_argument("env", help="registered env id (see `chatenv envs`)")
    run.add_argument(
        "--env-kwargs",
        default="{}",
        metavar="JSON",
        help='arguments of gymnasium.make(ENV_ID, ...) as a JSON object, e.g. \'{"input_mode": "tokens"}\'',
    )
    run.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (default: loopback only; others need an API key)"
    )
    run.add_argument("--port", type=int, default=8000)
    add_key_arguments(run)
    run.add_argument(
        "--max-sessions", type=int, default=64, help="most open sessions; the least recently used idle one is closed"
    )
    run.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def _check(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port < 65536:
        return f"--port must be in [0, 65535], got {args.port}"
    if args.max_sessions < 1:
        return f"--max-sessions must be >= 1, got {args.max_sessions}"
    try:
        kwargs: Any = json.loads(args.env_kwargs)
    except json.JSONDecodeError as e:
        return f"--env-kwargs is not valid JSON: {e}"
    if not isinstance(kwargs, dict):
        return f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}"
    args.env_kwargs = kwargs
    from chatenv.cli.serve import listening_problem

    return listening_problem(args)


def run_serve_env(args: argparse.Namespace) -> int:
    """Run ``chatenv serve-env`` with parsed arguments; returns the exit code (serves until interrupted)."""
    import gymnasium as gym

    from chatenv.cli import fail
    from chatenv.errors import MissingDependencyError
    from chatenv.web import require_serve_extra

    problem = _check(args)
    if problem is not None:
        return fail(problem)
    if args.env not in gym.registry:
        return fail(f"unknown env {args.env!r}; `chatenv envs` lists them")
    try:
        require_serve_extra()
    except MissingDependencyError as e:
        return fail(str(e))
    from chatenv.cli.serve import server_keys
    from chatenv.envserver.server import serve_env_forever

    try:
        keys = server_keys(args, "serve-env")
    except OSError as e:  # the port is taken, or the key file cannot be made private
        return fail(f"cannot start on {args.host}:{args.port}: {e}")

    print(f"serving {args.env!r} at http://{args.host}:{args.port} (max {args.max_sessions} sessions)", flush=True)
    try:
        serve_env_forever(
            args.env,
            args.env_kwargs,
            host=args.host,
            port=args.port,
            api_key=keys,
            max_sessions=args.max_sessions,
            log_level=args.log_level,
        )
    except (TypeError, ValueError) as e:  # env kwargs the env refuses
        return fail(f"{args.env}: {e}")
    except KeyboardInterrupt:
        pass
    return 0
