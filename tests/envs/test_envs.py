"""ChatEnv, tasks, rewards, vector envs and rollouts."""

import json
import threading
import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import chatenv
from chatenv import ChatEnv, Task, TaskResponse, TaskStart, rollout
from chatenv.envs import ENVS
from chatenv.rewards import combine, exact_match, extract_answer, format_reward, numeric_match, parse_number
from wrappers.policies import TransformersWrapper

MODES = ("history", "text", "tokens")
HEADER = "<|im_start|>assistant\n"


def reply_ids(tokenizer, text):
    return np.array(tokenizer.encode(text) + [2], dtype=np.int64)


# ------------------------------------------------------------------------------------------ env API


@pytest.mark.parametrize("env_id", sorted(e for e in ENVS if not e.startswith("chatenv/Token")))
@pytest.mark.parametrize("mode", MODES)
def test_check_env_clean(env_id, mode):
    env = gym.make(env_id, input_mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
    assert [str(w.message) for w in caught] == []
    env.close()
    env.close()  # idempotent


@pytest.mark.parametrize("mode", MODES)
def test_next_observation_opens_a_new_assistant_turn(mode, tokenizer):
    env = gym.make("chatenv/Arithmetic-v0", input_mode=mode)
    obs, _ = env.reset(seed=3)
    action = reply_ids(tokenizer, "<answer>-1</answer>") if mode == "tokens" else "<answer>-1</answer>"
    obs, reward, terminated, truncated, info = env.step(action)
    assert not terminated and not truncated and info["turn"] == 1
    if mode == "text":
        assert obs.endswith("Put the final answer in <answer></answer> tags.<|im_end|>\n" + HEADER)
    elif mode == "tokens":
        assert tokenizer.decode(obs).endswith("tags.<|im_end|>\n" + HEADER)
    else:
        assert obs[-1]["role"] == "user" and obs[-2] == {"role": "assistant", "content": "<answer>-1</answer>"}
        rendered = chatenv.apply_chat_template(tokenizer, obs, add_generation_prompt=True, tokenize=False)
        assert rendered.endswith(HEADER)
    # the three views agree
    unwrapped = env.unwrapped
    full = chatenv.apply_chat_template(tokenizer, unwrapped.messages, add_generation_prompt=True)
    assert np.array_equal(unwrapped.token_ids, full["input_ids"].numpy())
    assert np.array_equal(unwrapped.assistant_mask, full["all_assistant_mask"].numpy())


def test_same_seed_same_episode():
    a, b = gym.make("chatenv/GuessNumber-v0"), gym.make("chatenv/GuessNumber-v0")
    oa, _ = a.reset(seed=11)
    ob, _ = b.reset(seed=11)
    assert oa == ob
    for guess in ("50", "25", "75"):
        ra = a.step(guess)
        rb = b.step(guess)
        assert ra[0] == rb[0] and ra[1:4] == rb[1:4]
    assert a.unwrapped.episode.state["secret"] == b.unwrapped.episode.state["secret"]
    oc, _ = a.reset(seed=12)
    assert a.unwrapped.episode.state["secret"] != b.unwrapped.episode.state["secret"] or oc != oa


def test_tito_over_eight_turns(tokenizer, tiny_model):
    """Generated ids are kept verbatim; each observation is a prefix of the next."""
    env = ChatEnv("guess_number", input_mode="tokens", max_turns=8, task_kwargs={"max_guesses": 8})
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 6, "seed": 1}
    )
    obs, _ = env.reset(seed=0)
    turns = 0
    done = False
    while not done:
        ids, _ = policy.act(obs)
        nxt, _, terminated, truncated, _ = env.step(ids)
        assert np.array_equal(nxt[: len(obs)], obs)
        assert np.array_equal(nxt[len(obs) : len(obs) + len(ids)], ids)
        assert tokenizer.decode(nxt).endswith(HEADER)
        obs, done, turns = nxt, terminated or truncated, turns + 1
    assert turns == 8
    # assistant mask: exactly the generated ids (and closing tokens are not assistant when a reply was cut off)
    assert env.assistant_mask.sum() <= 8 * 6


def test_tito_equals_full_render_for_canonical_replies(tokenizer):
    env = ChatEnv("guess_number", input_mode="tokens", max_turns=8)
    obs, _ = env.reset(seed=0)
    for guess in range(10, 90, 10):
        obs, *_ = env.step(reply_ids(tokenizer, str(guess)))
    full = chatenv.apply_chat_template(tokenizer, env.messages, add_generation_prompt=True)
    assert np.array_equal(obs, full["input_ids"].numpy())
    assert np.array_equal(env.assistant_mask, full["all_assistant_mask"].numpy())
    assert len(env.messages) == 1 + 2 * 8


def test_cut_off_reply_is_closed_without_marking_the_closing_tokens(tokenizer):
    env = ChatEnv("arithmetic", input_mode="tokens")
    obs, _ = env.reset(seed=0)
    cut = np.array(tokenizer.encode("I think it is"), dtype=np.int64)  # no end-of-turn token
    nxt, *_ = env.step(cut)
    closing = nxt[len(obs) + len(cut)]
    assert closing == 2 and not env.assistant_mask[len(obs) + len(cut)]
    assert env.assistant_mask[len(obs) : len(obs) + len(cut)].all()


def test_max_turns_truncates_and_final_turn_is_scored():
    env = ChatEnv("arithmetic", max_turns=1)
    env.reset(seed=0)
    answer = env.episode.state["answer"]
    _, reward, terminated, truncated, info = env.step(f"<answer>{answer + 1}</answer>")
    assert truncated and not terminated
    assert reward == pytest.approx(0.1) and info["reward_components"] == {"correct": 0.0, "format": 1.0}
    env.reset(seed=0)
    _, reward, terminated, truncated, _ = env.step(f"<answer>{answer}</answer>")
    assert terminated and not truncated and reward == pytest.approx(1.1)


def test_token_budget_truncates(tokenizer):
    env = ChatEnv("guess_number", input_mode="tokens", max_tokens=120)
    obs, info = env.reset(seed=0)
    done, steps = False, 0
    while not done:
        obs, _, terminated, truncated, info = env.step(reply_ids(tokenizer, "1"))
        done, steps = terminated or truncated, steps + 1
    assert truncated and info["num_tokens"] >= 120 and steps < 8


def test_options_start_a_given_chat():
    env = ChatEnv("arithmetic", input_mode="text")
    chat = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 6 * 7?"}]
    obs, _ = env.reset(options={"messages": chat, "answer": 42})
    assert obs.startswith("<|im_start|>system\nBe exact.<|im_end|>") and obs.endswith(HEADER)
    _, reward, terminated, _, _ = env.step("It is <answer>42</answer>")
    assert terminated and reward == pytest.approx(1.1)
    obs, _ = env.reset(options={"messages": chatenv.History.from_chats(chat), "answer": 1})
    assert "Be exact." in obs


def test_bad_input_errors_leave_the_env_unchanged(tokenizer):
    env = ChatEnv("arithmetic", input_mode="tokens")
    with pytest.raises(RuntimeError, match="reset"):
        env.step(reply_ids(tokenizer, "1"))
    obs, _ = env.reset(seed=0)
    before = (env.token_ids.copy(), env.messages, env.turn)
    for bad, err, match in [
        ("text", TypeError, "token ids"),
        (np.array([], dtype=np.int64), ValueError, "empty action"),
        (np.array([5, 10**7]), ValueError, "outside the vocabulary"),
        (np.array([[1, 2]]), TypeError, "1-D"),
        (3.5, TypeError, "unsupported action"),
    ]:
        with pytest.raises(err, match=match):
            env.step(bad)
        assert np.array_equal(env.token_ids, before[0]) and env.messages == before[1] and env.turn == before[2]
    hist = ChatEnv("arithmetic")
    hist.reset(seed=0)
    with pytest.raises(ValueError, match="role 'user'"):
        hist.step({"role": "user", "content": "hi"})
    with pytest.raises(ValueError, match="input_mode"):
        ChatEnv("arithmetic", input_mode="chat")
    with pytest.raises(ValueError, match="non-empty list"):
        hist.reset(options={"messages": []})
    with pytest.raises(ValueError, match="role"):
        hist.reset(options={"messages": [{"content": "no role"}]})
    with pytest.raises(TypeError, match="content"):
        hist.reset(options={"messages": [{"role": "user", "content": 5}]})
    with pytest.raises(ValueError, match="unknown task 'arithmetc'; did you mean 'arithmetic'"):
        ChatEnv("arithmetc")
    env.reset(seed=0)
    env.step(reply_ids(tokenizer, f"<answer>{env.episode.state['answer']}</answer>"))
    with pytest.raises(RuntimeError, match="ended"):
        env.step(reply_ids(tokenizer, "1"))


def test_render_ansi():
    env = gym.make("chatenv/Arithmetic-v0", render_mode="ansi")
    env.reset(seed=0)
    env.step("<answer>3</answer>")
    text = env.render()
    assert "[user]\nWhat is" in text and "[assistant]\n<answer>3</answer>" in text


def test_chat_v0_from_jsonl_and_list(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text(json.dumps({"prompt": "Capital of Italy?", "answer": "Rome"}) + "\n\n")
    env = gym.make("chatenv/Chat-v0", task_kwargs={"data": str(path)})
    obs, _ = env.reset(seed=0)
    assert obs[-1]["content"] == "Capital of Italy?"
    _, reward, terminated, _, _ = env.step("It is <answer>rome</answer>.")
    assert terminated and reward == 1.0
    env = gym.make(
        "chatenv/Chat-v0",
        task_kwargs={"data": [{"messages": [{"role": "user", "content": "2+3?"}], "answer": 5}], "max_attempts": 2},
    )
    env.reset(seed=0)
    _, reward, terminated, truncated, _ = env.step("Six")
    assert reward == 0.0 and not terminated and not truncated
    _, reward, terminated, _, _ = env.step("5")
    assert reward == 1.0 and terminated
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(ValueError, match="line 1"):
        gym.make("chatenv/Chat-v0", task_kwargs={"data": str(bad)})


# ------------------------------------------------------------------------------------------ rewards


def test_reward_functions():
    assert extract_answer("blah <answer> 12 </answer> and <answer>13</answer>") == "13"
    assert extract_answer(r"so \boxed{\frac{3}{4}} done") == r"\frac{3}{4}"
    assert extract_answer("I got 1,234.5 then -7") == "-7"
    assert extract_answer("no digits here") is None
    assert parse_number("1,234") == 1234.0 and parse_number(r"\frac{1}{4}") == 0.25 and parse_number("$5.") == 5.0
    assert numeric_match("<answer>0.5</answer>", r"\frac{1}{2}") == 1.0
    assert numeric_match("the answer is 41", 42) == 0.0
    # malformed replies score low and never raise
    for reply in ("", "<answer></answer>", r"\boxed{", "<answer>abc</answer>", None):
        assert numeric_match(reply, 3) == 0.0 and exact_match(reply, "x") == 0.0 and format_reward(reply) in (0.0, 1.0)
    assert exact_match("<answer>Paris</answer>", "paris") == 1.0
    total, parts = combine({"c": (numeric_match, 2.0), "f": (format_reward, 0.5)})("<answer>7</answer>", 7)
    assert total == 2.5 and parts == {"c": 1.0, "f": 1.0}


# ------------------------------------------------------------------------------------------ vector envs


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_make_vec(mode, tokenizer):
    venv = gym.make_vec("chatenv/Arithmetic-v0", num_envs=3, vectorization_mode=mode, input_mode="tokens")
    obs, _ = venv.reset(seed=0)
    assert len(obs) == 3 and all(o.dtype == np.int64 for o in obs)
    obs2, reward, terminated, truncated, info = venv.step(
        tuple(reply_ids(tokenizer, "<answer>0</answer>") for _ in range(3))
    )
    assert reward.shape == (3,) and all(tokenizer.decode(o).endswith(HEADER) for o in obs2)
    assert all(np.array_equal(o2[: len(o)], o) for o, o2 in zip(obs, obs2))
    venv.close()


# ------------------------------------------------------------------------------------------ rollouts


@pytest.fixture(scope="module")
def greedy_tokens_policy(tiny_model, tokenizer):
    return TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 8, "temperature": 0}
    )


def test_rollout_equals_hand_stepped_run(greedy_tokens_policy, tokenizer):
    env = ChatEnv("arithmetic", input_mode="tokens")
    td = rollout(env, greedy_tokens_policy, episodes=2, seed=5)
    # the same by hand
    rows = []
    obs, _ = env.reset(seed=5)
    for _ in range(2):
        done = False
        while not done:
            ids, out = greedy_tokens_policy.act(obs)
            nxt, reward, terminated, truncated, _ = env.step(ids)
            rows.append((obs, ids, reward, terminated, truncated))
            obs, done = nxt, terminated or truncated
        obs, _ = env.reset()
    assert td.batch_size == (len(rows),)
    tokens = td["tokens"]
    for k, (obs, ids, reward, terminated, truncated) in enumerate(rows):
        assert tokens.unpadded("prompt")[k].tolist() == obs.tolist()
        assert tokens.unpadded("response")[k].tolist() == ids.tolist()
        assert td["next", "reward"][k, 0].item() == pytest.approx(reward)
        assert td["next", "terminated"][k, 0].item() == terminated and td["next", "truncated"][k, 0].item() == truncated
    assert td["next", "reward"].shape == (len(rows), 1) and td["next", "done"].dtype == torch.bool
    assert td["episode"].tolist() == sorted(td["episode"].tolist()) and set(td["episode"].tolist()) == {0, 1}
    # masks: every generated token of the episode, earlier turns included; log-probs defined there
    m = td["masks"].all_assistant_mask
    assert m.shape == tokens.full.shape == td["log_probs"].full.shape
    resp = td["log_probs"].full[:, tokens.prompt.shape[1] :]
    assert torch.isfinite(resp[td["masks"].all_attention_mask[:, tokens.prompt.shape[1] :]]).all()
    later = (td["turn"] > 0).nonzero().flatten()
    for k in later.tolist():
        prev = k - 1
        n_prev = int(tokens.response_length[prev])
        p_width, p_len = tokens.prompt.shape[1], int(tokens.prompt_length[k])
        prompt_mask = m[k, p_width - p_len : p_width]
        start = int(tokens.prompt_length[prev])
        assert prompt_mask[start : start + n_prev].all()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_rollout_modes_and_vector_env(mode, tiny_model, tokenizer):
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode=mode, generate_kwargs={"max_new_tokens": 6, "seed": 0}
    )
    envs = [ChatEnv("arithmetic", input_mode=mode) for _ in range(3)]
    td = rollout(envs, policy, episodes=4, seed=0)
    assert sorted(set(td["episode"].tolist())) == [0, 1, 2, 3]
    assert td["next", "done"].sum() == 4  # every episode ends exactly once
    if mode != "tokens":
        assert mode in td.keys()
    venv = gym.make_vec("chatenv/Arithmetic-v0", num_envs=2, input_mode=mode)
    td_v = rollout(venv, policy, episodes=3, seed=0)
    assert td_v["next", "done"].sum() == 3 and sorted(set(td_v["episode"].tolist())) == [0, 1, 2]
    for ep in range(3):
        turns = td_v["turn"][td_v["episode"] == ep].tolist()
        assert turns == list(range(len(turns)))
    venv.close()
    td_s = rollout(envs, policy, steps=5, seed=0)
    assert td_s.batch_size == (5,)


class RendezvousTask(Task):
    description = "replies once every env sharing its barrier is replying too"

    def __init__(self, barrier):
        self.barrier = barrier

    def reset(self, rng):
        return TaskStart([{"role": "user", "content": "Say hi."}], None)

    def respond(self, messages, state):
        self.barrier.wait()
        return TaskResponse(1.0, True)


def test_slow_task_does_not_block_other_envs(greedy_tokens_policy):
    # Each reward returns only when all four are waiting at once: envs stepped one after another never get there
    # (the first waits alone until the barrier breaks). The wall time the overlap saves is measured by
    # benchmarks/async_rollout.py --reward-delay, not here.
    barrier = threading.Barrier(4, timeout=60)
    envs = [ChatEnv(RendezvousTask(barrier), input_mode="tokens") for _ in range(4)]
    td = rollout(envs, greedy_tokens_policy, episodes=4, seed=0)
    assert td.batch_size == (4,) and (td["next", "reward"] == 1.0).all()
    assert not barrier.broken and barrier.n_waiting == 0


def test_rollout_rejects_mismatched_policy(greedy_tokens_policy):
    with pytest.raises(ValueError, match="input_mode"):
        rollout(ChatEnv("arithmetic"), greedy_tokens_policy, episodes=1)
    with pytest.raises(ValueError, match="exactly one"):
        rollout(ChatEnv("arithmetic", input_mode="tokens"), greedy_tokens_policy)
