"""Grouped rollouts, per-episode reset options, and the episode view (with its exact way back to turns)."""

import math

import gymnasium as gym
import pytest
import torch

import chatenv
from chatenv import ChatEnv, rollout
from chatenv.rollout import turns
from wrappers.kl import KLPenalty, ReferenceModel
from wrappers.policies import TransformersWrapper


@pytest.fixture(scope="module")
def policy(tiny_model, tokenizer):
    return TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 6, "seed": 0}
    )


def _first_prompts(td):
    prompts = td["tokens"].unpadded("prompt")
    return {int(e): prompts[k].tolist() for k, (e, t) in enumerate(zip(td["episode"], td["turn"])) if t == 0}


def test_groups_share_their_reset(policy):
    envs = [ChatEnv("arithmetic", input_mode="tokens") for _ in range(3)]
    td = rollout(envs, policy, episodes=6, group_size=3, seed=5)
    first = _first_prompts(td)
    assert td["group"].tolist() == [int(e) // 3 for e in td["episode"]]
    assert first[0] == first[1] == first[2] and first[3] == first[4] == first[5] and first[0] != first[3]
    # group g starts like a plain reset with seed + g
    env = ChatEnv("arithmetic", input_mode="tokens")
    assert env.reset(seed=6)[0].tolist() == first[3]
    # the samples of a group differ (fresh sampling per episode)
    replies = {
        int(e): r.tolist() for e, t, r in zip(td["episode"], td["turn"], td["tokens"].unpadded("response")) if t == 0
    }
    assert len({tuple(replies[e]) for e in range(3)}) > 1


def test_reset_options_pin_each_group(policy):
    chats = [[{"role": "user", "content": f"What is {a} + {a}?"}] for a in (2, 3)]
    options = [{"messages": c, "answer": 2 * a} for c, a in zip(chats, (2, 3))]
    envs = [ChatEnv("arithmetic", input_mode="tokens") for _ in range(2)]
    td = rollout(envs, policy, episodes=4, group_size=2, reset_options=options, seed=0)
    ct = envs[0].chat_tokenizer
    first = _first_prompts(td)
    for e in range(4):
        assert first[e] == ct.encode(chats[e // 2], add_generation_prompt=True).ids.tolist()
    with pytest.raises(ValueError, match=r"one dict per group \(2\), got 3 items"):
        rollout(envs, policy, episodes=4, group_size=2, reset_options=[{}] * 3)
    with pytest.raises(ValueError, match="not a multiple of group_size=3"):
        rollout(envs, policy, episodes=4, group_size=3)
    with pytest.raises(ValueError, match="use episodes="):
        rollout(envs, policy, steps=4, group_size=2)
    with pytest.raises(ValueError, match="cannot start from given seeds or options"):
        rollout(
            gym.make_vec("chatenv/Arithmetic-v0", num_envs=2, input_mode="tokens"), policy, episodes=2, group_size=2
        )


@pytest.mark.parametrize("pad", [True, False])
def test_episode_view_and_its_way_back(pad, tiny_model, ref_tiny, tokenizer):
    policy = TransformersWrapper(
        tiny_model,
        tokenizer=tokenizer,
        input_mode="tokens",
        pad_output=pad,
        generate_kwargs={"max_new_tokens": 5, "seed": 1},
    )
    ref = ReferenceModel(ref_tiny, tokenizer)
    envs = [KLPenalty(ChatEnv("guess_number", input_mode="tokens", max_turns=3), 0.1, ref_model=ref) for _ in range(2)]
    td = rollout(envs, policy, episodes=4, group_size=2, seed=0)
    view = chatenv.episodes(td)
    assert view.batch_size == (4,)
    assert view["num_turns"].tolist() == [int((td["episode"] == e).sum()) for e in range(4)]
    for e in range(4):
        rows = [k for k in range(td.batch_size[0]) if td["episode"][k] == e]
        last = rows[-1]
        full = td["tokens"].unpadded("full")[last]
        assert torch.equal(view["tokens"].unpadded("full")[e], full)
        assert torch.equal(view["tokens"].unpadded("prompt")[e], td["tokens"].unpadded("prompt")[rows[0]])
        assert torch.equal(view["masks"].unpadded()[e], td["masks"].unpadded()[last])
        # generation log-probs on the replies, NaN on the env's tokens
        lp = view["log_probs"].unpadded("response")[e]
        mask = view["masks"].unpadded()[e][len(view["tokens"].unpadded("prompt")[e]) :]
        assert not torch.isnan(lp[mask]).any() and torch.isnan(lp[~mask]).all()
        assert math.isclose(float(view["reward"][e]), float(td["next", "reward"][rows, 0].sum()), rel_tol=1e-6)
        assert bool(view["terminated"][e] | view["truncated"][e])
    assert view["group"].tolist() == [0, 0, 1, 1]
    back = turns(view)
    assert back.batch_size == td.batch_size
    for key in ("prompt", "response", "full"):
        assert [x.tolist() for x in back["tokens"].unpadded(key)] == [x.tolist() for x in td["tokens"].unpadded(key)]
    assert [m.tolist() for m in back["masks"].unpadded()] == [m.tolist() for m in td["masks"].unpadded()]
    for key in ("log_probs", "kl", "ref_log_probs"):
        for a, b in zip(back[key].unpadded("response"), td[key].unpadded("response")):
            assert torch.equal(a, b)
    for key in ("reward", "task_reward", "terminated", "truncated", "done"):
        assert torch.equal(back["next", key], td["next", key])
    for key in ("episode", "turn", "env_index", "group"):
        assert torch.equal(back[key], td[key])


def test_on_episode_hands_over_each_episode_as_it_ends(policy):
    seen = []
    envs = [ChatEnv("guess_number", input_mode="tokens", max_turns=3) for _ in range(2)]
    td = rollout(envs, policy, episodes=3, seed=0, on_episode=seen.append)
    assert sorted(int(s["episode"][0]) for s in seen) == [0, 1, 2]
    for s in seen:
        ep = int(s["episode"][0])
        rows = td[td["episode"] == ep]
        assert s["turn"].tolist() == rows["turn"].tolist() and bool(s["next", "done"][-1])
        assert [x.tolist() for x in s["tokens"].unpadded("full")] == [
            x.tolist() for x in rows["tokens"].unpadded("full")
        ]
        assert s["next", "chat"][-1] != ""  # the env's own chat, at the episode's end
