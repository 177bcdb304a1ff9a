"""reasoning-gym datasets as tasks (the real package), and dataset records with questions and metadata."""

import gymnasium as gym
import numpy as np
import pytest

import chatenv
from chatenv import ChatEnv, DatasetTask, check, rollout
from chatenv.integrations.reasoning_gym import ReasoningGymTask

reasoning_gym = pytest.importorskip("reasoning_gym")


def _reply(env, text):
    return np.array(env.chat_tokenizer.reply(env.messages, {"role": "assistant", "content": text}).ids)


@pytest.mark.parametrize("name", ["basic_arithmetic", "chain_sum", "letter_counting"])
def test_scored_by_the_datasets_own_score_answer(name):
    env = ChatEnv("reasoning_gym", task_kwargs={"dataset": name, "size": 20, "seed": 3}, input_mode="tokens")
    env.reset(seed=1)
    task = env.task
    entry = task.records[env.episode.state["index"]]
    assert env.messages[-1]["content"].startswith(entry["question"])
    assert env.messages[-1]["content"].endswith("<answer></answer> tags.")
    # the dataset's own verdict on its own answer, and on a wrong one
    expected = task.dataset.score_answer(entry["answer"], entry=entry)
    _, reward, terminated, _, info = env.step(_reply(env, f"<answer>{entry['answer']}</answer>"))
    assert reward == expected == 1.0 and terminated and info["reward_components"]["answered"] == 1.0
    env.reset(seed=1)
    _, reward, _, _, info = env.step(_reply(env, "I do not know."))
    assert reward == task.dataset.score_answer(None, entry=entry) == 0.0
    assert info["reward_components"] == {"score": 0.0, "answered": 0.0}


def test_same_seed_same_problem_and_the_checker_passes():
    make = lambda: gym.make(  # noqa: E731
        "chatenv/Chat-v0", task="reasoning_gym", task_kwargs={"dataset": "basic_arithmetic", "size": 10}
    )
    a, b = make(), make()
    assert a.reset(seed=4)[0] == b.reset(seed=4)[0]
    assert check(make).ok


def test_bad_reasoning_gym_arguments():
    with pytest.raises(
        ValueError, match="unknown reasoning-gym dataset 'basic_arithmetik'; did you mean 'basic_arithmetic'"
    ):
        ReasoningGymTask("basic_arithmetik")
    with pytest.raises(ValueError, match="method must be"):
        ReasoningGymTask("basic_arithmetic", size=2, answer_method="regex")
    with pytest.raises(TypeError, match="expected a reasoning-gym dataset"):
        ReasoningGymTask(object())


def test_dataset_records_with_questions_and_whole_record_scoring():
    seen = []

    def reward(reply, record):
        seen.append(record)
        return float(record["metadata"]["target"] in reply)

    data = [{"question": "Say seven.", "answer": "7", "metadata": {"target": "seven"}}]
    env = ChatEnv(DatasetTask(data, reward_fn=reward, pass_record=True, instruction="Be brief."), input_mode="history")
    obs, _ = env.reset(seed=0)
    assert obs[-1]["content"] == "Say seven.\n\nBe brief."
    _, r, *_ = env.step("seven")
    assert r == 1.0 and seen == [data[0]]
    with pytest.raises(ValueError, match="pass_record=True hands the record to reward_fn"):
        DatasetTask(data, pass_record=True)
    with pytest.raises(TypeError, match="'question' must be a str"):
        DatasetTask([{"question": 3}])
    env.reset(options={"messages": [{"role": "user", "content": "Say seven."}], "index": 0})
    assert env.step("seven")[1] == 1.0
    with pytest.raises(ValueError, match=r"options\['index'\] must be a record index in \[0, 1\)"):
        env.reset(options={"messages": [{"role": "user", "content": "x"}], "index": 5})


def test_rollout_on_reasoning_gym(tiny_model, tokenizer):
    from wrappers.policies import TransformersWrapper

    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 4}
    )
    envs = [ChatEnv("reasoning_gym", task_kwargs={"dataset": "basic_arithmetic", "size": 8}, input_mode="tokens")] * 1
    td = rollout(envs, policy, episodes=2, seed=0, group_size=2)
    assert td["next", "done"].sum() == 2 and "score" in td["next", "reward_components"].keys()
    view = chatenv.episodes(td)
    assert view.batch_size == (2,) and view["group"].tolist() == [0, 0]
