"""Per-turn tokenization cost: prefix-stable continuation vs re-encoding the whole chat.

Run: .venv/bin/python benchmarks/tokenization.py   (prints medians over repeated, interleaved runs)
"""

from __future__ import annotations

import statistics
import time

import torch

from chatenv import chat_tokenizer, load_default_tokenizer


def main(turns: int = 16, repeats: int = 50) -> None:
    torch.set_num_threads(1)
    ct = chat_tokenizer(load_default_tokenizer(), "smollm2")
    chat = [{"role": "system", "content": "You are a tutor."}]
    new = [{"role": "user", "content": "Next question, please."}]
    rows = []
    for turn in range(1, turns + 1):
        chat.append({"role": "user", "content": f"Question {turn}: what is {turn} * 7? Explain."})
        chat.append({"role": "assistant", "content": "Seven times that number is the answer. " * 4})
        cont, full = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            ct.continuation(chat, new)
            cont.append(time.perf_counter() - t)
            t = time.perf_counter()
            ct.encode(chat + new, add_generation_prompt=True)
            full.append(time.perf_counter() - t)
        rows.append((turn, statistics.median(cont), statistics.median(full)))
    print(f"{'turn':>4} {'continuation ms':>16} {'full encode ms':>15} {'full/cont':>10}")
    for turn, c, f in rows:
        if turn in (1, 2, 4, 8, 16) or turn == turns:
            print(f"{turn:>4} {c * 1e3:>16.3f} {f * 1e3:>15.3f} {f / c:>10.2f}")
    print(f"continuation cost, turn {turns} / turn 1: {rows[-1][1] / rows[0][1]:.2f}")


if __name__ == "__main__":
    main()
