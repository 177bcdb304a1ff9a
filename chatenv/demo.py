"""Placeholder main job: the embedded SmolLM2 model answers a 2-turn chat, token-in/token-out.

Run with ``python -m chatenv.demo`` (``make demo``). Each turn appends only the new messages' tokens to the
ids the model already produced, and prints the assistant mask's decoded tokens as a check.
"""

from __future__ import annotations

import time

import torch

from chatenv.models import load_default_model
from chatenv.tokenization import chat_tokenizer

__all__ = ["main"]


def main(max_new_tokens: int = 48) -> None:
    """Run two user turns through the default model, greedily, and print the chat."""
    torch.manual_seed(0)
    start = time.perf_counter()
    model, tokenizer = load_default_model()
    ct = chat_tokenizer(tokenizer, "chatml")
    chat = [{"role": "system", "content": "You are a concise assistant."}]
    user_turns = ["What is the capital of France?", "And what river runs through it?"]
    ids = None
    done = True
    assistant = []
    for turn, question in enumerate(user_turns):
        new = [{"role": "user", "content": question}]
        if ids is None:
            enc = ct.encode(chat + new, add_generation_prompt=True)
            ids, mask = enc.ids, enc.assistant_mask
        else:
            cont = ct.continuation(chat, new, generation_complete=done)
            ids, mask = torch.cat([ids, cont.ids]), torch.cat([mask, cont.assistant_mask])
        chat += new
        with torch.inference_mode():
            out = model.generate(
                ids[None],
                attention_mask=torch.ones_like(ids)[None],
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )[0]
        generated = out[len(ids) :]
        done = bool((generated == tokenizer.eos_token_id).any())
        if done:
            generated = generated[: int((generated == tokenizer.eos_token_id).nonzero()[0]) + 1]
        ids, mask = torch.cat([ids, generated]), torch.cat([mask, torch.ones_like(generated, dtype=torch.bool)])
        reply = tokenizer.decode(generated, skip_special_tokens=True)
        chat.append({"role": "assistant", "content": reply})
        assistant.append(reply)
        print(f"[turn {turn + 1}] user: {question}\n[turn {turn + 1}] assistant: {reply}\n")
    print(f"{len(ids)} tokens in the episode, {int(mask.sum())} of them assistant tokens")
    print(f"assistant tokens decoded: {tokenizer.decode(ids[mask])!r}")
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
