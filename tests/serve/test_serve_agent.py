"""Agent programs as envs: AgentEnv runs against the capture endpoint; rollouts match ChatEnv's TensorDict."""

import sys
import textwrap

import httpx
import openai
import pytest
import torch

import chatenv
from chatenv.envs import ChatEnv
from chatenv.serve import AgentEnv, AgentError, agent_rollout

torch.set_num_threads(1)

MODEL = "chatenv-policy"


@pytest.fixture(scope="module")
def greedy(tiny_model, tokenizer):
    from wrappers.policies import TransformersWrapper

    settings = {"max_new_tokens": 8, "min_new_tokens": 3, "temperature": 0}
    return TransformersWrapper(tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=settings)


def one_shot(base_url, messages):
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        return client.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content


def test_agent_rollout_equals_chat_env_rollout(greedy, tokenizer):
    envs = [ChatEnv("arithmetic", tokenizer=tokenizer, input_mode="tokens", max_turns=1) for _ in range(2)]
    direct = chatenv.rollout(envs, greedy, episodes=3, seed=5)
    agents = [AgentEnv(one_shot, "arithmetic") for _ in range(2)]
    served = agent_rollout(agents, greedy, episodes=3, seed=5)
    order = torch.argsort(served["episode"])
    for key in (("tokens", "full"), ("masks", "all_assistant_mask")):
        assert torch.equal(served[key][order], direct[key]), key
    torch.testing.assert_close(served["log_probs"].full[order], direct["log_probs"].full, equal_nan=True)
    for key in ("reward", "terminated", "truncated", "done"):
        assert torch.equal(served["next", key][order], direct["next", key]), key
    assert served["segment"].tolist() == [0, 0, 0] and served["run"].tolist() == [0, 1, 2]
    assert list(served["next", "chat"]) == list(direct["next", "chat"])


def test_a_group_without_a_seed_shares_its_opening(greedy):
    openings = []

    def agent(base_url, messages):
        openings.append(messages[-1]["content"])
        return one_shot(base_url, messages)

    td = agent_rollout([AgentEnv(agent, "arithmetic")], greedy, episodes=4, group_size=2)
    assert td["group"].tolist() == [0, 0, 1, 1] and len(openings) == 4
    assert openings[0] == openings[1] and openings[2] == openings[3]


def test_divergent_agent_gives_one_episode_per_segment(greedy):
    def agent(base_url, messages):
        with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            r = client.chat.completions.create(model=MODEL, messages=messages)
            history = [
                *messages,
                r.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Go on"},
            ]
            client.chat.completions.create(model=MODEL, messages=history)
            compacted = [{"role": "user", "content": "Summary so far: nothing. Answer now."}]  # history rewritten
            client.chat.completions.create(model=MODEL, messages=compacted)
            httpx.post(base_url + "/reward", json={"reward": 0.25})

    env = AgentEnv(agent)
    env.reset(options={"messages": [{"role": "user", "content": "Start"}]})
    with chatenv.serve.CaptureServer(greedy) as server:
        env.run(server.base_url("div"))
        data = server.session("div")
        outcome = env.score(data)
    assert data["divergences"] == 1 and outcome.reward == 0.25
    td = chatenv.serve.session_tensordict(data, pad_token_id=greedy.pad_token_id)
    assert td["episode"].tolist() == [0, 0, 1] and td["next", "truncated"][:, 0].tolist() == [False, True, False]
    view = chatenv.episodes(td)
    assert view["num_turns"].tolist() == [2, 1]


def test_agent_env_without_task_needs_an_opening(greedy):
    with pytest.raises(ValueError, match="needs its opening"):
        agent_rollout(AgentEnv(one_shot), greedy, episodes=1)


@pytest.mark.slow
def test_command_agent_and_failures(greedy, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, sys
            import openai
            messages = json.load(sys.stdin)
            with openai.OpenAI(max_retries=0) as client:  # OPENAI_BASE_URL / OPENAI_API_KEY come from the env
                r = client.chat.completions.create(model="chatenv-policy", messages=messages)
            print(r.choices[0].message.content)
            """
        )
    )
    td = agent_rollout(AgentEnv([sys.executable, str(script)], "arithmetic"), greedy, episodes=1, seed=1)
    assert td.batch_size[0] == 1 and td["next", "done"].all()

    def silent(base_url, messages):
        return None

    with pytest.raises(AgentError, match="no chat-completions request") as e:
        agent_rollout([AgentEnv(one_shot, "arithmetic"), AgentEnv(silent, "arithmetic")], greedy, episodes=2)
    assert e.value.partial.batch_size[0] <= 1
    with pytest.raises(AgentError, match="status 3"):
        agent_rollout(AgentEnv([sys.executable, "-c", "raise SystemExit(3)"], "arithmetic"), greedy, episodes=1)


def test_cli_serve_refuses_bad_arguments(capsys):
    from chatenv.cli import main

    assert main(["serve", "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
