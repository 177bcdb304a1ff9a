"""The ``chatenv`` command: run a policy on a registered env and save the trajectories.

``chatenv rollout --env chatenv/Arithmetic-v0 --episodes 16 --max-turns 3 --out runs/demo`` runs episodes with the
embedded SmolLM2 (or ``--model PATH``), optionally with a KL penalty to the model's own frozen copy, shows a
progress bar, prints a summary table, and writes ``episodes.jsonl`` (one line per episode) and ``curves.png``
(reward and KL per turn) under ``--out``. Ctrl-C stops early and still writes what was collected.
``chatenv envs`` lists the registered environments.

The policy and KL parts come from the ``wrappers`` package, imported only when a rollout runs.
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

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chatenv", description="LLM chats as Gymnasium environments: run policies, save trajectories."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("envs", help="list the registered environments")
    run = sub.add_parser("rollout", help="run episodes with a model and save them")
    run.add_argument("--env", default="chatenv/Arithmetic-v0", help="registered env id (see `chatenv envs`)")
    run.add_argument("--episodes", type=int, default=16, help="episodes to run")
    run.add_argument("--max-turns", type=int, default=None, help="assistant turns per episode (default: the task's)")
    run.add_argument("--model", default="default", help="'default' (embedded SmolLM2-135M-Instruct) or a model path")
    run.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
    run.add_argument("--input-mode", choices=("history", "text", "tokens"), default="tokens")
    kl = run.add_mutually_exclusive_group()
    kl.add_argument("--kl-coef", type=float, default=None, help="constant KL coefficient (reference: the model itself)")
    kl.add_argument("--kl-target", type=float, default=None, help="adaptive KL controller with this target KL")
    run.add_argument("--envs", type=int, default=4, help="envs stepped together (one model call per turn)")
    run.add_argument("--max-new-tokens", type=int, default=96)
    run.add_argument("--temperature", type=float, default=0.7)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--out", required=True, help="output folder (created)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``chatenv`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "envs":
        return _list_envs()
    return _rollout(args)


def _list_envs() -> int:
    from chatenv.envs import ENVS

    width = max(len(k) for k in ENVS)
    for env_id, (_, description) in ENVS.items():
        print(f"{env_id:<{width}}  {description}")
    return 0


def _rollout(args: argparse.Namespace) -> int:
    import gymnasium as gym
    import torch

    import chatenv  # noqa: F401  (registers the envs)

    if args.episodes < 1 or args.envs < 1:
        print("error: --episodes and --envs must be >= 1", file=sys.stderr)
        return 2
    if args.env not in gym.registry:
        print(f"error: unknown env {args.env!r}; `chatenv envs` lists them", file=sys.stderr)
        return 2
    if args.env.startswith("chatenv/Token"):
        print(
            "error: `chatenv rollout` runs turn-level envs; use TokenEnv from Python for token-level ones",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    policy, ref = _policy(args)
    kwargs: dict[str, Any] = {"input_mode": args.input_mode, "tokenizer": policy.tokenizer}
    if args.max_turns is not None:
        kwargs["max_turns"] = args.max_turns
    envs = [_with_kl(gym.make(args.env, **kwargs), args, ref) for _ in range(min(args.envs, args.episodes))]
    from chatenv.rollout import rollout

    episodes: list[dict] = []
    start = time.perf_counter()
    tokens = 0
    bar = _progress(args.episodes)
    try:
        while len(episodes) < args.episodes:
            n = min(len(envs), args.episodes - len(episodes))
            td = rollout(envs[:n], policy, episodes=n, seed=args.seed + len(episodes))
            batch = _episodes(td, policy, offset=len(episodes))
            episodes.extend(batch)
            tokens += sum(sum(e["response_tokens"]) for e in batch)
            bar.update(len(batch))
    except KeyboardInterrupt:
        print("\ninterrupted: writing the episodes collected so far", file=sys.stderr)
    finally:
        bar.close()
        wall = time.perf_counter() - start
        _write(out, episodes, args)
        _summary(episodes, tokens, wall, out)
    for env in envs:
        env.close()
    return 0


def _policy(args: argparse.Namespace) -> tuple[Any, Any]:
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "seed": args.seed}
    if args.backend == "vllm":
        from wrappers.policies import VLLMWrapper

        path = str(_model_path(args.model))
        policy = VLLMWrapper(path, input_mode=args.input_mode, generate_kwargs=settings)
    else:
        from wrappers.policies import TransformersWrapper

        policy = TransformersWrapper(args.model, input_mode=args.input_mode, generate_kwargs=settings)
    ref = None
    if args.kl_coef is not None or args.kl_target is not None:
        from wrappers.kl import ReferenceModel

        # the policy reports tempered log-probs: compare with the reference at the same temperature
        ref = ReferenceModel(
            args.model if args.backend == "transformers" else str(_model_path(args.model)),
            temperature=args.temperature if args.temperature > 0 else 1.0,
        )
    return policy, ref


def _model_path(model: str) -> Any:
    if model == "default":
        from chatenv.models import default_model_path

        return default_model_path()
    return model


def _with_kl(env: Any, args: argparse.Namespace, ref: Any) -> Any:
    if ref is None:
        return env
    from wrappers.kl import KLPenalty
    from wrappers.kl_controllers import AdaptiveKLController

    if args.kl_target is not None:
        return KLPenalty(env, controller=AdaptiveKLController(0.05, target=args.kl_target, horizon=100), ref_model=ref)
    return KLPenalty(env, args.kl_coef, ref_model=ref)


def _episodes(td: Any, policy: Any, offset: int) -> list[dict]:
    """One dict per episode: messages (parsed from the last turn's ids), per-turn rewards, KL, token counts."""
    ct = policy.chat_tokenizer
    tokens = td["tokens"]
    prompts, responses = tokens.unpadded("prompt"), tokens.unpadded("response")
    rewards = td["next", "reward"][:, 0].tolist()
    task = td["next", "task_reward"][:, 0].tolist() if ("next", "task_reward") in td.keys(True) else rewards
    kl_rows = None
    if "kl" in td.keys():
        kl_rows = [float(torch_nansum(r)) for r in td["kl"].unpadded("response")]
    out: dict[int, dict] = {}
    for k, ep in enumerate(td["episode"].tolist()):
        e = out.setdefault(
            ep, {"episode": offset + ep, "rewards": [], "task_rewards": [], "kl": [], "response_tokens": []}
        )
        e["rewards"].append(rewards[k])
        e["task_rewards"].append(task[k])
        e["kl"].append(kl_rows[k] if kl_rows is not None else None)
        e["response_tokens"].append(len(responses[k]))
        e["last"] = k
        e["terminated"] = bool(td["next", "terminated"][k, 0])
        e["truncated"] = bool(td["next", "truncated"][k, 0])
    for e in out.values():
        k = e.pop("last")
        text = ct.decode(prompts[k].tolist() + responses[k].tolist())
        try:
            e["messages"] = ct.template.parse(text)
        except ValueError:
            e["messages"] = [{"role": "raw", "content": text}]
        e["turns"] = len(e["rewards"])
    return [out[k] for k in sorted(out)]


def torch_nansum(values: Any) -> float:
    """Sum of the defined values."""
    return float(sum(v for v in values.tolist() if not math.isnan(v)))


class _Bar:
    def __init__(self, total: int):
        self.total, self.done = total, 0

    def update(self, n: int) -> None:
        self.done += n
        print(f"\r{self.done}/{self.total} episodes", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


def _progress(total: int) -> Any:
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="episode", desc="rollout")
    except ImportError:
        return _Bar(total)


def _write(out: Path, episodes: list[dict], args: argparse.Namespace) -> None:
    with open(out / "episodes.jsonl", "w", encoding="utf-8") as f:
        for e in episodes:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
    (out / "config.json").write_text(json.dumps(vars(args), indent=2))
    if not episodes:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install 'chatenv-gym[plot]')", file=sys.stderr)
        return
    turns = max(e["turns"] for e in episodes)
    mean_reward = [statistics.mean(e["task_rewards"][t] for e in episodes if e["turns"] > t) for t in range(turns)]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].plot(range(1, turns + 1), mean_reward, marker="o")
    axes[0].set(xlabel="turn", ylabel="mean task reward", title="reward per turn")
    kls = [[e["kl"][t] for e in episodes if e["turns"] > t and e["kl"][t] is not None] for t in range(turns)]
    if any(kls):
        axes[1].plot(range(1, turns + 1), [statistics.mean(k) if k else float("nan") for k in kls], marker="o")
    axes[1].set(xlabel="turn", ylabel="mean KL (sum over the turn)", title="KL per turn")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=100)
    plt.close(fig)


def _summary(episodes: list[dict], tokens: int, wall: float, out: Path) -> None:
    totals = [sum(e["task_rewards"]) for e in episodes]
    kls = [k for e in episodes for k in e["kl"] if k is not None]
    rows = [
        ("episodes", f"{len(episodes)}"),
        (
            "task reward (mean ± std)",
            f"{statistics.mean(totals):.3f} ± {statistics.pstdev(totals):.3f}" if totals else "-",
        ),
        ("KL per turn (mean)", f"{statistics.mean(kls):.3f}" if kls else "-"),
        ("turns per episode (mean)", f"{statistics.mean(e['turns'] for e in episodes):.2f}" if episodes else "-"),
        ("generated tokens / s", f"{tokens / wall:.1f}" if wall > 0 else "-"),
        ("wall time", f"{wall:.1f} s"),
        ("written to", str(out)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    raise SystemExit(main())
