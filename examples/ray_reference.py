"""A reference model in a Ray actor, shared by a vector of envs; rollout batches its forward once per turn.

Run: .venv/bin/python examples/ray_reference.py
"""

import functools
import os

import gymnasium as gym

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

import chatenv  # noqa: E402
from wrappers.kl import KLPenalty, RayRefModel, RefLogProbs  # noqa: E402
from wrappers.policies import TransformersWrapper  # noqa: E402


def kl_env() -> gym.Env:
    # no model in the env processes: reference log-probs arrive with the actions
    return KLPenalty(RefLogProbs(gym.make("chatenv/Arithmetic-v0", input_mode="tokens", max_turns=2)), 0.05)


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        reference = RayRefModel(functools.partial(_load_reference), num_cpus=1)
        envs = gym.vector.AsyncVectorEnv([kl_env] * 2, context="spawn")  # no fork of a process running Ray
        policy = TransformersWrapper("default", input_mode="tokens", generate_kwargs={"max_new_tokens": 24, "seed": 0})
        batch = chatenv.rollout(envs, policy, episodes=2, seed=0, ref_model=reference)
        envs.close()
        print("task rewards  ", [round(x, 3) for x in batch["next", "task_reward"][:, 0].tolist()])
        print("KL-penalised  ", [round(x, 3) for x in batch["next", "reward"][:, 0].tolist()])
        reference.close()
    finally:
        ray.shutdown()


def _load_reference():
    from wrappers.kl import ReferenceModel

    return ReferenceModel("default")


if __name__ == "__main__":
    main()
