"""Token-level stepping on SmolLM2: TokenEnv + KV-cached TokenStepPolicy vs ``model.generate``.

Run: .venv/bin/python benchmarks/token_env.py [--envs 4] [--tokens 64] [--repeats 3] [--device cpu]

1. Stepping ``--envs`` TokenEnvs for ``--tokens`` tokens each (``min_new_tokens`` keeps end-of-turn tokens out
   of sampling, so every run makes exactly that many steps) vs one ``model.generate`` call producing the same
   number of tokens for the same prompts. Medians of interleaved runs.
2. Time of one step (policy + env) at step 8 and at step 128 of a long reply: the cache keeps it flat.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _device import add_device_argument, device_label, setup_device

from chatenv import TokenEnv, load_default_model
from chatenv.padding import pad_sequences
from wrappers.token_policy import TokenStepPolicy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (with --device cpu)")
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args, threads=args.threads)
    model, tok = load_default_model(device=device)
    envs = [TokenEnv("arithmetic", tokenizer=tok, max_new_tokens=10_000) for _ in range(args.envs)]
    ends = envs[0].chat_tokenizer.stop_ids  # what ends a TokenEnv reply
    policy = TokenStepPolicy(model, tok, seed=0, min_new_tokens=10_000, end_ids=ends)

    def stepping(n: int, per_step: list | None = None) -> float:
        policy.reset()
        obs = [env.reset(seed=i)[0] for i, env in enumerate(envs)]
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            actions, _ = policy.act(obs)
            obs = [env.step(int(a))[0] for env, a in zip(envs, actions)]
            if per_step is not None:
                per_step.append(time.perf_counter() - t)
        return time.perf_counter() - t0

    prompts = [torch.as_tensor(env.reset(seed=i)[0]) for i, env in enumerate(envs)]
    ids, mask = pad_sequences(prompts, "left", tok.pad_token_id)
    ids, mask = ids.to(device), mask.long().to(device)

    def generate() -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                pad_token_id=tok.pad_token_id,
            )
        return time.perf_counter() - t

    stepping(4)
    generate()
    ours, bare = [], []
    for r in range(args.repeats):
        if r % 2:
            bare.append(generate())
            ours.append(stepping(args.tokens))
        else:
            ours.append(stepping(args.tokens))
            bare.append(generate())
    print(f"\n{args.envs} envs x {args.tokens} tokens, medians of {args.repeats}, {device_label(device)}")
    print(f"{'contestant':<36} {'median s':>9} {'ratio':>7}")
    print(f"{'model.generate':<36} {statistics.median(bare):>9.3f} {1.0:>7.3f}")
    ratios = [a / b for a, b in zip(ours, bare)]
    print(f"{'TokenEnv + TokenStepPolicy':<36} {statistics.median(ours):>9.3f} {statistics.median(ratios):>7.3f}")
    early, late = [], []
    for _ in range(args.repeats):
        per_step: list[float] = []
        stepping(128, per_step)
        early.append(statistics.median(per_step[6:10]))
        late.append(statistics.median(per_step[126:128]))
    e, lt = statistics.median(early), statistics.median(late)
    print(
        f"\nstep time (policy + env, {args.envs} envs): step 8 {e * 1e3:.1f} ms, step 128 {lt * 1e3:.1f} ms, "
        f"ratio {lt / e:.2f}"
    )


if __name__ == "__main__":
    main()
