"""Episodes per second with 1 vs 2 Ray env workers when the reward is CPU-bound.

Run: .venv/bin/python benchmarks/distributed.py [--envs 4] [--episodes 32] [--burn-ms 50] [--cpus 2] [--device cpu]

Setup: a local Ray cluster (``--cpus``); one inference actor with a fixed tiny policy (a 2-layer random Llama on
SmolLM2's tokenizer, greedy, 4 new tokens); Arithmetic envs (tokens mode, at most 2 turns) whose reward first burns
``--burn-ms`` of CPU in pure Python (a judge, a verifier, a test run). The same ``--envs`` envs are held by one
env worker, then split over two; each configuration is warmed up, then collects ``--episodes`` episodes.

In one worker the rewards of a round run on threads of one process and share its interpreter lock, so they run one
after the other; two workers are two processes, so two rewards run at once when two cores are free.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import ray
from _device import add_device_argument, device_label, setup_device

from chatenv import ChatEnv
from chatenv.distributed import RayCollector
from chatenv.models import load_default_tokenizer
from chatenv.tasks import ArithmeticTask
from wrappers.distributed import TransformersFactory

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from conftest import make_tiny_llama  # noqa: E402


class BurningArithmetic(ArithmeticTask):
    """Arithmetic whose reward costs ``burn_ms`` of CPU time (pure Python, holding the interpreter lock)."""

    def __init__(self, burn_ms: float, **kwargs):
        super().__init__(**kwargs)
        self.burn_ms = burn_ms

    def respond(self, messages, state):
        end = time.thread_time() + self.burn_ms / 1000
        x = 0
        while time.thread_time() < end:
            x += sum(i * i for i in range(200))
        return super().respond(messages, state)


def env_factory(tokenizer, burn_ms: float):
    def make():
        return ChatEnv(BurningArithmetic(burn_ms, max_attempts=2), input_mode="tokens", tokenizer=tokenizer)

    return make


def measure(workers: int, args, path: str, tokenizer) -> tuple[float, float]:
    """(episodes/s, seconds) of one collection with ``workers`` env workers."""
    settings = {"max_new_tokens": 4, "temperature": 0}
    policy = TransformersFactory(path, device=args.device, input_mode="tokens", generate_kwargs=settings)
    gpus = 1 if args.device == "cuda" else 0
    envs = [env_factory(tokenizer, args.burn_ms)] * args.envs
    with RayCollector(
        envs,
        policy,
        num_env_workers=workers,
        num_inference_actors=1,
        worker_cpus=0,
        inference_cpus=0,
        inference_gpus=gpus,
    ) as collector:
        collector.collect(episodes=args.envs, seed=0)  # warm-up: first requests, first resets
        start = time.perf_counter()
        td = collector.collect(episodes=args.episodes, seed=1)
        wall = time.perf_counter() - start
        assert len(set(td["episode"].tolist())) == args.episodes and collector.lost == []
    return args.episodes / wall, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", type=int, default=4)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--burn-ms", type=float, default=50.0)
    parser.add_argument("--cpus", type=int, default=2)
    add_device_argument(parser)
    args = parser.parse_args()
    args.device = setup_device(parser, args)
    tokenizer = load_default_tokenizer()
    with tempfile.TemporaryDirectory() as path:
        make_tiny_llama(0).save_pretrained(path)
        tokenizer.save_pretrained(path)
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        try:
            results = {w: measure(w, args, path, tokenizer) for w in (1, 2)}
        finally:
            ray.shutdown()
    print(
        f"{args.episodes} episodes, {args.envs} envs, reward burns {args.burn_ms:.0f} ms CPU, "
        f"{args.cpus} CPUs for Ray (machine: {os.cpu_count()} cores), "
        f"policy on {device_label(args.device, threads=False)}"
    )
    print(f"{'env workers':<12} {'episodes/s':>10} {'wall s':>8}")
    for w, (rate, wall) in results.items():
        print(f"{w:<12} {rate:>10.2f} {wall:>8.2f}")
    print(f"ratio 2 / 1 workers: {results[2][0] / results[1][0]:.2f}x")


if __name__ == "__main__":
    main()
