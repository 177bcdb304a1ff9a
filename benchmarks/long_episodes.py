"""Cost of a step in very long episodes: it must not grow with the length of the chat.

Run: .venv/bin/python benchmarks/long_episodes.py [--turns 1000] [--tokens 512] [--repeats 15] [--device cpu]

1. Turn-level env (tokens mode, a task that always answers "Go on."): time of ``env.step`` with a fixed
   scripted reply at the first turns and at turn ``--turns`` of one chat (~30 tokens per turn: ~30k tokens at the end).
2. Token-level env with a KL penalty to a reference model (a 2-layer random model over SmolLM2's vocabulary, so
   the model's share stays small and the env's and the reference's own work show): time of one ``env.step`` at
   token 8 and at token ``--tokens`` of one long reply. The reference scores incrementally with its KV cache, so
   a token costs one token of reference forward, not the whole context.

Medians of ``--repeats`` steps around each point; the ratio late/early should be close to 1.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from _device import add_device_argument, device_label, setup_device

from chatenv import ChatEnv, ScoredAction, TokenEnv, load_default_tokenizer
from chatenv.tasks import Task, TaskResponse, TaskStart
from wrappers.kl import KLPenalty, ReferenceModel, RefLogProbs


class Endless(Task):
    """Answers every reply with "Go on." and never ends."""

    description = "never ends"

    def reset(self, rng):  # noqa: D102
        return TaskStart([{"role": "user", "content": "Count with me."}])

    def respond(self, messages, state):  # noqa: D102
        return TaskResponse(0.0, False, [{"role": "user", "content": "Go on."}])


def tiny_model(vocab: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(config).to(device).eval()


def timed_steps(step, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


def turn_level(turns: int, repeats: int) -> tuple[float, float, int]:
    env = ChatEnv(Endless(), input_mode="tokens")
    env.reset(seed=0)
    ids = env.chat_tokenizer.reply(env.messages, {"role": "assistant", "content": "One more number: 42."}).ids.numpy()
    env.step(ids)  # warm-up (first-call caches), then turns 2..repeats + 1
    early = timed_steps(lambda: env.step(ids), repeats)
    while env.turn < turns:
        env.step(ids)
    late = timed_steps(lambda: env.step(ids), repeats)
    return statistics.median(early), statistics.median(late), env.episode.num_tokens


def token_level(tokens: int, repeats: int, device: str) -> tuple[float, float]:
    tok = load_default_tokenizer()
    ref = ReferenceModel(tiny_model(len(tok), device), tok)
    env = KLPenalty(RefLogProbs(TokenEnv(Endless(), max_new_tokens=tokens + 4 * repeats), ref), kl=0.1)
    env.reset(seed=0)
    ids = tok.encode("7", add_special_tokens=False)[:1]
    token = ScoredAction(np.asarray(ids), np.asarray([-1.0], dtype=np.float32))
    for _ in range(8 - repeats // 2):
        env.step(token)
    early = timed_steps(lambda: env.step(token), repeats)
    while env.unwrapped.token_view()[0].shape[0] - env.unwrapped.episode.num_tokens < tokens - repeats // 2:
        env.step(token)
    late = timed_steps(lambda: env.step(token), repeats)
    return statistics.median(early), statistics.median(late)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args, threads=1)
    e, late, n = turn_level(args.turns, args.repeats)
    row = "{:<50} {:>11.3f} {:>10.3f} {:>11.2f}"
    print(f"medians of {args.repeats} steps, reference model on {device_label(device)}")
    print(f"{'measure':<50} {'early (ms)':>11} {'late (ms)':>10} {'late/early':>11}")
    print(row.format(f"turn-level env.step: turn 2 vs {args.turns} ({n} tokens)", e * 1e3, late * 1e3, late / e))
    e, late = token_level(args.tokens, args.repeats, device)
    print(row.format(f"token-level KL step: token 8 vs token {args.tokens}", e * 1e3, late * 1e3, late / e))


if __name__ == "__main__":
    main()
