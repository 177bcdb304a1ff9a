"""Episode vs turn credit in GRPO on a task whose first turn decides the outcome, scored only at the end.

Run: .venv/bin/python benchmarks/credit.py [--seeds 3] [--steps 10] [--prompts 3] [--group-size 4] [--device cpu]

The task (:class:`ChooseThenAdd`): turn 1 asks for a whole number from 1 to 9 (0.1 when the reply names one);
turn 2 asks to add 3 to it (0.1 when the reply names a number, and 1.0 if the first number named at turn 1 was
even: the early choice is paid only at the end). With ``credit="episode"`` every token of an episode gets the episode's
group-normalised return; with ``credit="turn"`` each reply gets its own return-to-go against the same turn of the
other episodes of its group (leave-one-out baseline, :mod:`chatenv.rollout.credit`); with ``credit="branch"`` each
reply gets ``r + V(after) - V(before)``, the state values sampled by ``--branches`` continuations of a fork kept
between the turns (``rollout(on_turn=...)``, ``branch_rollout``; their tokens are counted too). The embedded
SmolLM2-135M-Instruct, GRPO with the KL term to its frozen start (coef 0.05), the same seeds, steps and sampling for
both; generated tokens are counted, so the runs are compared at (nearly) equal generation cost.

Printed: per credit, the mean over seeds of the reward and of the even-choice rate in the first and last two steps,
and the generated tokens; ``--plot PATH`` saves the curves against generated tokens (needs matplotlib, the ``plot``
extra). Branch credit generates more per step: compare it at equal tokens (the curves), or give it fewer steps.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

import torch
from _device import add_device_argument, device_label, setup_device

from chatenv import ChatEnv, Task, TaskResponse, TaskStart, episodes, fork, rollout
from chatenv.rollout import branch_rollout
from chatenv.rollout.credit import branch_values

_NUMBER = re.compile(r"-?\d+")


class ChooseThenAdd(Task):
    """Two turns: choose a number, then add 3 to it; an even first choice is rewarded at the end."""

    def reset(self, rng):
        opening = "Choose a whole number from 1 to 9. Reply with it in <answer></answer> tags."
        return TaskStart([{"role": "user", "content": opening}], {"choice": None, "turn": 0})

    def respond(self, messages, state):
        found = _NUMBER.search(messages[-1]["content"])
        value = int(found.group(0)) if found else None
        state["turn"] += 1
        if state["turn"] == 1:
            state["choice"] = value
            ask = "Now add 3 to your number. Reply with the result in <answer></answer> tags."
            return TaskResponse(0.1 if value is not None else 0.0, False, [{"role": "user", "content": ask}])
        even = state["choice"] is not None and 1 <= state["choice"] <= 9 and state["choice"] % 2 == 0
        components = {"format": 0.1 if value is not None else 0.0, "even_choice": 1.0 if even else 0.0}
        return TaskResponse(sum(components.values()), True, components=components)


def run(credit: str, seed: int, args: argparse.Namespace) -> list[dict[str, float]]:
    from chatenv.models import load_default_model
    from wrappers.grpo import GRPOConfig, GRPOLearner
    from wrappers.kl import ReferenceModel, RefLogProbs
    from wrappers.policies import TransformersWrapper

    torch.manual_seed(seed)
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": 0.7, "seed": seed}
    model, tokenizer = load_default_model(device=args.device)
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=settings)
    ref_model, _ = load_default_model(device=args.device)
    ref = ReferenceModel(ref_model, tokenizer, temperature=0.7, kv_cache_size=0)
    n = args.prompts * args.group_size
    envs = [
        RefLogProbs(ChatEnv(ChooseThenAdd(), input_mode="tokens", tokenizer=tokenizer, max_turns=2), ref)
        for _ in range(n)
    ]
    learner = GRPOLearner(policy, GRPOConfig(lr=3e-5, kl=0.05, credit=credit))
    rows = []
    for step in range(args.steps):
        kept: list = []
        keep = (lambda env, e, t, kept=kept: kept.append(((e, t), fork(env)))) if credit == "branch" else None
        td = rollout(
            envs, policy, episodes=n, group_size=args.group_size, seed=seed * 10_000 + step * 100, on_turn=keep
        )
        view = episodes(td)
        values, extra = None, 0
        if credit == "branch":
            branches = branch_rollout([f for _, f in kept], policy, n=args.branches) if kept else None
            extra = sum(len(r) for r in branches["tokens"].unpadded("response")) if kept else 0
            values = branch_values(view, [k for k, _ in kept], episodes(branches) if kept else None)
            for _, f in kept:
                f.close()
        metrics = learner.step(view, values=values)
        even = td["next", "reward_components", "even_choice"][td["next", "done"]]
        rows.append(
            {
                "reward": float(view["reward"].mean()),
                "even": float(torch.nan_to_num(even).mean()),
                "tokens": float(metrics["tokens"]) + extra,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--branches", type=int, default=2, help="continuations per state with branch credit")
    parser.add_argument("--credits", default="episode,turn,branch", help="comma-separated credits to compare")
    parser.add_argument("--plot", default=None)
    add_device_argument(parser)
    args = parser.parse_args()
    args.device = setup_device(parser, args, threads=2)
    curves: dict[str, list[list[dict[str, float]]]] = {c: [] for c in args.credits.split(",")}
    start = time.perf_counter()
    for seed in range(args.seeds):
        for credit in curves:
            curves[credit].append(run(credit, seed, args))
            print(f"seed {seed} credit {credit}: done ({time.perf_counter() - start:.0f} s)", flush=True)
    print(
        f"\n{args.seeds} seeds x {args.steps} steps, {args.prompts} prompts x {args.group_size} episodes per step, "
        f"{device_label(args.device)}\n"
    )
    print(f"| {'credit':<8} | {'reward first 2':>14} | {'reward last 2':>13} | {'even first 2':>12} | "
          f"{'even last 2':>11} | {'tokens':>7} |")  # fmt: skip
    print(f"|{'-' * 10}|{'-' * 16}|{'-' * 15}|{'-' * 14}|{'-' * 13}|{'-' * 9}|")
    for credit, runs in curves.items():

        def mean(key: str, steps: slice, runs=runs) -> float:
            return statistics.mean(r[key] for rows in runs for r in rows[steps])

        tokens = statistics.mean(sum(r["tokens"] for r in rows) for rows in runs)
        print(
            f"| {credit:<8} | {mean('reward', slice(0, 2)):>14.3f} | {mean('reward', slice(-2, None)):>13.3f} | "
            f"{mean('even', slice(0, 2)):>12.3f} | {mean('even', slice(-2, None)):>11.3f} | {tokens:>7.0f} |"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
        for credit, runs in curves.items():
            for ax, key in zip(axes, ("reward", "even")):
                per_step = [statistics.mean(rows[s][key] for rows in runs) for s in range(args.steps)]
                spent = [
                    statistics.mean(sum(r["tokens"] for r in rows[: s + 1]) for rows in runs) for s in range(args.steps)
                ]
                ax.plot(spent, per_step, marker=".", label=f"credit={credit}")
                ax.set_xlabel("generated tokens")
                ax.set_ylabel({"reward": "task reward", "even": "even first choice"}[key])
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=90)


if __name__ == "__main__":
    main()
