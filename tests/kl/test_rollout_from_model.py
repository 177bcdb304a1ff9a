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
        kl=0.1,
        estimator=estimator,
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
        kl=ctl,
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
        RolloutFromModel(tiny_model, ref, tokenizer=tokenizer, reward_fn=len, estimator="k5")
    with pytest.raises(ValueError, match="kl must be a finite number >= 0"):
        RolloutFromModel(tiny_model, ref, tokenizer=tokenizer, reward_fn=len, kl=-0.5)
    with pytest.raises(TypeError, match="RolloutFromModel takes kl=... now, not kl_coef="):
        RolloutFromModel(tiny_model, ref, tokenizer=tokenizer, reward_fn=len, kl_coef=0.5)
    with pytest.raises(TypeError, match="RolloutFromModel takes estimator=... now, not kl_estimator="):
        RolloutFromModel(tiny_model, ref, tokenizer=tokenizer, reward_fn=len, kl_estimator="k3")
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


def _kl_rollout(tiny_model, tokenizer, ref, **kwargs):
    """A rollout with coefficient 1 (``reward_kl`` is ``-kl``): the per-token KL, the valid steps and the TensorDict.

    EOS is ignored: at low temperatures the tiny model ends most replies at once, and the KL needs tokens to measure.
    """
    settings = {**kwargs.pop("generate_kwargs"), "ignore_eos": True, "seed": 1}
    rfm = RolloutFromModel(
        tiny_model,
        ref,
        tokenizer=tokenizer,
        reward_fn=len,
        kl=1.0,
        max_new_tokens=8,
        generate_kwargs=settings,
        **kwargs,
    )
    prompts = [apply_chat_template(tokenizer, c, add_generation_prompt=True)["input_ids"] for c in CHATS]
    td = rfm.rollout(prompts)
    valid = td["valid"]
    assert valid.all()
    return -td["next", "reward_kl"][..., 0], valid, td, prompts


@pytest.mark.parametrize("as_scorer", [False, True])
def test_same_model_as_reference_gives_zero_kl_at_the_policy_temperature(as_scorer, tiny_model, tokenizer):
    ref = ReferenceModel(tiny_model, tokenizer, temperature=0.7) if as_scorer else tiny_model
    kl, valid, td, prompts = _kl_rollout(tiny_model, tokenizer, ref, generate_kwargs={"temperature": 0.7})
    assert kl[valid].abs().max() < 1e-5
    assert (kl.sum(-1)).abs().max() < 1e-5  # per sequence too
    # the policy's log-probs are those of the tempered distribution it sampled from (an independent forward)
    for b, prompt in enumerate(prompts):
        n = int(valid[b].sum())
        seq = prompt.tolist() + td["action"][b, :n].tolist()
        tempered = reference_log_probs(tiny_model, seq, temperature=0.7)[len(prompt) :]
        assert torch.allclose(td["sample_log_prob"][b, :n, 0], tempered, atol=1e-4)


def test_reference_at_another_temperature_or_filtered_sampling_refused(tiny_model, tokenizer):
    untempered = ReferenceModel(tiny_model, tokenizer)
    with pytest.raises(ValueError, match=r"temperature 0.7 but the reference ReferenceModel scores at temperature 1.0"):
        RolloutFromModel(
            tiny_model, untempered, tokenizer=tokenizer, reward_fn=len, generate_kwargs={"temperature": 0.7}
        )
    for setting in ({"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05}, {"repetition_penalty": 1.2}):
        name = next(iter(setting))
        with pytest.raises(ValueError, match=rf"\['{name}'\] reshape the sampling distribution.*raw_log_probs=True"):
            RolloutFromModel(tiny_model, tiny_model, tokenizer=tokenizer, reward_fn=len, generate_kwargs=setting)
    tempered = ReferenceModel(tiny_model, tokenizer, temperature=0.7)
    with pytest.raises(ValueError, match="temperature 1.0 but the reference ReferenceModel scores at temperature 0.7"):
        RolloutFromModel(
            tiny_model,
            tempered,
            tokenizer=tokenizer,
            reward_fn=len,
            raw_log_probs=True,
            generate_kwargs={"temperature": 0.7},
        )


def test_raw_log_probs_allow_filtered_sampling(tiny_model, tokenizer):
    kl, valid, td, prompts = _kl_rollout(
        tiny_model, tokenizer, tiny_model, raw_log_probs=True, generate_kwargs={"temperature": 0.7, "top_k": 20}
    )
    assert kl[valid].abs().max() < 1e-5
    for b, prompt in enumerate(prompts):
        n = int(valid[b].sum())
        seq = prompt.tolist() + td["action"][b, :n].tolist()
        raw = reference_log_probs(tiny_model, seq)[len(prompt) :]  # temperature 1, unfiltered
        assert torch.allclose(td["sample_log_prob"][b, :n, 0], raw, atol=1e-4)
