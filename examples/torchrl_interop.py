"""Feed chatenv.rollout output to a TorchRL replay buffer and a GRPO-style advantage (skips without torchrl).

Run: .venv/bin/python examples/torchrl_interop.py
"""

import gymnasium as gym
import torch

import chatenv
from wrappers.policies import TransformersWrapper


def main() -> None:
    try:
        from torchrl.data import LazyTensorStorage, ReplayBuffer
    except ImportError:
        print("torchrl is not installed (pip install 'chatenv-gym[bench]'): nothing to show")
        return
    policy = TransformersWrapper("default", input_mode="tokens", generate_kwargs={"max_new_tokens": 24, "seed": 0})
    envs = [gym.make("chatenv/Arithmetic-v0", input_mode="tokens", max_turns=1) for _ in range(4)]
    batch = chatenv.rollout(envs, policy, episodes=4, seed=0)
    # GRPO-style: advantages are rewards normalised within the group of replies
    reward = batch["next", "reward"]
    batch["advantage"] = (reward - reward.mean()) / (reward.std() + 1e-6)
    buffer = ReplayBuffer(storage=LazyTensorStorage(64), batch_size=2)
    buffer.extend(batch.exclude("text", "history"))
    sample = buffer.sample()
    mask = sample["masks"].all_assistant_mask
    log_probs = torch.nan_to_num(sample["log_probs"].full, nan=0.0)
    loss = -(sample["advantage"] * (log_probs * mask).sum(-1, keepdim=True)).mean()
    print(f"buffer holds {len(buffer)} transitions; sampled {sample.batch_size[0]}; surrogate loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
