"""Capture endpoint overhead: a chat-completions request through the endpoint vs calling the policy directly.

Run: .venv/bin/python benchmarks/serve.py [--tokens 32] [--repeats 15] [--concurrent 8] [--device cpu]

Both sides generate exactly the same tokens (greedy, ``min_tokens == max_tokens``) after the same prompt ids:

- direct: ``policy(td)`` on the token view of the rendered prompt (tokens mode, what ``chatenv.rollout`` does);
- endpoint: the real ``openai`` client against :class:`chatenv.serve.CaptureServer` on loopback (HTTP, JSON,
  session bookkeeping, TITO render, reply parsing, batching worker), each request in a fresh session.

With ``--concurrent N``: N clients at once through the endpoint (their requests batch into shared policy calls) vs
one direct call on the batch of N. Runs are interleaved; the table shows medians and the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
import openai
from _device import add_device_argument, device_label, setup_device

from chatenv.models import load_default_model
from chatenv.modes import get_mode
from chatenv.serve import CaptureServer
from wrappers.policies import TransformersWrapper

QUESTION = "What is 17 + 25? Explain step by step."


def direct_call(policy, prompts: list[np.ndarray]) -> int:
    mode = get_mode("tokens")
    views = [(p, np.zeros(len(p), dtype=bool)) for p in prompts]
    td = mode.policy_input(
        prompts, input_key=policy.input_key, pad_token_id=policy.pad_token_id, token_views=views, tokens_key="tokens"
    )
    out = policy(td)
    return sum(len(r) for r in out["tokens"].unpadded("response"))


def endpoint_call(client, n: int, tokens: int) -> int:
    results = [0] * n

    def one(k: int) -> None:
        r = client.chat.completions.create(
            model="chatenv-policy",
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=tokens,
            extra_body={"min_tokens": tokens},
        )
        results[k] = r.usage.completion_tokens

    if n == 1:
        one(0)
    else:
        threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return sum(results)


def rounds(contestants: dict, repeats: int) -> dict[str, dict]:
    for fn in contestants.values():
        fn()
    stats = {name: {"t": [], "n": []} for name in contestants}
    names = list(contestants)
    for r in range(repeats):
        for name in names[r % 2 :] + names[: r % 2]:
            t = time.perf_counter()
            n = contestants[name]()
            stats[name]["t"].append(time.perf_counter() - t)
            stats[name]["n"].append(n)
    return stats


def table(title: str, stats: dict[str, dict]) -> None:
    base = next(iter(stats))
    print(f"\n{title}")
    print(f"{'contestant':<28} {'median ms':>10} {'tokens':>7} {'ratio':>7}")
    for name, s in stats.items():
        ratio = statistics.median(a / b for a, b in zip(s["t"], stats[base]["t"]))
        print(f"{name:<28} {1000 * statistics.median(s['t']):>10.1f} {s['n'][0]:>7} {ratio:>7.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--concurrent", type=int, default=8)
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args, threads=1)
    settings = {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "temperature": 0}
    model, tokenizer = load_default_model(device=device)
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=settings)
    prompt = policy.chat_tokenizer.encode([{"role": "user", "content": QUESTION}], add_generation_prompt=True).ids
    prompt = prompt.numpy()
    with CaptureServer(policy) as server, openai.OpenAI(base_url=server.base_url(), api_key="x") as client:
        single = rounds(
            {
                "direct policy call": lambda: direct_call(policy, [prompt]),
                "endpoint (openai client)": lambda: endpoint_call(client, 1, args.tokens),
            },
            args.repeats,
        )
        table(f"one request, {args.tokens} tokens (SmolLM2-135M, {device_label(device)})", single)
        if args.concurrent > 1:
            n = args.concurrent
            many = rounds(
                {
                    f"direct call, batch of {n}": lambda: direct_call(policy, [prompt] * n),
                    f"endpoint, {n} clients at once": lambda: endpoint_call(client, n, args.tokens),
                },
                max(3, args.repeats // 3),
            )
            table(f"{n} concurrent requests, {args.tokens} tokens each ({device_label(device)})", many)


if __name__ == "__main__":
    main()
