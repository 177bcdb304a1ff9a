"""Branching rollouts: G continuations of one episode's last turn vs G fresh replies vs G whole episodes again.

Run: .venv/bin/python benchmarks/branching.py [--branches 8] [--max-new-tokens 32] [--repeats 3] [--device cpu]

The embedded SmolLM2-135M-Instruct (transformers; one thread on the CPU) plays a three-turn chat. Every reply is
exactly ``--max-new-tokens`` tokens (``min_new_tokens`` = ``max_new_tokens``), so every contestant generates the
same number of tokens per reply. Side by side, in one run, medians over ``--repeats`` rounds:

- **fresh replies**: the policy called once on G copies of the branch point's prompt (no env, no fork): the floor;
- **branch_rollout**: ``chatenv.rollout.branch_rollout(point, policy, n=G)`` from turn 3 of 3: G forks, one
  batched round, the envs stepped (task, continuation ids, bookkeeping);
- **whole episodes again**: ``chatenv.rollout`` of G episodes from their reset (3 rounds), what branching saves.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _device import add_device_argument, device_label, setup_device

from chatenv import ChatEnv, Task, TaskResponse, TaskStart, rollout
from chatenv.rollout import branch_rollout


class ThreeTurns(Task):
    """Three questions, one per turn; every reply scores 1."""

    questions = ("Describe the sea.", "Describe a forest.", "Describe a city at night.")

    def reset(self, rng):
        return TaskStart([{"role": "user", "content": self.questions[0]}], {"turn": 0})

    def respond(self, messages, state):
        state["turn"] += 1
        done = state["turn"] >= len(self.questions)
        return TaskResponse(1.0, done, [] if done else [{"role": "user", "content": self.questions[state["turn"]]}])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args, threads=1)
    from chatenv.models import load_default_model
    from wrappers.policies import TransformersWrapper

    model, tokenizer = load_default_model(device=device)
    n, length = args.branches, args.max_new_tokens
    policy = TransformersWrapper(
        model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate_kwargs={"max_new_tokens": length, "min_new_tokens": length, "do_sample": True, "seed": 0},
    )
    point = ChatEnv(ThreeTurns(), input_mode="tokens", tokenizer=tokenizer)
    point.reset(seed=0)
    for _ in range(2):  # to the last turn, with the model's own replies
        reply = policy(policy_input(policy, point)).get(policy.tokens_key).unpadded("response")[0]
        point.step(reply.numpy())

    def fresh() -> None:
        policy(policy_input(policy, point, copies=n))

    def branched() -> None:
        td = branch_rollout(point, policy, n=n)
        assert td.batch_size[0] == n

    def again() -> None:
        envs = [ChatEnv(ThreeTurns(), input_mode="tokens", tokenizer=tokenizer) for _ in range(n)]
        td = rollout(envs, policy, episodes=n, seed=0)
        assert td.batch_size[0] == 3 * n

    contestants = {"fresh replies (floor)": fresh, "branch_rollout (turn 3 of 3)": branched, "whole episodes": again}
    times: dict[str, list[float]] = {name: [] for name in contestants}
    fresh()  # warm up
    for _ in range(args.repeats):
        for name, fn in contestants.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    floor = statistics.median(times["fresh replies (floor)"])
    where = device_label(device)
    print(f"{n} continuations of {length} tokens each, SmolLM2-135M, {where}, medians of {args.repeats}\n")
    print(f"| {'how':<30} | {'seconds':>8} | {'x fresh':>8} |")
    print(f"|{'-' * 32}|{'-' * 10}|{'-' * 10}|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name:<30} | {median:>8.2f} | {median / floor:>8.2f} |")
    ratio = statistics.median(times["branch_rollout (turn 3 of 3)"]) / statistics.median(times["whole episodes"])
    print(f"\nbranch_rollout / whole episodes: {ratio:.2f}")


def policy_input(policy, env, copies: int = 1):
    """The policy's input for ``copies`` copies of an env's current token view (as ``chatenv.rollout`` builds it)."""
    from chatenv.modes import get_mode

    ids, mask = env.unwrapped.token_view()
    return get_mode("tokens").policy_input(
        [ids] * copies,
        input_key=policy.input_key,
        pad_token_id=policy.pad_token_id,
        token_views=[(ids, mask)] * copies,
        tokens_key=policy.tokens_key,
        masks_key=policy.masks_key,
    )


if __name__ == "__main__":
    main()
