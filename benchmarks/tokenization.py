"""Per-turn tokenization cost: prefix-stable continuation vs re-encoding the whole chat, and a derived renderer.

The second table compares the continuation of the registered ``smollm2`` template (``{% generation %}`` markers)
with the same template derived from SmolLM2's own tokenizer template by probe renders (no markers), side by side
on the same chats, and reports the one-time derivation cost.

Run: .venv/bin/python benchmarks/tokenization.py [--turns 16] [--repeats 50] [--device cpu]
(prints medians over repeated, interleaved runs; no model runs: ``--device`` only labels the tables)
"""

from __future__ import annotations

import argparse
import statistics
import time

from _device import add_device_argument, device_label, setup_device

from chatenv import chat_tokenizer, load_default_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    add_device_argument(parser)
    args = parser.parse_args()
    device = setup_device(parser, args, threads=1)
    turns, repeats = args.turns, args.repeats
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
    print(f"tokenizer only, medians of {repeats}, {device_label(device)}")
    print(f"{'turn':>4} {'continuation ms':>16} {'full encode ms':>15} {'full/cont':>10}")
    for turn, c, f in rows:
        if turn in (1, 2, 4, 8, 16) or turn == turns:
            print(f"{turn:>4} {c * 1e3:>16.3f} {f * 1e3:>15.3f} {f / c:>10.2f}")
    print(f"continuation cost, turn {turns} / turn 1: {rows[-1][1] / rows[0][1]:.2f}")
    derived_vs_registered(turns, repeats)


def derived_vs_registered(turns: int, repeats: int) -> None:
    """Per-turn continuation (with the reply's ids, as envs call it) on a derived vs the registered renderer."""
    from chatenv.templates.derive import derive_template
    from chatenv.tokenization import ChatTokenizer

    tok = load_default_tokenizer()
    t = time.perf_counter()
    derived = derive_template(tok)
    derive_s = time.perf_counter() - t
    t = time.perf_counter()
    derived_ct = ChatTokenizer(tok, derived)
    verify_s = time.perf_counter() - t
    registered_ct = chat_tokenizer(tok, "smollm2")
    chat = [{"role": "system", "content": "You are a tutor."}]
    new = [{"role": "user", "content": "Next question, please."}]
    rows = []
    for turn in range(1, turns + 1):
        chat.append({"role": "user", "content": f"Question {turn}: what is {turn} * 7? Explain."})
        reply = {"role": "assistant", "content": "Seven times that number is the answer. " * 4}
        reply_ids = registered_ct.reply(chat, reply).ids.tolist()
        chat.append(reply)
        reg, der = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            a = registered_ct.continuation(chat, new, reply_ids=reply_ids)
            reg.append(time.perf_counter() - t)
            t = time.perf_counter()
            b = derived_ct.continuation(chat, new, reply_ids=reply_ids)
            der.append(time.perf_counter() - t)
        assert a.ids.tolist() == b.ids.tolist() and b.drift == 0
        rows.append((turn, statistics.median(reg), statistics.median(der)))
    print()
    print(f"one-time: derive the profile {derive_s * 1e3:.1f} ms, verify {verify_s * 1e3:.1f} ms")
    print(f"{'turn':>4} {'registered ms':>14} {'derived ms':>11} {'derived/registered':>19}")
    for turn, r, d in rows:
        if turn in (1, 2, 4, 8, 16) or turn == turns:
            print(f"{turn:>4} {r * 1e3:>14.3f} {d * 1e3:>11.3f} {d / r:>19.2f}")
    ratios = sorted(d / r for _, r, d in rows)
    print(f"median derived/registered over {turns} turns: {ratios[len(ratios) // 2]:.2f}")


if __name__ == "__main__":
    main()
