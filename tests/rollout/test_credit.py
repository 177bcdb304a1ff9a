"""Per-turn credit on real rollouts: returns-to-go, per-turn advantages (checked against a plain re-implementation),
per-token advantages on the assistant mask, and a GRPO step that uses them (tiny real model)."""

import math

import numpy as np
import pytest
import torch

import chatenv
from chatenv import ChatEnv
from chatenv.rollout import branch_rollout
from chatenv.rollout.credit import token_advantages, turn_advantages, turn_returns
from chatenv.tasks import Task, TaskResponse, TaskStart

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def policy(tiny_model, tokenizer):
    from wrappers.policies import TransformersWrapper

    return TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 10, "seed": 0}
    )


class Lengths(Task):
    """Up to four turns; a reply scores its length mod 3, and a reply of odd length ends the episode (the model
    decides when to stop)."""

    def reset(self, rng):
        return TaskStart([{"role": "user", "content": "Say something."}], {"turns": 0})

    def respond(self, messages, state):
        state["turns"] += 1
        n = len(messages[-1]["content"])
        done = n % 2 == 1 or state["turns"] >= 4
        return TaskResponse(float(n % 3), done, [] if done else [{"role": "user", "content": "More."}])


@pytest.fixture(scope="module")
def view(policy, tokenizer):
    envs = [ChatEnv(Lengths(), input_mode="tokens", tokenizer=tokenizer) for _ in range(4)]
    td = chatenv.rollout(envs, policy, episodes=12, group_size=4, seed=0)
    return chatenv.episodes(td)


def flat(rows):
    return [v for row in rows for v in row]


def rewards_of(view):
    padded = view["turn_reward"]
    rows = padded.unbind() if padded.is_nested else list(padded)
    return [r[~torch.isnan(r)].tolist() for r in rows]


def reference(view, gamma, baseline, scale, eps=1e-4):
    """The estimators written out directly, with plain Python lists."""
    rewards = rewards_of(view)
    returns = [[sum(gamma**k * r for k, r in enumerate(rs[t:])) for t in range(len(rs))] for rs in rewards]
    groups = view["group"].tolist()
    out = []
    for e, g in enumerate(returns):
        mine = []
        peers = [o for o in range(len(returns)) if groups[o] == groups[e]]
        for t in range(len(g)):
            if baseline == "loo":
                others = [returns[o][t] if t < len(returns[o]) else 0.0 for o in peers if o != e]
                everyone = [returns[o][t] if t < len(returns[o]) else 0.0 for o in peers]
                if not others:
                    mine.append(0.0)
                    continue
                a = g[t] - sum(others) / len(others)
                spread = np.std(everyone)
            else:
                alive = [returns[o][t] for o in peers if t < len(returns[o])]
                if len(alive) < 2:
                    mine.append(0.0)
                    continue
                a = g[t] - sum(alive) / len(alive)
                spread = np.std(alive)
            mine.append(a / (spread + eps) if scale else a)
        out.append(mine)
    return returns, out


@pytest.mark.parametrize("baseline", ["loo", "survivors"])
@pytest.mark.parametrize(("gamma", "scale"), [(1.0, True), (0.9, False)])
def test_turn_advantages_match_a_direct_computation(view, baseline, gamma, scale):
    returns, expected = reference(view, gamma, baseline, scale)
    got_returns = [r.tolist() for r in turn_returns(view, gamma)]
    assert [len(r) for r in got_returns] == [len(r) for r in returns]
    assert flat(got_returns) == pytest.approx(flat(returns), abs=1e-5)
    got = [a.tolist() for a in turn_advantages(view, gamma=gamma, baseline=baseline, scale=scale)]
    assert [len(a) for a in got] == [len(a) for a in expected]
    assert flat(got) == pytest.approx(flat(expected), abs=1e-4)
    assert any(abs(v) > 1e-3 for v in flat(got))
    assert len({len(r) for r in rewards_of(view)}) > 1, "the episodes should differ in length for this test"


def test_the_unbiased_baseline_counts_ended_episodes_and_leaves_the_own_out(view):
    loo = turn_advantages(view, baseline="loo", scale=False)
    survivors = turn_advantages(view, baseline="survivors", scale=False)
    returns = turn_returns(view)
    lengths = [len(r) for r in returns]
    t = min(lengths)  # a turn that some episodes of a group reached and others did not
    late = [e for e in range(len(returns)) if lengths[e] > t]
    assert late and any(abs(loo[e][t] - survivors[e][t]) > 1e-6 for e in late)


def test_token_advantages_sit_on_the_replies_tokens(view):
    per_turn = [torch.arange(1, len(r) + 1, dtype=torch.float32) for r in turn_returns(view)]  # turn k -> k + 1
    dense = token_advantages(view, per_turn)
    masks = view["masks"].unpadded()
    fulls = view["tokens"].unpadded("full")
    for e, (d, m) in enumerate(zip(dense, masks)):
        assert len(d) == len(fulls[e]) == len(m)
        assert torch.equal(d != 0, m), e  # exactly the assistant tokens
        assert set(d[m].tolist()) == set(per_turn[e].tolist())  # every turn's value, on its own reply
    with pytest.raises(ValueError, match="advantages"):
        token_advantages(view, [t[:-1] for t in per_turn])


@pytest.mark.slow
def test_grpo_step_with_turn_credit_on_branches(tokenizer):
    from conftest import make_tiny_llama

    from wrappers.grpo import GRPOConfig, GRPOLearner
    from wrappers.policies import TransformersWrapper

    own = TransformersWrapper(  # a model of its own: the step trains it
        make_tiny_llama(0), tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 10}
    )
    env = ChatEnv(Lengths(), input_mode="tokens", tokenizer=tokenizer)
    env.reset(seed=4)
    env.step(tokenizer.encode("ab") + [2])
    view = chatenv.episodes(branch_rollout(env, own, n=4))
    assert view["group"].tolist() == [0, 0, 0, 0]
    learner = GRPOLearner(own, GRPOConfig(kl=0.0, credit="turn", lr=1e-3))
    before = [p.detach().clone() for p in learner.model.parameters()]
    metrics = learner.step(view)
    assert np.isfinite(metrics["loss"]) and metrics["tokens"] > 0
    per_turn = turn_advantages(view)
    moved = any(not torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))
    assert moved == any(bool((a != 0).any()) for a in per_turn)  # a nonzero advantage somewhere trains the model
    with pytest.raises(ValueError, match="GRPOConfig.credit must be one of"):
        GRPOConfig(credit="token")
    with pytest.raises(ValueError, match="GRPOConfig.turn_baseline"):
        GRPOConfig(turn_baseline="mean")


# ------------------------------------------------------------------------------------------ branch credit


def test_branch_values_and_advantages_match_a_direct_computation(policy, tokenizer):
    from chatenv.rollout.credit import branch_values, value_advantages

    envs = [ChatEnv(Lengths(), input_mode="tokens", tokenizer=tokenizer) for _ in range(4)]
    kept = []

    def keep(env, episode, turn):
        kept.append(((episode, turn), chatenv.fork(env), env.unwrapped.token_ids.tolist()))

    td = chatenv.rollout(envs, policy, episodes=8, group_size=4, seed=1, on_turn=keep)
    view = chatenv.episodes(td)
    rewards = rewards_of(view)
    ids = view["episode"].tolist()
    # a point for every turn after the first of every episode, taken where the episode was at that moment
    assert sorted(k for k, _, _ in kept) == sorted((e, t) for e, r in zip(ids, rewards) for t in range(1, len(r)))
    fulls = view["tokens"].unpadded("full")
    for (episode, turn), fork, seen in kept:
        assert fulls[ids.index(episode)].tolist()[: len(seen)] == seen and fork.unwrapped.turn == turn
    branches = chatenv.episodes(branch_rollout([f for _, f, _ in kept], policy, n=3))
    values = branch_values(view, [k for k, _, _ in kept], branches)
    # the values written out: the mean return of the point's three branches
    branch_returns = rewards_of(branches)
    groups = branches["group"].tolist()
    for p, ((episode, turn), _, _) in enumerate(kept):
        mine = [sum(r) for r, g in zip(branch_returns, groups) if g == p]
        assert len(mine) == 3
        assert float(values[ids.index(episode)][turn]) == pytest.approx(sum(mine) / 3, abs=1e-5)
    for v in values:
        assert torch.isnan(v[0])
    advantages = value_advantages(view, values, scale=False)
    groups = view["group"].tolist()
    for e, r in enumerate(rewards):
        others = [sum(rewards[o]) for o in range(len(rewards)) if groups[o] == groups[e] and o != e]
        v = [sum(others) / len(others)] + [float(values[e][t]) for t in range(1, len(r))] + [0.0]
        expected = [r[t] + v[t + 1] - v[t] for t in range(len(r))]
        assert advantages[e].tolist() == pytest.approx(expected, abs=1e-5)
    scaled = value_advantages(view, values)
    spread = np.std([a for e in range(4) for a in advantages[e].tolist()])  # the first group's advantages
    assert scaled[0].tolist() == pytest.approx([a / (spread + 1e-4) for a in advantages[0].tolist()], rel=1e-4)
    # a group whose episodes all return the same still gets bounded advantages from its branch values
    from tensordict import TensorDict

    same = TensorDict({"turn_reward": torch.tensor([[0.0, 1.0], [0.0, 1.0]]), "group": torch.tensor([0, 0])}, [2])
    bounded = value_advantages(same, [torch.tensor([math.nan, 0.5]), torch.tensor([math.nan, math.nan])])
    assert max(abs(a) for row in bounded for a in row.tolist()) < 2.0
    with pytest.raises(ValueError, match="one \\(turns,\\) tensor per episode"):
        value_advantages(view, values[:-1])
    with pytest.raises(ValueError, match="names episode 99"):
        branch_values(view, [(99, 1)], branches)
    for env in envs:
        env.close()


@pytest.mark.slow
def test_grpo_step_with_branch_credit(tokenizer):
    from conftest import make_tiny_llama

    from chatenv.rollout.credit import branch_values
    from wrappers.grpo import GRPOConfig, GRPOLearner
    from wrappers.policies import TransformersWrapper

    own = TransformersWrapper(
        make_tiny_llama(1), tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 10}
    )
    kept = []
    envs = [ChatEnv(Lengths(), input_mode="tokens", tokenizer=tokenizer) for _ in range(4)]
    td = chatenv.rollout(envs, own, episodes=4, group_size=4, seed=2, on_turn=lambda e, k, t: kept.append(((k, t), e)))
    assert not kept or all(isinstance(env, ChatEnv) for _, env in kept)
    learner = GRPOLearner(own, GRPOConfig(kl=0.0, credit="branch", lr=1e-3))
    view = chatenv.episodes(td)
    with pytest.raises(ValueError, match="credit='branch' needs values="):
        learner.step(view)
    metrics = learner.step(view, values=branch_values(view, [], None))  # no sampled values: own returns-to-go
    assert np.isfinite(metrics["loss"]) and metrics["tokens"] > 0
    with pytest.raises(ValueError, match="the other credits take none"):
        GRPOLearner(own, GRPOConfig(kl=0.0)).step(view, values=branch_values(view, [], None))


def _turn_view(rewards, groups):
    """An episode view of ``turn_reward`` (NaN-padded) and ``group`` only: what value_advantages reads."""
    from tensordict import TensorDict

    width = max(len(r) for r in rewards)
    padded = torch.tensor([list(r) + [math.nan] * (width - len(r)) for r in rewards], dtype=torch.float32)
    return TensorDict({"turn_reward": padded, "group": torch.tensor(groups)}, [len(rewards)])


def test_a_lone_episode_gets_no_credit_for_its_opening():
    from chatenv.rollout.credit import group_advantages, value_advantages

    lone = _turn_view([[0.75]], [0])  # `chatenv train --credit branch --group-size 1`, a one-turn episode
    assert value_advantages(lone, [torch.tensor([math.nan])])[0].tolist() == [0.0]
    assert value_advantages(lone, [torch.tensor([math.nan])], scale=False)[0].tolist() == [0.0]
    assert group_advantages([0.75], [0]).tolist() == [0.0]  # the same rule as episode credit
    # episodes each alone in their group, with and without a sampled value at their second turn
    lone = _turn_view([[0.0, 1.0], [0.5, 0.25]], [0, 1])
    raw = value_advantages(lone, [torch.tensor([math.nan, 0.25]), torch.tensor([math.nan, math.nan])], scale=False)
    assert raw[0].tolist() == [0.0, 0.75] and raw[1].tolist() == [0.0, 0.0]  # the branches still credit turn 1
    scaled = value_advantages(lone, [torch.tensor([math.nan, 0.25]), torch.tensor([math.nan, math.nan])])
    assert scaled[0].tolist() == pytest.approx([0.0, 0.75 / (0.75 / math.sqrt(2) + 1e-4)])
    assert scaled[1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_scaled_branch_advantages_stay_bounded(gamma):
    """Every scaled advantage is within sqrt(turns of its group), whatever the group's spread (zero included)."""
    from chatenv.rollout.credit import value_advantages

    rng = np.random.default_rng(0)
    worst = 0.0
    for trial in range(300):
        size = int(rng.integers(1, 4))
        lengths = rng.integers(1, 4, size)
        rewards = [rng.choice([0.0, 0.25, 0.75, 1.0], n).tolist() for n in lengths]
        values = [torch.tensor([math.nan] + [float(rng.choice([math.nan, 0.0, 0.5, 1.0])) for _ in range(n - 1)])
                  for n in lengths]  # fmt: skip
        out = value_advantages(_turn_view(rewards, [0] * size), values, gamma=gamma)
        bound = math.sqrt(int(lengths.sum()))
        largest = max(abs(a) for row in out for a in row.tolist())
        assert largest <= bound + 1e-5, (trial, rewards, values, [row.tolist() for row in out])
        worst = max(worst, largest / bound)
    assert worst > 0.5  # the bound is reached in part, not met by advantages that are all 0
