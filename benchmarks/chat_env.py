"""Turn-level env cost on SmolLM2: rollout vs a bare generate loop, and per-turn non-model overhead.

Run: .venv/bin/python benchmarks/chat_env.py [--envs 4] [--turns 4] [--tokens 16] [--repeats 5] [--device cpu]

1. ``chatenv.rollout`` (tokens mode, TransformersWrapper, GuessNumber-v0, every reply exactly ``--tokens``
   tokens) vs a bare loop that calls ``model.generate`` on the very prompts the rollout saw, round by round.
   Rounds are interleaved; the table shows medians and the median ratio.
2. Non-model time per turn (env step + policy wrapper work, with the time inside ``model.generate`` taken out)
   at turn 1 and turn 16 of one long chat, for chatenv and, when installed, TorchRL's ``ChatEnv`` driven by its
   ``TransformersWrapper`` (history mode) on the same model. Measured with SmolLM2 and again with a 2-layer
   random model of the same shapes: the non-model work is the same, but a large model's forward passes evict
   the CPU caches and add noise to the milliseconds around them.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _device import add_device_argument, device_label, setup_device

from chatenv import ChatEnv, load_default_model, rollout
from chatenv.padding import pad_sequences
from wrappers.policies import TransformersWrapper


class GenerateTimer:
    """Measures the time spent inside ``model.generate`` (the model's own work) of a shared model."""

    def __init__(self, model):
        self.model = model
        self.inner = model.generate
        self.total = 0.0
        model.generate = self

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.total += time.perf_counter() - t

    def restore(self):
        self.model.generate = self.inner


def bench_rollout(model, tok, envs: int, turns: int, tokens: int, repeats: int) -> None:
    policy = TransformersWrapper(
        model, tokenizer=tok, input_mode="tokens", generate_kwargs={"max_new_tokens": tokens, "ignore_eos": True}
    )
    pool = [ChatEnv("guess_number", input_mode="tokens", tokenizer=tok, max_turns=turns) for _ in range(envs)]

    def run_rollout():
        t = time.perf_counter()
        td = rollout(pool, policy, episodes=envs, seed=0)
        return time.perf_counter() - t, td

    def run_bare(td):
        rounds = {}
        for k, turn in enumerate(td["turn"].tolist()):
            rounds.setdefault(turn, []).append(td["tokens"].unpadded("prompt")[k])
        t = time.perf_counter()
        for prompts in rounds.values():
            ids, mask = pad_sequences(prompts, "left", tok.pad_token_id)
            with torch.inference_mode():
                model.generate(
                    input_ids=ids.to(model.device),
                    attention_mask=mask.long().to(model.device),
                    max_new_tokens=tokens,
                    min_new_tokens=tokens,
                    do_sample=True,
                    top_k=0,
                    top_p=1.0,
                    temperature=1.0,
                    pad_token_id=tok.pad_token_id,
                )
        return time.perf_counter() - t

    _, td = run_rollout()  # warm-up, and the prompts for the bare loop
    ours, bare = [], []
    for r in range(repeats):
        # alternate which contestant goes first in a round
        if r % 2:
            bare.append(run_bare(td))
            dt, td = run_rollout()
        else:
            dt, td = run_rollout()
            bare.append(run_bare(td))
        ours.append(dt)
    ratios = [a / b for a, b in zip(ours, bare)]
    n = td.batch_size[0]
    print(
        f"\nrollout: {envs} envs x {turns} turns, {tokens} tokens per reply ({n} transitions), {repeats} rounds, "
        f"{device_label(model.device.type)}"
    )
    print(f"{'contestant':<28} {'median s':>9} {'ratio':>7}")
    print(f"{'bare model.generate loop':<28} {statistics.median(bare):>9.3f} {1.0:>7.3f}")
    print(f"{'chatenv.rollout':<28} {statistics.median(ours):>9.3f} {statistics.median(ratios):>7.3f}")


def chatenv_overhead(model, tok, turns: int, tokens: int) -> list[float]:
    policy = TransformersWrapper(
        model, tokenizer=tok, input_mode="tokens", generate_kwargs={"max_new_tokens": tokens, "ignore_eos": True}
    )
    env = ChatEnv("guess_number", input_mode="tokens", tokenizer=tok, max_turns=turns + 1)
    timer = GenerateTimer(model)
    try:
        obs, _ = env.reset(seed=0)
        out = []
        for _ in range(turns):
            # the policy's own work is timed over a few calls on the same observation (median), the env step once
            policy_times = []
            for _ in range(5):
                timer.total = 0.0
                t = time.perf_counter()
                ids, _ = policy.act(obs)
                policy_times.append(time.perf_counter() - t - timer.total)
            t = time.perf_counter()
            obs, *_ = env.step(ids)
            out.append(statistics.median(policy_times) + time.perf_counter() - t)
        return out
    finally:
        timer.restore()


def torchrl_overhead(model, tok, turns: int, tokens: int) -> list[float]:
    from tensordict import TensorDict
    from torchrl.envs.llm import ChatEnv as TorchRLChatEnv
    from torchrl.modules.llm import TransformersWrapper as TorchRLWrapper

    env = TorchRLChatEnv(input_mode="history", batch_size=(1,), tokenizer=tok, system_prompt="You are terse.")
    policy = TorchRLWrapper(
        model,
        tokenizer=tok,
        input_mode="history",
        generate=True,
        pad_output=True,
        generate_kwargs={"max_new_tokens": tokens, "do_sample": True},
    )
    timer = GenerateTimer(model)
    try:
        td = env.reset(TensorDict({"query": ["Let's play a guessing game. Guess my number."]}, batch_size=(1,)))
        out = []
        for _ in range(turns):
            policy_times = []
            for _ in range(5):
                timer.total = 0.0
                t = time.perf_counter()
                acted = policy(td.copy())
                policy_times.append(time.perf_counter() - t - timer.total)
            t = time.perf_counter()
            td = env.step(acted).get("next").exclude("reward", "done", "terminated", "truncated")
            out.append(statistics.median(policy_times) + time.perf_counter() - t)
        return out
    finally:
        timer.restore()


def tiny_model(tok, device: str):
    """A 2-layer random model with SmolLM2's shapes: its forward passes barely disturb the timings around them."""
    from transformers import LlamaForCausalLM

    config = load_default_model()[0].config
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device).eval()


def bench_overhead(model, tok, tokens: int, repeats: int, label: str) -> None:
    turns = 16
    rows = {"chatenv (tokens mode)": [chatenv_overhead(model, tok, turns, tokens) for _ in range(repeats)]}
    try:
        rows["torchrl ChatEnv (history)"] = [torchrl_overhead(model, tok, turns, tokens) for _ in range(repeats)]
    except Exception as e:  # torchrl missing or incompatible: say so and go on
        print(f"(TorchRL not compared: {type(e).__name__}: {e})")
    where = device_label(model.device.type)
    print(f"\nnon-model time per turn, {label} (env step + policy, generate excluded), medians of {repeats}, {where}")
    print(f"{'contestant':<28} {'turn 1 ms':>10} {'turn 16 ms':>11} {'16 / 1':>7}")
    for name, runs in rows.items():
        first = statistics.median(r[0] for r in runs)
        last = statistics.median(r[-1] for r in runs)
        print(f"{name:<28} {first * 1e3:>10.2f} {last * 1e3:>11.2f} {last / first:>7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (with --device cpu)")
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args, threads=args.threads)
    model, tok = load_default_model(device=device)
    bench_rollout(model, tok, args.envs, args.turns, args.tokens, args.repeats)
    bench_overhead(model, tok, 4, args.repeats, "SmolLM2-135M")
    bench_overhead(tiny_model(tok, device), tok, 4, args.repeats, "2-layer model")


if __name__ == "__main__":
    main()
