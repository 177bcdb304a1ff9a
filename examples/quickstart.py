"""Quickstart: one multi-turn episode of Arithmetic-v0 with the embedded SmolLM2, printed turn by turn.

Run: .venv/bin/python examples/quickstart.py
"""

import gymnasium as gym

import chatenv  # noqa: F401  (registers the chatenv/ envs)
from wrappers.policies import TransformersWrapper


def main() -> None:
    env = gym.make("chatenv/Arithmetic-v0", input_mode="history", render_mode="ansi")
    policy = TransformersWrapper("default", generate_kwargs={"max_new_tokens": 48, "temperature": 0.7, "seed": 0})
    obs, info = env.reset(seed=1)
    done = False
    while not done:
        # generate after exactly the env's ids (its own, injection-safe tokenization), not a re-tokenization
        reply, _ = policy.act(obs, token_views=[env.unwrapped.token_view()])  # a message dict parsed from the ids
        obs, reward, terminated, truncated, info = env.step(reply)
        print(f"turn {info['turn']}: reward {reward:.2f} {info['reward_components']}")
        done = terminated or truncated
    print(env.render())
    env.close()


if __name__ == "__main__":
    main()
