"""The GRPO training step (wrappers.grpo) on multi-turn episodes of a tiny random model."""

import copy
import math
import statistics

import gymnasium as gym
import pytest
import torch

import chatenv
from wrappers.grpo import GRPOConfig, GRPOLearner, group_advantages
from wrappers.kl import ReferenceModel, RefLogProbs
from wrappers.policies import TransformersWrapper

TEMPERATURE = 0.8
DATA = [{"question": "Say something long.", "answer": "x"}, {"question": "Say something else.", "answer": "y"}]


def _length_reward(reply, answer):
    """A reward the tiny model's replies differ in (their length), below 1 so every episode gets a second try."""
    return min(len(reply), 40) / 41


def _envs(tokenizer, ref, n):
    kwargs = {"data": DATA, "reward_fn": _length_reward, "max_attempts": 2}
    return [
        RefLogProbs(gym.make("chatenv/Chat-v0", input_mode="tokens", tokenizer=tokenizer, task_kwargs=kwargs), ref)
        for _ in range(n)
    ]


def _by_hand(rewards, groups):
    """Group-normalised advantages, computed with the statistics module: (r - mean) / (sample std + 1e-4)."""
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        out.append(0.0 if len(members) < 2 else (r - statistics.mean(members)) / (statistics.stdev(members) + 1e-4))
    return out


def test_group_advantages_match_a_computation_by_hand():
    rewards = [0.5, 1.0, 0.0, 0.25, 3.0, 3.0, 7.0]
    groups = [0, 0, 0, 0, 1, 1, 2]
    assert group_advantages(rewards, groups).tolist() == pytest.approx(_by_hand(rewards, groups), abs=1e-5)
    centred = group_advantages(rewards, groups, scale=False).tolist()
    assert centred == pytest.approx([0.0625, 0.5625, -0.4375, -0.1875, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="finite"):
        group_advantages([1.0, math.nan])
    with pytest.raises(ValueError, match="3 rewards but 2 group ids"):
        group_advantages([1.0, 2.0, 3.0], [0, 0])


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("lr", 0.0, "lr"), ("micro_batch", 0, "micro_batch"), ("kl", -1.0, "kl"), ("estimator", "k9", "k9")],
)
def test_bad_settings_are_refused(field, value, match):
    with pytest.raises((ValueError, TypeError), match=match):
        GRPOConfig(**{field: value})


@pytest.mark.slow
def test_two_grpo_steps_train_the_policy_away_from_its_frozen_copy(tiny_model, tokenizer):
    torch.manual_seed(0)
    model = copy.deepcopy(tiny_model)
    settings = {"max_new_tokens": 8, "temperature": TEMPERATURE, "seed": 0}
    policy = TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=settings)
    ref = ReferenceModel(copy.deepcopy(tiny_model), tokenizer, temperature=TEMPERATURE)
    envs = _envs(tokenizer, ref, 4)
    learner = GRPOLearner(policy, GRPOConfig(lr=3e-3, kl=0.1, micro_batch=3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    history = []
    for step in range(2):
        td = chatenv.rollout(envs, policy, episodes=8, group_size=4, seed=10 * step)
        view = chatenv.episodes(td)
        assert (view["num_turns"] == 2).all()  # multi-turn: every episode had a second try after the feedback
        metrics = learner.step(view)
        history.append(metrics)
        assert all(math.isfinite(v) for v in metrics.values()), metrics
        expected = _by_hand(view["reward"].tolist(), view["group"].tolist())
        assert learner.advantages.tolist() == pytest.approx(expected, abs=1e-4)
        assert metrics["tokens"] == sum(int(r.sum()) for r in view["masks"].unpadded())
    # step 0 samples from the start itself: the KL to the frozen copy is 0; after one update it is not
    assert abs(history[0]["kl"]) < 1e-6
    assert history[1]["kl"] > 1e-4
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and all(torch.equal(v, ref.model.state_dict()[k]) for k, v in before.items())
    assert learner.steps == 2


def test_a_kl_term_needs_reference_log_probs(tiny_model, tokenizer):
    policy = TransformersWrapper(
        copy.deepcopy(tiny_model), tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 4}
    )
    envs = [gym.make("chatenv/Arithmetic-v0", input_mode="tokens", tokenizer=tokenizer, max_turns=1) for _ in range(2)]
    view = chatenv.episodes(chatenv.rollout(envs, policy, episodes=2, group_size=2, seed=0))
    with pytest.raises(ValueError, match="needs reference log-probs"):
        GRPOLearner(policy, GRPOConfig(kl=0.1)).step(view)
    metrics = GRPOLearner(policy, GRPOConfig(kl=0.0)).step(view)  # no KL term: no reference needed
    assert math.isnan(metrics["kl"]) and metrics["groups_with_signal"] == 0.0
    with pytest.raises(TypeError, match="policy wrapper"):
        GRPOLearner(object())
