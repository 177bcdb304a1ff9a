"""Token-level env with a KL penalty to a frozen reference and an adaptive KL controller.

Each step is one token; the KV-cached TokenStepPolicy samples it, KLPenalty subtracts coef * KL per token and the
adaptive controller moves the coefficient towards the target KL.

Run: .venv/bin/python examples/token_env_kl.py
"""

from chatenv import ScoredAction, TokenEnv, load_default_model
from wrappers.kl import AdaptiveKLController, KLPenalty, ReferenceModel
from wrappers.token_policy import TokenStepPolicy


def main() -> None:
    model, tokenizer = load_default_model()
    reference, _ = load_default_model()  # a frozen copy (in training, `model` would be updated)
    controller = AdaptiveKLController(init_kl_coef=0.1, target=0.05, horizon=50)
    env = KLPenalty(
        TokenEnv("arithmetic", tokenizer=tokenizer, max_new_tokens=24),
        kl=controller,
        ref_model=ReferenceModel(reference, tokenizer, temperature=0.9),
    )
    policy = TokenStepPolicy(model, tokenizer, temperature=0.9, seed=0)
    obs, _ = env.reset(seed=0)
    total, steps, done = 0.0, 0, False
    while not done:
        action, log_prob = policy.act([obs])
        obs, reward, terminated, truncated, info = env.step(ScoredAction(action, log_prob))
        total, steps, done = total + reward, steps + 1, terminated or truncated
    print(f"{steps} tokens, return {total:.3f}, last KL {float(info['kl'][0]):.4f}, coef now {controller.coef:.4f}")
    print(env.unwrapped.render() or tokenizer.decode(env.unwrapped.token_ids[-steps - 8 :]))


if __name__ == "__main__":
    main()
