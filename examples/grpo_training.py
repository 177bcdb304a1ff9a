"""A small GRPO-style training loop on the embedded SmolLM2, with a KL penalty to its frozen copy.

Toy objective: answer a question in at most ``LIMIT`` tokens (the reply must end by itself). The base model is
chatty, so few samples succeed at first; group-normalised advantages push up the log-probs of the short replies.
The loop samples a group of replies per step with ``TransformersWrapper`` (tokens, masks and generation log-probs
come from it), scores them, computes the reference log-probs with ``ReferenceModel`` and takes one policy-gradient
step with a k3 KL term. It prints the reward and KL per step and saves ``runs/grpo/curve.png``.

Run: .venv/bin/python examples/grpo_training.py [--steps 8]   (about 2-3 minutes on 2 CPU cores)
"""

import argparse
from pathlib import Path

import torch
from tensordict import TensorDict

from chatenv import ChatHistory, History, load_default_model
from chatenv.cpus import set_torch_threads
from wrappers.kl import ReferenceModel, kl_estimate
from wrappers.policies import TransformersWrapper

LIMIT = 8
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--beta", type=float, default=0.05)
    args = parser.parse_args()
    torch.manual_seed(0)
    set_torch_threads(2)  # two threads, fewer where this process may use fewer cores
    model, tokenizer = load_default_model()
    reference = ReferenceModel(load_default_model()[0], tokenizer)
    sampler = TransformersWrapper(
        model, tokenizer=tokenizer, num_samples=args.group, generate_kwargs={"max_new_tokens": 24, "seed": 0}
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    prompt = TensorDict(history=ChatHistory(prompt=History.from_chats([PROMPT]), batch_size=[1]), batch_size=[1])
    curve = []
    for step in range(args.steps):
        model.eval()
        out = sampler(prompt.copy())[0]  # (group,) samples of the one prompt
        tokens = out["tokens"]
        responses = tokens.unpadded("response")
        reward = torch.tensor([float(len(r) <= LIMIT and r[-1].item() in sampler.stop_ids) for r in responses])
        advantage = (reward - reward.mean()) / (reward.std() + 1e-4)
        seqs = tokens.full_sequences()
        ref = reference.log_probs([s.tolist() for s in seqs])
        model.train()
        loss, kls = 0.0, []
        for seq, n_prompt, adv, ref_lp in zip(seqs, tokens.prompt_length.tolist(), advantage, ref):
            logits = model(seq[None]).logits[0, :-1].float()
            lp = logits.log_softmax(-1).gather(-1, seq[1:, None]).squeeze(-1)[n_prompt - 1 :]  # reply tokens
            kl = kl_estimate(lp, ref_lp[n_prompt:], "k3")
            kls.append(kl.mean().item())
            loss = loss - adv * lp.sum() / len(seqs) + args.beta * kl.mean() / len(seqs)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        curve.append((reward.mean().item(), sum(kls) / len(kls)))
        print(f"step {step + 1:2d}: reward {curve[-1][0]:.2f}  KL {curve[-1][1]:.4f}")
    first, last = curve[0][0], sum(r for r, _ in curve[-3:]) / min(3, len(curve))
    print(f"reward: first step {first:.2f}, last steps {last:.2f}")
    _plot(curve)


def _plot(curve: list) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    out = Path("runs/grpo")
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot([r for r, _ in curve], marker="o", label="reward")
    ax.plot([k for _, k in curve], marker="s", label="KL (k3, per token)")
    ax.set(xlabel="step", title="GRPO on SmolLM2: short answers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curve.png", dpi=100)


if __name__ == "__main__":
    main()
