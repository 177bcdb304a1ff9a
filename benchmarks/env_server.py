"""The env server's per-step overhead over loopback: EnvClient over HTTP and WebSocket vs stepping in-process.

Run: .venv/bin/python benchmarks/env_server.py [--steps 200] [--repeats 5] [--device cpu]

For a turn-level env (``chatenv/Arithmetic-v0`` in tokens mode: one step is one reply's ids) and a token-level one
(``chatenv/TokenArithmetic-v0``: one step is one token id), the same scripted actions are stepped on an env in this
process and through :class:`~chatenv.envserver.EnvClient` on an :class:`~chatenv.envserver.EnvServer` in a thread
of this process (loopback), over HTTP and over the WebSocket. Resets are not timed. Each row: the median time of
one step (medians over ``--repeats`` interleaved rounds of ``--steps`` steps), the overhead over in-process, and
the ratio. The envs run on the CPU whatever ``--device`` says (there is no model here); the header names it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from _device import add_device_argument, device_label, setup_device

import chatenv  # noqa: F401  (registers the env ids)
from chatenv.envserver import EnvClient, EnvServer


def _reply_ids(text: str) -> list[int]:
    env = gym.make("chatenv/Arithmetic-v0", input_mode="tokens").unwrapped
    env.reset(seed=0)
    ids: list[int] = env.chat_tokenizer.reply(env.messages, {"role": "assistant", "content": text}).ids.tolist()
    env.close()
    return ids


def _stepping(env: Any, actions: Callable[[int], Any], steps: int) -> list[float]:
    """Per-step times of ``steps`` steps (an ended episode is reset, untimed)."""
    times = []
    env.reset(seed=0)
    for i in range(steps):
        action = actions(i)
        t = time.perf_counter()
        _, _, terminated, truncated, _ = env.step(action)
        times.append(time.perf_counter() - t)
        if terminated or truncated:
            env.reset(seed=i)
    return times


def _compare(env_id: str, kwargs: dict[str, Any], actions: Callable[[int], Any], args: argparse.Namespace) -> None:
    with EnvServer(env_id, **kwargs) as server:
        contestants = {
            "in-process": gym.make(env_id, **kwargs),
            "EnvClient http": EnvClient(server.url),
            "EnvClient ws": EnvClient(server.url, transport="ws"),
        }
        medians: dict[str, list[float]] = {name: [] for name in contestants}
        for env in contestants.values():
            _stepping(env, actions, 10)  # warm-up
        for r in range(args.repeats):
            order = list(contestants.items())
            for name, env in order if r % 2 == 0 else reversed(order):
                medians[name].append(statistics.median(_stepping(env, actions, args.steps)))
        for env in contestants.values():
            env.close()
    base = statistics.median(medians["in-process"])
    print(f"\n{env_id} {kwargs or ''}: one step, medians of {args.repeats} x {args.steps} steps")
    print(f"{'contestant':<18} {'median us':>10} {'overhead us':>12} {'ratio':>8}")
    for name, values in medians.items():
        m = statistics.median(values)
        print(f"{name:<18} {m * 1e6:>10.1f} {(m - base) * 1e6:>12.1f} {m / base:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per round")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args, threads=1)
    print(f"env server overhead over loopback, {device_label(device)} (envs on the CPU, server in this process)")
    replies = [np.asarray(_reply_ids(f"<answer>{n}</answer>"), dtype=np.int64) for n in range(3)]
    _compare("chatenv/Arithmetic-v0", {"input_mode": "tokens"}, lambda i: replies[i % 3], args)
    # a reply that never ends (no end-of-turn id): every step is one token of a long reply
    tokens = _reply_ids("a long reply that goes on " * 8)[:-1]
    _compare("chatenv/TokenArithmetic-v0", {"max_new_tokens": 10_000}, lambda i: tokens[i % len(tokens)], args)


if __name__ == "__main__":
    main()
