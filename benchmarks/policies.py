"""Policy wrapper overhead: our wrappers vs the bare engines (and TorchRL's wrapper when installed).

Run: .venv/bin/python benchmarks/policies.py [--tokens 32] [--batch 4] [--repeats 7] [--no-vllm] [--device cpu]

Every contestant generates the same number of tokens for the same prompts (EOS ignored), runs are interleaved
round by round, and the table shows medians and the median of per-round ratios against the bare call:

- bare ``model.generate`` (no scores) vs :class:`TransformersWrapper` (history mode: template, tokenization,
  generation with log-probs, response parsing, containers);
- raw ``vllm.LLM.generate`` (token prompts, sampled-token log-probs) vs :class:`VLLMWrapper`;
- TorchRL's ``TransformersWrapper`` (history mode). TorchRL cannot be told to ignore EOS, so its row is also
  normalised per generated token.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _device import add_device_argument, device_label, setup_device
from tensordict import TensorDict

from chatenv import ChatHistory, History, apply_chat_template, load_default_model
from chatenv.models import default_model_path
from wrappers.policies import TransformersWrapper

QUESTIONS = [
    "What is 17 + 25? Explain step by step.",
    "Name three colours of the rainbow and say why the sky is blue.",
    "Write a short poem about the sea.",
    "How many legs does a spider have, and why?",
    "What is the capital of France? Tell me about it.",
    "Give me a tip for learning to cook.",
    "Why do cats purr?",
    "Explain what a prime number is.",
]


def chats(batch: int) -> list[list[dict]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(batch)]


def timed(fn) -> tuple[float, int]:
    t = time.perf_counter()
    n = fn()
    return time.perf_counter() - t, n


def run_rounds(contestants: dict, repeats: int) -> dict[str, dict]:
    for fn in contestants.values():  # warm-up
        fn()
    stats = {name: {"t": [], "n": []} for name in contestants}
    names = list(contestants)
    for r in range(repeats):
        # rotate the order each round so no contestant always runs first (or last)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dt, n = timed(contestants[name])
            stats[name]["t"].append(dt)
            stats[name]["n"].append(n)
    return stats


def report(title: str, stats: dict[str, dict], base: str) -> None:
    print(f"\n{title}")
    print(f"{'contestant':<34} {'median s':>9} {'tokens':>7} {'ratio':>7} {'ratio/token':>12}")
    bt = stats[base]["t"]
    bn = stats[base]["n"]
    for name, s in stats.items():
        ratios = [t / b for t, b in zip(s["t"], bt)]
        per_tok = [(t / max(n, 1)) / (b / max(m, 1)) for t, n, b, m in zip(s["t"], s["n"], bt, bn)]
        print(
            f"{name:<34} {statistics.median(s['t']):>9.3f} {statistics.median(s['n']):>7.0f} "
            f"{statistics.median(ratios):>7.3f} {statistics.median(per_tok):>12.3f}"
        )


def bench_transformers(batch: int, tokens: int, repeats: int, device: str) -> None:
    model, tok = load_default_model(device=device)
    data = chats(batch)
    enc = apply_chat_template(tok, data, add_generation_prompt=True)
    ids, mask = enc["input_ids"].to(device), enc["attention_mask"].long().to(device)
    kwargs = {"max_new_tokens": tokens, "ignore_eos": True, "seed": 0}
    ours = TransformersWrapper(model, tokenizer=tok, generate_kwargs=kwargs)
    td = TensorDict(history=ChatHistory(prompt=History.from_chats(data), batch_size=[batch]), batch_size=[batch])

    def bare():
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=True,
                top_k=0,
                top_p=1.0,
                temperature=1.0,
                pad_token_id=tok.pad_token_id,
            )
        return (out.shape[1] - ids.shape[1]) * batch

    def wrapper():
        out = ours(td.copy())
        return int(out["tokens"].response_length.sum())

    contestants = {"bare model.generate": bare, "chatenv TransformersWrapper": wrapper}
    try:
        from torchrl.data.llm import History as TRLHistory
        from torchrl.modules.llm import TransformersWrapper as TorchRLWrapper

        theirs = TorchRLWrapper(
            model,
            tokenizer=tok,
            input_mode="history",
            generate=True,
            pad_output=True,
            generate_kwargs={"max_new_tokens": tokens, "do_sample": True},
        )
        trl_td = TensorDict(batch_size=[batch])
        trl_td.set(("history", "prompt"), TRLHistory.from_chats(data))

        def torchrl():
            out = theirs(trl_td.copy())
            return int(out["tokens", "response"].ne(tok.pad_token_id).sum())

        contestants["torchrl TransformersWrapper"] = torchrl
    except Exception as e:  # torchrl missing or incompatible: report and go on
        print(f"(TorchRL not compared: {type(e).__name__}: {e})")
    report(
        f"transformers, SmolLM2-135M, batch {batch}, {tokens} new tokens, {repeats} rounds, {device_label(device)}",
        run_rounds(contestants, repeats),
        "bare model.generate",
    )


def bench_vllm(batch: int, tokens: int, repeats: int, device: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from wrappers.policies import VLLMWrapper

    llm = LLM(
        model=str(default_model_path()),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=max(batch, 8),
        kv_cache_memory_bytes=512 << 20,
        logprobs_mode="processed_logprobs",
        seed=0,
    )
    ours = VLLMWrapper(llm, generate_kwargs={"max_new_tokens": tokens, "ignore_eos": True, "seed": 0})
    data = chats(batch)
    prompts = [
        TokensPrompt(
            prompt_token_ids=apply_chat_template(ours.tokenizer, c, add_generation_prompt=True)["input_ids"].tolist()
        )
        for c in data
    ]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=0, seed=0, detokenize=False)
    td = TensorDict(history=ChatHistory(prompt=History.from_chats(data), batch_size=[batch]), batch_size=[batch])

    def raw():
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def wrapper():
        out = ours(td.copy())
        return int(out["tokens"].response_length.sum())

    where = device_label(device, threads=False)  # the engine core runs in its own process, with its own threads
    report(
        f"vLLM, SmolLM2-135M, batch {batch}, {tokens} new tokens, {repeats} rounds, {where}",
        run_rounds({"raw vllm.LLM.generate": raw, "chatenv VLLMWrapper": wrapper}, repeats),
        "raw vllm.LLM.generate",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (with --device cpu)")
    parser.add_argument("--no-vllm", action="store_true")
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args, threads=args.threads, vllm=not args.no_vllm)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    bench_transformers(args.batch, args.tokens, args.repeats, device)
    if not args.no_vllm:
        bench_vllm(args.batch, args.tokens, args.repeats, device)


if __name__ == "__main__":
    main()
