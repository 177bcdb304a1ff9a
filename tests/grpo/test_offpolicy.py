"""Off-policy correction (chatenv.rollout.offpolicy) in the GRPO step, against computations from raw model outputs."""

import copy
import math
import statistics

import gymnasium as gym
import pytest
import torch

import chatenv
from chatenv.rollout.offpolicy import OffPolicyConfig, correct, segments
from wrappers.grpo import GRPOConfig, GRPOLearner
from wrappers.policies import TransformersWrapper

TEMPERATURE = 0.8
LR = 0.5
DATA = [{"question": "Say something long.", "answer": "x"}, {"question": "Say something else.", "answer": "y"}]


def _length_reward(reply, answer):
    """Below 1 for every reply, so each episode runs all its attempts; differs between replies."""
    return min(len(reply), 40) / 41


def _envs(tokenizer, n, attempts, retry="That is not it. Try again."):
    kwargs = {"data": DATA, "reward_fn": _length_reward, "max_attempts": attempts, "retry_message": retry}
    return [gym.make("chatenv/Chat-v0", input_mode="tokens", tokenizer=tokenizer, task_kwargs=kwargs) for _ in range(n)]


def _policy(model, tokenizer, max_new_tokens=8):
    settings = {"max_new_tokens": max_new_tokens, "temperature": TEMPERATURE, "seed": 0}
    return TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=settings)


def _raw_log_probs(model, seq):
    """log p(x_t | x_<t) at the sampling temperature, straight from the model's logits (position 0: NaN)."""
    ids = torch.tensor([seq])
    logits = model(input_ids=ids).logits[0, :-1].float() / TEMPERATURE
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return torch.cat([torch.full((1,), math.nan), lp])


def _advantages(rewards, groups):
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        out.append(0.0 if len(members) < 2 else (r - statistics.mean(members)) / (statistics.stdev(members) + 1e-4))
    return out


def _sampled(view):
    """Per episode: its ids, the sampled positions, the rollout's log-probs and each position's turn."""
    out = []
    seqs = view["tokens"].unpadded("full")
    masks, lps = view["masks"].unpadded(), view["log_probs"].unpadded("full")
    prompts = view["tokens"].unpadded("prompt")
    for e, (seq, m, lp, p) in enumerate(zip(seqs, masks, lps, prompts)):
        keep = m.clone()
        keep[0] = False
        at = keep.nonzero().squeeze(-1)
        turn = torch.full((len(seq),), -1)
        for t in range(int(view["num_turns"][e])):
            start, n = int(view["turn_start"][e, t]), int(view["turn_length"][e, t])
            turn[len(p) + start : len(p) + start + n] = t
        out.append((seq.tolist(), at, lp[at], turn[at]))
    return out


def _by_hand(model, view, weigh, eps=0.2):
    """One SGD step on a copy of ``model``: the weighted clipped surrogate written out from raw log-probs.

    ``weigh(old, rollout, turn)`` gives each sampled token's weight (0: dropped) from the trainer's log-probs, the
    rollout's and the token's turn. Returns the copy after the step, the loss and the weights.
    """
    model = copy.deepcopy(model).eval()
    adv = _advantages(view["reward"].tolist(), view["group"].tolist())
    episodes = _sampled(view)
    loss = torch.zeros(())
    weights = []
    for (seq, at, rollout, turn), a in zip(episodes, adv):
        lp = _raw_log_probs(model, seq)[at]
        w = weigh(lp.detach().double(), rollout.double(), turn)
        weights.append(w)
        kept = w > 0
        ratio = torch.exp(lp - lp.detach())[kept]
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a)
        if kept.any():
            loss = loss - (w[kept].float() * surrogate).mean() / len(episodes)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    return model, float(loss.detach()), weights


def _max_diff(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


def _learner(policy, **config):
    sgd = torch.optim.SGD(policy.model.parameters(), lr=LR)
    return GRPOLearner(policy, GRPOConfig(kl=0.0, max_grad_norm=None, **config), optimizer=sgd)


def _stale_start(tiny_model, tokenizer, attempts):
    """A view sampled with weights W0, then the policy's weights replaced by a perturbed W1 (version 1)."""
    torch.manual_seed(0)
    policy = _policy(copy.deepcopy(tiny_model), tokenizer)
    view = chatenv.episodes(chatenv.rollout(_envs(tokenizer, 4, attempts), policy, episodes=4, group_size=2, seed=3))
    # the rollout's log-probs are the sampling weights' own (independent check of what the correction divides by)
    for seq, at, rollout, _ in _sampled(view):
        with torch.no_grad():
            assert torch.allclose(_raw_log_probs(tiny_model, seq)[at], rollout, atol=1e-4)
    state = {k: v.clone() for k, v in policy.model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    state["lm_head.weight"] += 0.1 * torch.randn(state["lm_head.weight"].shape, generator=gen)
    assert policy.update_weights(state) == 1
    return policy, view


def test_weights_by_hand():
    rollout = torch.tensor([-1.0, -1.0, -2.0, -0.5, -3.0])
    old = torch.tensor([-0.5, -1.2, -1.0, -0.5, -3.3])
    lr = (old - rollout).double()
    token = correct(rollout, old, OffPolicyConfig())
    assert token.weight.tolist() == pytest.approx(torch.exp(lr).clamp(max=2).tolist())
    assert token.truncated.tolist() == [False, False, True, False, False] and token.keep.all()
    masked = correct(rollout, old, OffPolicyConfig(mode="mask", cap=1.5))  # keeps ratios in [1/1.5, 1.5]
    assert masked.keep.tolist() == [False, True, False, True, True]
    assert masked.weight.tolist() == pytest.approx([0.0, math.exp(-0.2), 0.0, 1.0, math.exp(-0.3)])
    # sequence level: one geometric-mean weight per run of one version; a version 2 behind is dropped
    versions = torch.tensor([3, 3, 4, 4, 5])
    assert segments(versions).tolist() == [0, 0, 1, 1, 2]
    seq = correct(rollout, old, OffPolicyConfig(level="sequence", max_staleness=1), versions=versions, current=5)
    expected = [0.0, 0.0, math.exp((lr[2] + lr[3]) / 2), math.exp((lr[2] + lr[3]) / 2), math.exp(lr[4])]
    assert seq.weight.tolist() == pytest.approx(expected) and seq.stale.tolist() == [True, True, False, False, False]
    assert seq.lag.tolist() == [2, 2, 1, 1, 0]
    # 600 tokens each 1% likelier under the trainer: the length-normalised weight stays 1.01, exp(sum) would be 403
    n = 600
    long = correct(torch.zeros(n), torch.full((n,), 0.01), OffPolicyConfig(level="sequence", cap=10.0))
    assert float(long.weight.max()) == pytest.approx(math.exp(0.01), rel=1e-6)
    with pytest.raises(ValueError, match="finite"):
        correct(torch.tensor([math.nan]), torch.tensor([0.0]), OffPolicyConfig())


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("is_level", "episode", "level"),
        ("is_mode", "clip", "mode"),
        ("is_cap", 1.0, "cap"),
        ("max_staleness", -1, "max_staleness"),
    ],
)
def test_bad_correction_settings_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**{field: value})


@pytest.mark.slow
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_a_stale_update_equals_the_importance_weighted_step_by_hand(tiny_model, tokenizer, level):
    policy, view = _stale_start(tiny_model, tokenizer, attempts=2)
    w1 = copy.deepcopy(policy.model)

    def weigh(old, rollout, turn):
        if level == "token":
            return torch.exp(old - rollout).clamp(max=2.0)
        return torch.exp((old - rollout).mean()).clamp(max=2.0).expand(len(old))  # one version: one segment

    expected, loss, weights = _by_hand(w1, view, weigh)
    learner = _learner(policy, is_level=level)
    metrics = learner.step(view)
    assert metrics["loss"] == pytest.approx(loss, abs=1e-6)
    for fix, w in zip(learner.corrections, weights):
        assert torch.allclose(fix.weight, w, atol=1e-5)
    assert _max_diff(policy.model, expected) < 1e-6
    # the weights matter: the uncorrected step lands elsewhere
    plain, _, _ = _by_hand(w1, view, lambda old, rollout, turn: torch.ones(len(old), dtype=torch.float64))
    assert _max_diff(plain, expected) > 1e-4
    assert metrics["version_lag_max"] == 1 and policy.version == 2 and metrics["policy_version"] == 2
    assert metrics["mismatch_kl"] > 1e-3 and metrics["is_ratio_max"] > 1.0
    if level == "token":
        assert 0 < metrics["is_truncated_frac"] < 1


@pytest.mark.slow
def test_mixed_versions_get_segment_weights_and_stale_turns_are_dropped(tiny_model, tokenizer):
    policy, view = _stale_start(tiny_model, tokenizer, attempts=3)
    assert (view["num_turns"] == 3).all()
    policy.update_weights(policy.model.state_dict())  # version 2, same weights as W1
    view.set("turn_version", torch.tensor([[0, 1, 2]] * len(view)))  # each turn sampled by another version
    w1 = copy.deepcopy(policy.model)

    def weigh(old, rollout, turn):
        out = torch.zeros(len(old), dtype=torch.float64)
        for t in (1, 2):  # turn 0 lags 2 versions > max_staleness: dropped
            here = turn == t
            out[here] = torch.exp((old[here] - rollout[here]).mean()).clamp(max=2.0)
        return out

    expected, loss, weights = _by_hand(w1, view, weigh)
    learner = _learner(policy, is_level="sequence", max_staleness=1)
    metrics = learner.step(view)
    for (_, _, _, turn), fix, w in zip(_sampled(view), learner.corrections, weights):
        assert torch.allclose(fix.weight, w, atol=1e-5)
        assert fix.stale.tolist() == (turn == 0).tolist() and not fix.keep[turn == 0].any()
        assert fix.weight[turn == 1].unique().numel() == 1 and fix.weight[turn == 2].unique().numel() == 1
    assert metrics["loss"] == pytest.approx(loss, abs=1e-6) and _max_diff(policy.model, expected) < 1e-6
    stale = sum(int((turn == 0).sum()) for *_, turn in _sampled(view))
    total = sum(len(turn) for *_, turn in _sampled(view))
    assert metrics["stale_frac"] == pytest.approx(stale / total) and metrics["tokens"] == total - stale
    assert metrics["version_lag_max"] == 2


@pytest.mark.slow
def test_too_stale_tokens_are_never_trained_on(tiny_model, tokenizer):
    policy, view = _stale_start(tiny_model, tokenizer, attempts=1)
    before = copy.deepcopy(policy.model)
    metrics = _learner(policy, max_staleness=0).step(view)
    assert metrics["stale_frac"] == 1.0 and metrics["tokens"] == 0.0 and _max_diff(policy.model, before) == 0.0


@pytest.mark.slow
def test_without_staleness_weights_are_one_on_60_turn_episodes(tiny_model, tokenizer):
    policy = _policy(copy.deepcopy(tiny_model), tokenizer, max_new_tokens=3)
    envs = _envs(tokenizer, 2, attempts=60, retry="No.")
    view = chatenv.episodes(chatenv.rollout(envs, policy, episodes=2, group_size=2, seed=0))
    assert (view["num_turns"] == 60).all()
    for level in ("token", "sequence"):
        learner = GRPOLearner(
            policy, GRPOConfig(kl=0.0, is_level=level), optimizer=torch.optim.SGD(policy.model.parameters(), lr=0.0)
        )
        version = policy.version
        metrics = learner.step(view)
        worst = max(float((fix.weight - 1).abs().max()) for fix in learner.corrections)
        assert worst < 1e-3, (level, worst)
        assert metrics["is_truncated_frac"] == 0.0 and metrics["version_lag_max"] == version
        assert abs(metrics["mismatch_kl"]) < 1e-6


def test_each_replys_version_reaches_the_episode_view_and_back(tiny_model, tokenizer):
    from chatenv.rollout import turns
    from chatenv.rollout.records import episode_records, records_view

    policy = _policy(copy.deepcopy(tiny_model), tokenizer, max_new_tokens=3)
    td = chatenv.rollout(_envs(tokenizer, 2, attempts=3, retry="No."), policy, episodes=2, seed=0)
    assert td["policy_version"].tolist() == [0] * len(td)
    td["policy_version"] = 10 * td["episode"] + td["turn"]  # as if every turn came from another version
    view = chatenv.episodes(td)
    expected = [[10 * e + t for t in range(3)] for e in view["episode"].tolist()]
    assert view["turn_version"].tolist() == expected
    assert turns(view)["policy_version"].tolist() == [v for row in expected for v in row]
    assert records_view(episode_records(td))["turn_version"].tolist() == expected
