"""chatenv with TorchRL: a TorchRL env over a chat env, and one GRPOLoss step on a chatenv rollout (skips without
torchrl).

One import, one call per need (``chatenv.integrations.torchrl``):

- ``gym_env(...)``: a TorchRL env with compact specs (int64 token ids, not a one-hot per token);
- ``grpo_batch(rollout)``: episodes in the shapes ``GRPOLoss`` / ``MCAdvantage`` read, with group-normalised
  advantages from the rollout's ``group`` column;
- ``grpo_actor(policy)``: the policy as a ``GRPOLoss`` actor whose scoring keeps the autograd graph.

Run: .venv/bin/python examples/torchrl_interop.py
"""

import gymnasium as gym
import torch

import chatenv
from wrappers.policies import TransformersWrapper


def main() -> None:
    try:
        from torchrl.data import LazyTensorStorage, ReplayBuffer
        from torchrl.objectives.llm import GRPOLoss

        from chatenv.integrations.torchrl import grpo_actor, grpo_batch, gym_env
    except ImportError:
        print("torchrl is not installed (pip install 'chatenv-gym[torchrl]'): nothing to show")
        return
    torch.manual_seed(0)
    torch.set_num_threads(1)  # batches of a few short chats: one thread is fastest on a shared CPU
    policy = TransformersWrapper("default", input_mode="tokens", generate_kwargs={"max_new_tokens": 16, "seed": 0})

    # 1. a TorchRL env: reset, then step with the policy's reply ids as the action
    env = gym_env("chatenv/Arithmetic-v0", input_mode="tokens", max_turns=1)
    print("observation spec:", type(env.observation_spec["observation"]).__name__, "of int64 ids")
    td = env.reset()
    actions, _ = policy.act(td["observation"])
    td["action"] = torch.as_tensor(actions)
    step = env.step(td)
    print(f"TorchRL step: {len(actions)} reply ids, reward {step['next', 'reward'].item():.2f}")

    # 2. GRPO: groups of episodes from the same reset -> TorchRL's GRPOLoss, one optimizer step
    envs = [gym.make("chatenv/Arithmetic-v0", input_mode="tokens", max_turns=1) for _ in range(2)]
    batch = grpo_batch(chatenv.rollout(envs, policy, episodes=4, group_size=2, seed=0))
    buffer = ReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
    buffer.extend(batch)
    loss_fn = GRPOLoss(actor_network=grpo_actor(policy), masking_strategy="rlhf", entropy_coeff=0.0)
    optimizer = torch.optim.Adam(policy.model.parameters(), lr=1e-5)
    losses = loss_fn(buffer.sample())
    loss = losses.loss_objective + losses.loss_entropy
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"GRPO step on {batch.batch_size[0]} episodes: loss {loss.item():.4f}, ESS {losses.ESS.item():.2f}")


if __name__ == "__main__":
    main()
