"""RolloutFromModel: one generate call laid out per token, equal to stepping TokenEnv + KLPenalty."""

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from helpers import reference_log_probs

from chatenv import DatasetTask, ScoredAction, TokenEnv, apply_chat_template
from chatenv.rewards import numeric_match
from wrappers.kl import AdaptiveKLController, KLPenalty, ReferenceModel
from wrappers.rollout_from_model import RolloutFromModel

CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a number above 10."}],
    [{"role": "user", "content": "Say five."}],
]


@pytest.fixture(scope="module")
def ref(tokenizer):
    return ReferenceModel(make_tiny_llama(seed=1), tokenizer)


ESTIMATORS = {
    "k1": lambda p, q: p - q,
    "k2": lambda p, q: 0.5 * (p - q) ** 2,
    "k3": lambda p, q: torch.exp(q - p) - 1 - (q - p),
}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_equals_stepping_token_env_with_kl(estimator, tiny_model, tokenizer, ref):
    reward_fn = lambda text: numeric_match(text, 5)  # noqa: E731
    rfm = RolloutFromModel(
        tiny_model,
        ref,
        tokenizer=tokenizer,
        reward_fn=reward_fn,
        kl_coef=0.1,
        kl_estimator=estimator,
        max_new_tokens=8,
        generate_kwargs={"seed": 3},
    )
    prompts = [apply_chat_template(tokenizer, c, add_generation_prompt=True)["input_ids"] for c in CHATS]
    td = rfm.rollout(prompts)
    assert td.batch_size == (3, 8)
    ends = {"terminated": 0, "truncated": 0}
    for b, chat in enumerate(CHATS):
        task = DatasetTask([{"messages": chat, "answer": 5}])
        env = KLPenalty(TokenEnv(task, max_new_tokens=8), 0.1, estimator=estimator, ref_model=ref)
        obs, _ = env.reset(options={"messages": chat, "answer": 5})
        assert np.array_equal(obs, prompts[b].numpy())
        n = int(td["valid"][b].sum())
        # the KL term against an independent forward of both models
        seq = prompts[b].tolist() + td["action"][b, :n].tolist()
        p = reference_log_probs(tiny_model, seq)[len(prompts[b]) :]
        q = reference_log_probs(ref.model, seq)[len(prompts[b]) :]
        expected_kl = ESTIMATORS[estimator](p, q)
        assert torch.allclose(td["next", "reward_kl"][b, :n, 0], -0.1 * expected_kl, atol=1e-4)
        assert torch.allclose(td["sample_log_prob"][b, :n, 0], p, atol=1e-4)
        for t in range(n):
            action = td["action"][b, t].item()
            lp = td["sample_log_prob"][b, t].numpy()
            obs, reward, terminated, truncated, info = env.step(ScoredAction(np.array([action]), lp))
            assert reward == pytest.approx(td["next", "reward"][b, t, 0].item(), abs=1e-4)
            assert terminated == td["next", "terminated"][b, t, 0].item()
            assert truncated == td["next", "truncated"][b, t, 0].item()
            assert info["kl"][0] * -0.1 == pytest.approx(td["next", "reward_kl"][b, t, 0].item(), abs=1e-4)
        assert terminated or truncated
        ends["terminated" if terminated else "truncated"] += 1
        # steps after the reply are padding: not valid, no reward, not done
        assert not td["next", "done"][b, n:].any() and (td["next", "reward"][b, n:] == 0).all()
        # what step t saw: the prompt and the t tokens before it
        visible = td["attention_mask"][b, n - 1].sum().item()
        assert visible == len(prompts[b]) + n - 1 and td["next", "attention_mask"][b, n - 1].sum().item() == visible + 1
    assert td["input_ids"].stride(1) == 0  # one copy of the ids per row, viewed per step
    assert ends["terminated"] >= 1


def test_reward_model_clip_and_scheduler(tiny_model, tokenizer, ref):
    def reward_model(ids, mask):
        return torch.full((ids.shape[0],), 100.0)

    ctl = AdaptiveKLController(init_kl_coef=0.1, target=0.5, horizon=10)
    rfm = RolloutFromModel(
        tiny_model,
        ref,
        reward_model,
        tokenizer=tokenizer,
        kl_controller=ctl,
        max_new_tokens=6,
        score_clip=2.0,
        generate_kwargs={"seed": 0},
    )
    td = rfm.rollout([[1, 4093, 198, 22, 2, 198, 1, 520, 9531, 198]] * 2)
    done = td["next", "done"][..., 0]
    assert (td["next", "reward_raw"][..., 0][done] == 2.0).all() and done.sum() == 2
    kls = [float(-td["next", "reward_kl"][b, :, 0].sum() / 0.1) for b in range(2)]
    mean = sum(kls) / 2
    expected = 0.1 * (1 + max(-0.2, min(0.2, mean / 0.5 - 1)) * 2 / 10)
    assert rfm.step_scheduler() == pytest.approx(expected, rel=1e-4)
    with pytest.raises(ValueError, match="exactly one"):
        RolloutFromModel(tiny_model, ref, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="estimator must be one of"):
        RolloutFromModel(tiny_model, ref, tokenizer=tokenizer, reward_fn=len, kl_estimator="k5")
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
        RolloutFromModel(tiny_model, ref, tokenizer=tokenizer, reward_fn=len, kl_coef=-0.5)
    nan_score = RolloutFromModel(
        tiny_model, ref, tokenizer=tokenizer, reward_fn=lambda text: float("nan"), max_new_tokens=3
    )
    with pytest.raises(ValueError, match=r"reward_fn \(.*<lambda>\) returned a non-finite score nan for row 0"):
        nan_score.rollout([[1, 4093, 198, 22, 2, 198, 1, 520, 9531, 198]])
    assert nan_score.step_scheduler() == 0.1  # the failed rollout fed nothing to the controller
    with pytest.raises(ValueError, match="not comparable"):
        from transformers import LlamaConfig, LlamaForCausalLM

        small = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=100,
                hidden_size=64,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=32,
            )
        )
        RolloutFromModel(tiny_model, small, tokenizer=tokenizer, reward_fn=len)
