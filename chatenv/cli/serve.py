"""``chatenv serve``: a model behind an OpenAI-compatible endpoint that records token-exact trajectories.

``chatenv serve --model default --port 8000`` serves the embedded SmolLM2 (or ``--model PATH``, ``--backend vllm``)
at ``http://127.0.0.1:8000/v1``; point any OpenAI client there and read each session's trajectory from
``GET /v1/sessions/{id}`` (see :mod:`chatenv.serve.app`). Needs the ``serve`` extra (fastapi, uvicorn).
"""

from __future__ import annotations

import argparse
import os

from chatenv.cli.common import add_model_arguments, build_policy, settings_problem

__all__ = ["add_key_arguments", "add_serve_parser", "listening_problem", "run_serve", "server_keys"]


def add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``serve`` subcommand to the ``chatenv`` parser."""
    run = sub.add_parser("serve", help="serve a model behind an OpenAI-compatible endpoint that records trajectories")
    add_model_arguments(run)
    run.add_argument("--model-name", default="chatenv-policy", help="the model id clients ask for")
    run.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (default: loopback only; others need an API key)"
    )
    add_key_arguments(run)
    run.add_argument("--port", type=int, default=8000)
    run.add_argument("--max-new-tokens", type=int, default=256, help="reply budget when a request sets no max_tokens")
    run.add_argument("--temperature", type=float, default=1.0, help="when a request sets none")
    run.add_argument("--max-context", type=int, default=None, help="most tokens of prompt + reply (default: model's)")
    run.add_argument("--max-batch", type=int, default=32, help="most rows per policy call")
    run.add_argument("--seed", type=int, default=None)
    run.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def add_key_arguments(run: argparse.ArgumentParser) -> None:
    """``--api-key`` and ``--no-api-key``, as both servers take them."""
    run.add_argument(
        "--api-key",
        action="append",
        help="clients must send 'Authorization: Bearer KEY' (default: $CHATENV_API_KEY, else a key made at start and "
        "written to a file only you can read); repeat it to give several keys, each with its own sessions",
    )
    run.add_argument(
        "--no-api-key",
        action="store_true",
        help="serve without a key (loopback only): anyone on this machine can then read, reward and delete sessions",
    )


def server_keys(args: argparse.Namespace, name: str) -> list[str] | None:
    """The server's API keys: those given, else none with ``--no-api-key``, else one made now (and where it is).

    The made key is written to a file only this user can read (:func:`chatenv.web.make_local_key`), whose path is
    printed for the clients this user starts (the key itself is not printed: logs are often readable by others).

    Raises:
        OSError: When the port is taken (a running server's key file is never replaced) or the file cannot be made.
    """
    if args.api_key is not None or args.no_api_key:
        return None if args.no_api_key else list(args.api_key)
    from chatenv.web import make_local_key

    _check_port_free(args.host, args.port)  # never replace the key file of a server already on this port
    key, path = make_local_key(name, args.host, args.port)
    print(
        f"API key: made at start, in {path} (readable only by you; not printed, so logs do not hold it)\n"
        f"  clients send it as 'Authorization: Bearer KEY' (the OpenAI client's api_key: "
        f"OPENAI_API_KEY=$(cat {path})); give --api-key KEY to choose one, or --no-api-key to serve without",
        flush=True,
    )
    return [key]


def _check_port_free(host: str, port: int) -> None:
    """Raise OSError when ``host:port`` is taken (port 0 is always free)."""
    import socket

    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))


def _check(args: argparse.Namespace) -> str | None:
    if not 0 <= args.port < 65536:
        return f"--port must be in [0, 65535], got {args.port}"
    if args.max_batch < 1:
        return f"--max-batch must be >= 1, got {args.max_batch}"
    problem = settings_problem(args)
    if problem:
        return problem
    if args.max_context is not None and args.max_context < 2:
        return f"--max-context must be >= 2, got {args.max_context}"
    if args.engine_memory <= 0:
        return f"--engine-memory must be > 0 GiB, got {args.engine_memory}"
    return listening_problem(args)


def listening_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--host``, ``--api-key`` and ``--no-api-key`` (``$CHATENV_API_KEY`` filled in), or None."""
    if args.api_key is None and os.environ.get("CHATENV_API_KEY"):
        args.api_key = [os.environ["CHATENV_API_KEY"]]
    if getattr(args, "no_api_key", False) and args.api_key is not None:
        return "--no-api-key and --api-key (or $CHATENV_API_KEY) contradict each other: give one"
    if args.api_key is not None and any(len(key) < 8 for key in args.api_key):
        return "--api-key must be at least 8 characters"
    from chatenv.web import check_binding

    try:  # beyond loopback, a key given by the user (one made at start is for this machine's users)
        check_binding(args.host, args.api_key)
    except ValueError as e:
        return str(e)
    return None


def run_serve(args: argparse.Namespace) -> int:
    """Run ``chatenv serve`` with parsed arguments; returns the exit code (serves until interrupted)."""
    from chatenv.cli import fail
    from chatenv.errors import MissingDependencyError
    from chatenv.web import require_serve_extra

    problem = _check(args)
    if problem is not None:
        return fail(problem)
    try:
        require_serve_extra()
    except MissingDependencyError as e:
        return fail(str(e))
    from chatenv.serve.server import serve_forever

    try:
        keys = server_keys(args, "serve")
    except OSError as e:  # the port is taken, or the key file cannot be made private
        return fail(f"cannot start on {args.host}:{args.port}: {e}")
    policy = build_policy(args, max_num_seqs=args.max_batch, context=args.max_context)
    print(f"serving {args.model!r} as {args.model_name!r} at http://{args.host}:{args.port}/v1", flush=True)
    try:
        serve_forever(
            policy,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            model_name=args.model_name,
            max_context=args.max_context,
            max_batch=args.max_batch,
            api_key=keys,
        )
    except KeyboardInterrupt:
        pass
    return 0
