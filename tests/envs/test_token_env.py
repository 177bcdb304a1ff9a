"""TokenEnv: one generated token per step."""

import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from chatenv import ChatEnv, TokenEnv


def test_check_env_clean():
    env = gym.make("chatenv/TokenArithmetic-v0", max_new_tokens=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    assert [str(w.message) for w in caught] == []
    assert env.action_space == gym.spaces.Discrete(49152)


def play(env, ids):
    out = []
    for t in ids:
        out.append(env.step(int(t)))
        if out[-1][2] or out[-1][3]:
            break
    return out


def test_token_steps_equal_one_turn_level_step(tokenizer):
    tok_env, turn_env = TokenEnv("arithmetic"), ChatEnv("arithmetic", input_mode="tokens")
    obs, _ = tok_env.reset(seed=4)
    obs2, _ = turn_env.reset(seed=4)
    assert np.array_equal(obs, obs2)
    reply = tokenizer.encode("<answer>12</answer>") + [2]  # wrong: the task answers and the chat goes on
    steps = play(tok_env, reply)
    assert [s[1] for s in steps[:-1]] == [0.0] * (len(reply) - 1)
    obs_t, reward_t, term_t, trunc_t, info_t = steps[-1]
    obs_c, reward_c, term_c, trunc_c, info_c = turn_env.step(np.array(reply))
    assert np.array_equal(obs_t, obs_c) and reward_t == reward_c and (term_t, trunc_t) == (term_c, trunc_c)
    assert info_t["reward_components"] == info_c["reward_components"]
    assert tokenizer.decode(obs_t).endswith("<|im_start|>assistant\n")
    # the right answer at the end-of-turn token terminates
    answer = tok_env.unwrapped.episode.state["answer"]
    steps = play(tok_env, tokenizer.encode(f"<answer>{answer}</answer>") + [2])
    assert steps[-1][2] and not steps[-1][3] and steps[-1][1] == pytest.approx(1.1)


def test_max_new_tokens_truncates_and_scores_the_cut_reply(tokenizer):
    env = TokenEnv("arithmetic", max_new_tokens=4)
    env.reset(seed=0)
    answer = env.episode.state["answer"]
    ids = tokenizer.encode(f"<answer>{answer}</answer> and more words")
    steps = play(env, ids)
    assert len(steps) == 4
    _, reward, terminated, truncated, info = steps[-1]
    assert truncated and not terminated and info["response_tokens"] == 4
    assert "reward_components" in info  # the cut reply was evaluated


def test_bad_actions_raise_and_change_nothing(tokenizer):
    env = TokenEnv("arithmetic")
    with pytest.raises(RuntimeError, match="reset"):
        env.step(5)
    obs, _ = env.reset(seed=0)
    for bad, err in [
        (-1, ValueError),
        (10**6, ValueError),
        (2.0, TypeError),
        (np.array([1, 2]), TypeError),
        (True, TypeError),
    ]:
        with pytest.raises(err):
            env.step(bad)
        assert np.array_equal(env.token_ids, obs)
    env.step(np.int64(5))
    assert env.token_ids[-1] == 5
    env = TokenEnv("arithmetic", max_new_tokens=1)
    env.reset(seed=0)
    env.step(7)
    with pytest.raises(RuntimeError, match="ended"):
        env.step(7)


@pytest.mark.slow
def test_kv_cached_token_policy_matches_a_full_forward(tiny_model, tokenizer):
    """Two TokenEnvs stepped with the cached policy: each sampled log-prob equals a fresh forward's, across
    multi-token continuation chunks (wrong answers get feedback) and episode resets (cache rebuilt)."""
    from wrappers.token_policy import TokenStepPolicy

    policy = TokenStepPolicy(tiny_model, tokenizer, temperature=0.8, seed=0)
    envs = [TokenEnv("arithmetic", max_new_tokens=6) for _ in range(2)]
    obs = [env.reset(seed=i)[0] for i, env in enumerate(envs)]
    checked, resets, chunks = 0, 0, 0
    for _ in range(40):
        actions, lps = policy.act(obs)
        for i, env in enumerate(envs):
            seq = obs[i].tolist() + [int(actions[i])]
            with torch.no_grad():
                logits = tiny_model(torch.tensor([seq])).logits[0, -2].float() / 0.8
            ref = logits.log_softmax(-1)[seq[-1]].item()
            assert abs(ref - float(lps[i])) < 1e-4
            checked += 1
            nxt, _, terminated, truncated, _ = env.step(int(actions[i]))
            chunks += len(nxt) - len(seq) > 0
            obs[i] = nxt
            if terminated or truncated:
                resets += 1
                obs[i] = env.reset(seed=10 + checked)[0]
    assert checked == 80 and resets >= 1 and chunks >= 1


def test_kl_penalty_per_token(tiny_model, tokenizer):
    from conftest import make_tiny_llama

    from chatenv import ScoredAction
    from wrappers.kl import KLPenalty, ReferenceModel
    from wrappers.token_policy import TokenStepPolicy

    ref_model = make_tiny_llama(seed=1)
    env = KLPenalty(TokenEnv("arithmetic", max_new_tokens=5), 0.3, ref_model=ReferenceModel(ref_model, tokenizer))
    policy = TokenStepPolicy(tiny_model, tokenizer, seed=2)
    obs, _ = env.reset(seed=0)
    total_task = 0.0
    for _ in range(5):
        action, lp = policy.act([obs])
        seq = obs.tolist() + [int(action[0])]
        with torch.no_grad():
            q = ref_model(torch.tensor([seq])).logits[0, -2].float().log_softmax(-1)[seq[-1]].item()
        obs, reward, terminated, truncated, info = env.step(ScoredAction(action, lp))
        kl = float(lp[0]) - q
        assert len(info["kl"]) == 1 and info["kl"][0] == pytest.approx(kl, abs=1e-4)
        assert reward == pytest.approx(info["task_reward"] - 0.3 * kl, abs=1e-4)
        total_task += info["task_reward"]
        if terminated or truncated:
            assert "reward_components" in info  # the reply's task reward arrives at its last token
            break
    assert terminated or truncated


def test_token_policy_from_wrapper_and_bad_observations(tiny_model, tokenizer):
    from wrappers.policies import TransformersWrapper
    from wrappers.token_policy import TokenStepPolicy

    wrapper = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, generate_kwargs={"temperature": 0.5, "top_k": 20, "seed": 1}
    )
    policy = TokenStepPolicy.from_wrapper(wrapper)
    assert (policy.temperature, policy.top_k, policy.model) == (0.5, 20, tiny_model)
    with pytest.raises(ValueError, match="vocabulary"):
        policy.act([np.array([1, 10**6])])
    with pytest.raises(ValueError, match="context"):
        policy.act([np.full(2000, 5)])
    with pytest.raises(ValueError, match="empty"):
        policy.act([np.array([], dtype=np.int64)])
    actions, lps = policy.act([np.array([1, 4093, 198])])
    assert actions.shape == (1,) and lps.shape == (1,) and np.isfinite(lps).all()
