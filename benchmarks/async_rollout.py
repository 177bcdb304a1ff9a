"""Async vs synchronous rollouts on vLLM, with replies of varied lengths, against the engine's own ceiling.

Run: .venv/bin/python benchmarks/async_rollout.py [--envs 8] [--episodes 16] [--max-new-tokens 128] [--device cpu]

The embedded SmolLM2-135M-Instruct answers a two-turn chat whose questions ask for one word or for a long text, so
greedy replies range from a few tokens to ``--max-new-tokens``. Printed side by side, in one run:

- **sync rollout**: ``chatenv.rollout`` on ``vllm.LLM``: one engine call per round; every round waits for its
  longest reply;
- **async rollout**: ``chatenv.rollout(..., mode="async")`` on vLLM's async engine (``AsyncLLM``): each episode's
  next turn is submitted as soon as its step returns, and twice as many episodes as envs run at once (the default
  ``in_flight="auto"``: forks of the envs), so the engine has requests waiting whenever a reply ends;
- **async, one episode per env** (``in_flight=None``): the same without forks: whenever an env steps or has no
  episode left to start, its seat in the engine's batch is empty;
- **raw ceiling**: ``vllm.LLM.generate`` on every prompt of the rollout at once (no turn dependencies, no env
  steps, no wrapper).

Tokens/s counts generated reply tokens over wall time. Both engines run side by side (one busy at a time), are
warmed up first (the first call with log-probs compiles), and the contestants take turns over ``--repeats`` rounds
in a rotating order; the table shows medians. Greedy decoding: every contestant generates the same tokens.

An episode's turns are sequential: with one episode per env in flight and few episodes per env (the default 16
over 8 envs) the wall time is bounded by the env that drew the longest replies; with episodes in flight beyond the
envs, the engine's batch is refilled from the queue as replies end. ``--episodes 48`` shows the steady state.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _device import add_device_argument, device_label, setup_device

from chatenv import ChatEnv, Task, TaskResponse, TaskStart, rollout
from chatenv.models import default_model_path

SHORT = [
    "Answer with one word: what colour is the sky?",
    "Answer with one word: what is 2 + 2?",
    "Reply with yes or no: is water wet?",
    "Name one fruit. One word only.",
]
LONG = [
    "Write a long, detailed story about a dragon who learns to cook.",
    "Explain in detail how a bicycle works, part by part.",
    "Write a long essay about the history of the ocean and the ships on it.",
    "Describe, step by step and at length, how to plant a vegetable garden.",
]


class Mixed(Task):
    """Two user turns, each asking for a one-word answer or a long text (drawn with the env's generator).

    Args:
        delay: Seconds each reply takes to judge (a reward model or an API call: ``--reward-delay``).
    """

    def __init__(self, delay: float = 0.0):
        self.delay = delay

    def _question(self, rng) -> str:
        pool = SHORT if rng.random() < 0.5 else LONG
        return pool[int(rng.integers(len(pool)))]

    def reset(self, rng):
        return TaskStart([{"role": "user", "content": self._question(rng)}], {"turn": 0, "next": self._question(rng)})

    def respond(self, messages, state):
        time.sleep(self.delay)
        state["turn"] += 1
        if state["turn"] >= 2:
            return TaskResponse(0.0, True)
        return TaskResponse(0.0, False, [{"role": "user", "content": state["next"]}])


ENGINE = {
    "enforce_eager": True,
    "max_model_len": 2048,
    "kv_cache_memory_bytes": 512 << 20,
    "seed": 0,
}


def _envs(n: int, tokenizer, delay: float = 0.0) -> list:
    return [ChatEnv(Mixed(delay), input_mode="tokens", tokenizer=tokenizer) for _ in range(n)]


def _timed_rollout(policy, args, mode: str, in_flight="auto"):
    start = time.perf_counter()
    envs = _envs(args.envs, policy.tokenizer, args.reward_delay)
    td = rollout(envs, policy, episodes=args.episodes, seed=0, group_size=1, mode=mode, in_flight=in_flight)
    wall = time.perf_counter() - start
    tokens = sum(len(r) for r in td["tokens"].unpadded("response"))
    return td, tokens, wall


def _warm_up(policy, args) -> None:
    rollout(_envs(2, policy.tokenizer), policy, episodes=2, seed=99, mode="async" if policy.is_async else "sync")


def _ceiling(llm, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int]) -> tuple[int, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0, logprobs=0, stop_token_ids=stop_ids)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each runs the four contestants in turn")
    parser.add_argument("--reward-delay", type=float, default=0.0, help="seconds each env step's reward takes")
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args, vllm=True)  # vLLM runs where its build does: refuse a mismatch first
    from vllm import LLM

    from wrappers.policies import VLLMWrapper

    path = str(default_model_path())
    settings = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    engine = {**ENGINE, "max_num_seqs": args.envs}
    fast = VLLMWrapper(path, async_engine=True, engine_kwargs=engine, input_mode="tokens", generate_kwargs=settings)
    llm = LLM(model=path, dtype="float32", logprobs_mode="processed_logprobs", **engine)
    sync = VLLMWrapper(llm, input_mode="tokens", generate_kwargs=settings)
    for policy in (fast, sync):
        _warm_up(policy, args)
    names = ["sync", "async", "async1", "raw"]
    rates: dict[str, list[float]] = {name: [] for name in names}
    first = None
    for r in range(args.repeats):
        # rotate the order every round: load from other processes hits every contestant alike
        for name in names[r % 4 :] + names[: r % 4]:
            if name == "raw":
                if first is None:
                    first = _timed_rollout(sync, args, "sync")[0]
                prompts = [p.tolist() for p in first["tokens"].unpadded("prompt")]
                tokens, wall = _ceiling(llm, prompts, args.max_new_tokens, list(sync.stop_ids))
            else:
                policy, mode = (sync, "sync") if name == "sync" else (fast, "async")
                td, tokens, wall = _timed_rollout(policy, args, mode, None if name == "async1" else "auto")
                if first is None:
                    first = td
                elif name != "sync" or r == 0:
                    assert [x.tolist() for x in td["tokens"].unpadded("full")] == [
                        x.tolist() for x in first["tokens"].unpadded("full")
                    ], "the rollouts should produce the same (greedy) episodes"
            rates[name].append(tokens / wall)
            print(f"round {r}: {name:6} {tokens} tokens in {wall:.2f} s = {tokens / wall:.1f} tok/s", flush=True)
    scaling = _scaling(llm, args.envs)
    fast.shutdown()
    llm.llm_engine.engine_core.shutdown()
    _report(first, rates, device_label(device, threads=False))
    print(
        f"engine scaling (raw generate, 64 tokens each, EOS ignored): 1 sequence {scaling[0]:.1f} tok/s, "
        f"{args.envs} sequences {scaling[1]:.1f} tok/s ({scaling[1] / scaling[0]:.2f}x): the most that keeping "
        "the batch full can gain"
    )


def _scaling(llm, batch: int) -> tuple[float, float]:
    """Tokens/s of the bare engine decoding one sequence, and ``batch`` sequences at once."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    rates = []
    for n in (1, batch):
        prompts = [TokensPrompt(prompt_token_ids=[1, 4093, 198, 20 + k]) for k in range(n)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(64 * n / (time.perf_counter() - start))
    return rates[0], rates[1]


def _report(td, rates: dict[str, list[float]], where: str) -> None:
    lengths = sorted(len(r) for r in td["tokens"].unpadded("response"))
    print(
        f"\nreply lengths: {len(lengths)} replies, min {lengths[0]}, median {lengths[len(lengths) // 2]}, "
        f"max {lengths[-1]}, mean {statistics.mean(lengths):.1f}; every contestant produced the same tokens"
    )
    names = {
        "sync": "sync rollout (vllm.LLM)",
        "async": "async rollout (AsyncLLM)",
        "async1": "async, one episode per env",
        "raw": "raw vllm.LLM.generate, all prompts",
    }
    print(f"vLLM on {where}")
    print(f"{'':38}{'median tok/s':>14}   runs")
    for key, name in names.items():
        print(f"{name:38}{statistics.median(rates[key]):>14.1f}   {', '.join(f'{x:.1f}' for x in rates[key])}")
    sync, fast, one, raw = (statistics.median(rates[k]) for k in ("sync", "async", "async1", "raw"))
    print(f"async / sync: {fast / sync:.2f}x (target >= 1.0 at 16 episodes, >= 1.3 at 48)")
    print(f"async / raw ceiling: {fast / raw:.2f}x (target >= 0.9)")
    print(f"one episode per env: / sync {one / sync:.2f}x, / raw ceiling {one / raw:.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
