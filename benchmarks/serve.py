"""Capture endpoint overhead: a chat-completions request through the endpoint vs calling the policy directly.

Run: .venv/bin/python benchmarks/serve.py [--tokens 32] [--repeats 15] [--concurrent 8] [--stream-tokens 64]
[--device cpu]

Both sides generate exactly the same tokens (greedy, ``min_tokens == max_tokens``) after the same prompt ids:

- direct: ``policy(td)`` on the token view of the rendered prompt (tokens mode, what ``chatenv.rollout`` does);
- endpoint: the real ``openai`` client against :class:`chatenv.serve.CaptureServer` on loopback (HTTP, JSON,
  session bookkeeping, TITO render, reply parsing, batching worker), each request in a fresh session.

With ``--concurrent N``: N clients at once through the endpoint (their requests batch into shared policy calls) vs
one direct call on the batch of N; once with a fresh session per request, once with all N through ONE session URL
(concurrent episodes of one session, as harnesses that cannot set a header per sample send them). Runs are
interleaved; the table shows medians and the median of per-round ratios.

Forced tool calls: a ``tool_choice="required"`` request (constrained decoding in the template's own call format)
against an unforced reply of the same number of tokens, both through the endpoint (``--no-forced`` skips it).

Streaming (``--stream-tokens 64``): time to the first streamed token (first content delta the client reads) against
the time of the whole streamed reply, for each API dialect through its official client (chat completions and the
Responses API with ``openai``, the Messages API with ``anthropic``), each request in a fresh session; the
non-streaming request of the same reply is measured alongside. The first token must arrive before 25 % of the
full-reply time.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import anthropic
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


def streamed(first_piece, tokens_of) -> tuple[float, float, int]:
    """``(seconds to the first content piece, seconds to the end, generated tokens)`` of one streaming request."""
    t = time.perf_counter()
    first = None
    stream = first_piece()
    for piece in stream:
        if first is None and piece:
            first = time.perf_counter() - t
    return first if first is not None else float("nan"), time.perf_counter() - t, tokens_of(stream)


def stream_rounds(client, claude, tokens: int, repeats: int) -> None:
    """Time to first token vs full-reply time, per dialect, interleaved; prints the table."""
    messages = [{"role": "user", "content": QUESTION}]

    def chat():
        usage = {}

        def pieces():
            for chunk in client.chat.completions.create(
                model="chatenv-policy",
                messages=messages,
                max_tokens=tokens,
                stream=True,
                stream_options={"include_usage": True},
            ):
                if chunk.usage is not None:
                    usage["n"] = chunk.usage.completion_tokens
                yield chunk.choices[0].delta.content if chunk.choices else None

        return streamed(pieces, lambda _: usage.get("n", 0))

    def responses():
        usage = {}

        def pieces():
            for event in client.responses.create(
                model="chatenv-policy", input=QUESTION, max_output_tokens=tokens, stream=True
            ):
                if event.type == "response.completed" or event.type == "response.incomplete":
                    usage["n"] = event.response.usage.output_tokens
                yield event.delta if event.type == "response.output_text.delta" else None

        return streamed(pieces, lambda _: usage.get("n", 0))

    def messages_api():
        usage = {}

        def pieces():
            with claude.messages.stream(model="chatenv-policy", max_tokens=tokens, messages=messages) as stream:
                yield from stream.text_stream
                usage["n"] = stream.get_final_message().usage.output_tokens

        return streamed(pieces, lambda _: usage.get("n", 0))

    def whole():
        t = time.perf_counter()
        n = endpoint_call(client, 1, tokens)
        return float("nan"), time.perf_counter() - t, n

    contestants = {
        "chat completions": chat,
        "Responses API": responses,
        "Messages API (anthropic)": messages_api,
        "not streamed (chat)": whole,
    }
    for fn in contestants.values():
        fn()
    stats = {name: [] for name in contestants}
    names = list(contestants)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            stats[name].append(contestants[name]())
    print(f"\nstreaming: time to first token vs full reply ({tokens}-token replies)")
    print(f"{'dialect':<28} {'first ms':>9} {'full ms':>9} {'tokens':>7} {'first/full':>11} {'< 25%':>6}")
    for name, rows in stats.items():
        first = statistics.median(r[0] for r in rows)
        full = statistics.median(r[1] for r in rows)
        ratio = statistics.median(r[0] / r[1] for r in rows)
        ok = "" if ratio != ratio else ("yes" if ratio < 0.25 else "NO")
        print(f"{name:<28} {1000 * first:>9.1f} {1000 * full:>9.1f} {rows[0][2]:>7} {ratio:>11.3f} {ok:>6}")


WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"],
            },
        },
    }
]


def forced_rounds(client, repeats: int) -> dict[str, dict]:
    """A forced tool call (``tool_choice="required"``, one call: constrained decoding) vs an unforced reply of its
    length."""
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]

    def forced() -> int:
        r = client.chat.completions.create(
            model="chatenv-policy",
            messages=ask,
            tools=WEATHER,
            tool_choice="required",
            parallel_tool_calls=False,  # one call, then the reply ends (as openai-agents asks)
            temperature=0,
            max_tokens=96,
        )
        assert r.choices[0].message.tool_calls, "a forced reply is a call"
        return r.usage.completion_tokens

    n = forced()

    def free() -> int:
        r = client.chat.completions.create(
            model="chatenv-policy",
            messages=ask,
            tools=WEATHER,
            tool_choice="none",
            temperature=0,
            max_tokens=n,
            extra_body={"min_tokens": n},
        )
        return r.usage.completion_tokens

    return rounds({"unforced reply (same length)": free, "forced tool call": forced}, repeats)


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
    parser.add_argument("--stream-tokens", type=int, default=64, help="reply length of the streaming rows (0: skip)")
    parser.add_argument("--no-forced", dest="forced", action="store_false", help="skip the forced tool call rows")
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args, threads=1)
    settings = {"max_new_tokens": args.tokens, "min_new_tokens": args.tokens, "temperature": 0}
    model, tokenizer = load_default_model(device=device)
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=settings)
    prompt = policy.chat_tokenizer.encode([{"role": "user", "content": QUESTION}], add_generation_prompt=True).ids
    prompt = prompt.numpy()
    with (
        CaptureServer(policy) as server,
        openai.OpenAI(base_url=server.base_url(), api_key="x") as client,
        openai.OpenAI(base_url=server.base_url("one-session"), api_key="x") as one_session,
    ):
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
                    f"endpoint, {n} in one session": lambda: endpoint_call(one_session, n, args.tokens),
                },
                max(3, args.repeats // 3),
            )
            table(f"{n} concurrent requests, {args.tokens} tokens each ({device_label(device)})", many)
    if args.forced:
        free_policy = policy.get_new_version(generate_kwargs={"max_new_tokens": 96, "min_new_tokens": 0})
        with CaptureServer(free_policy) as server, openai.OpenAI(base_url=server.base_url(), api_key="x") as client:
            table(
                f"forced tool call vs an unforced reply of its length ({device_label(device)})",
                forced_rounds(client, max(3, args.repeats // 2)),
            )
    if args.stream_tokens > 0:  # replies of exactly this length (greedy) whatever the dialect can ask for
        n = args.stream_tokens
        fixed = policy.get_new_version(generate_kwargs={"max_new_tokens": n, "min_new_tokens": n})
        with (
            CaptureServer(fixed) as server,
            openai.OpenAI(base_url=server.base_url(), api_key="x") as client,
            anthropic.Anthropic(base_url=server.url, api_key="x") as claude,
        ):
            stream_rounds(client, claude, n, max(3, args.repeats // 2))


if __name__ == "__main__":
    main()
