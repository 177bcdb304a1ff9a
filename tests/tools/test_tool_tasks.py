"""The built-in tool tasks (calculator, sandboxed Python, retrieval) and the tool-use reward helpers.

Actions are real inputs: token ids the template writes for a tool call (``ct.reply``), or message dicts with
``tool_calls`` in history mode. The sandbox runs real worker processes; the CLI test uses a tiny Llama whose
weights spell one tool call, so the saved trajectories hold real calls and results.
"""

import json
import re

import gymnasium as gym
import pytest
import torch

import chatenv
from chatenv import ChatEnv
from chatenv.errors import ChatEnvError
from chatenv.rewards import ToolReply, combine, numeric_match, tool_errors, tool_successes, used_tool
from chatenv.tasks import (
    CalculatorArithmeticTask,
    DocumentStore,
    PythonTask,
    RetrievalTask,
    RewardError,
    calculator,
    shared_sandbox,
)
from chatenv.tools import ToolStats

TOOL_ENVS = ["chatenv/CalculatorArithmetic-v0", "chatenv/PythonTask-v0", "chatenv/Retrieval-v0"]


def _call(env, name, mode="tokens", **arguments):
    """Step ``env`` with a reply that calls one tool (its template's ids, or a message dict in history mode)."""
    base = env.unwrapped
    message = {"role": "assistant", "content": "", "tool_calls": [{"name": name, "arguments": arguments}]}
    if mode == "history":
        return env.step(message)
    ids = base.chat_tokenizer.reply(base.messages, message, tools=base.tools.schemas()).ids.tolist()
    return env.step(ids)


def _answer(env, text, mode="tokens"):
    base = env.unwrapped
    if mode == "history":
        return env.step({"role": "assistant", "content": text})
    return env.step(base.chat_tokenizer.reply(base.messages, {"role": "assistant", "content": text}).ids.tolist())


def _assert_tito(env):
    """The kept ids equal a full render of the chat with the env's tool schemas."""
    base = env.unwrapped
    full = base.chat_tokenizer.encode(base.messages, add_generation_prompt=True, tools=base.tools.schemas())
    assert full.ids.tolist() == base.token_ids.tolist()


@pytest.mark.parametrize("env_id", TOOL_ENVS)
def test_each_task_resets_deterministically_by_seed(env_id, tokenizer):
    env = gym.make(env_id, input_mode="history", tokenizer=tokenizer)
    first, _ = env.reset(seed=7)
    state = dict(env.unwrapped.episode.state)
    again, _ = env.reset(seed=7)
    assert again == first and env.unwrapped.episode.state == state
    others = {env.reset(seed=s)[0][-1]["content"] for s in range(8)}
    assert len(others) > 4  # seeds draw different problems
    assert first[0]["role"] == "system" and "<answer></answer>" in first[0]["content"]
    assert env.unwrapped.chat_tokenizer.template.name == "smollm2-tools"
    env.close()


def test_calculator_refuses_unsafe_input_and_the_episode_goes_on(tokenizer):
    env = ChatEnv("calculator_arithmetic", input_mode="tokens", tokenizer=tokenizer)
    env.reset(seed=0)
    answer = env.episode.state["answer"]
    for bad, why in [
        ("__import__('os').system('echo hi')", "unsupported element 'Call'"),
        ("9 ** 99999", "exponent 99999 is too large"),
        ("10 ** 99 * 10 ** 99", "more than 100 digits"),
        ("().__class__", "unsupported element"),
        ("1 / 0", "division by zero"),
    ]:
        _, reward, terminated, truncated, info = _call(env, "calculator", expression=bad)
        tool = env.messages[-1]
        assert tool["role"] == "tool" and tool["content"].startswith("Error: 'calculator' raised ValueError")
        assert why in tool["content"], tool["content"]
        assert (reward, terminated, truncated) == (0.0, False, False)
        assert info["tool_turn"]["error_kinds"] == {"raised": 1}
        env.max_turns = 99  # room for every refusal
    assert env.episode.tools.stats.errors == 5
    _, _, _, _, info = _call(env, "calculator", expression=env.episode.state["expression"])
    assert env.messages[-1]["content"] == str(answer) and info["tool_errors"] == 5
    _, reward, terminated, _, info = _answer(env, f"<answer>{answer}</answer>")
    assert terminated and reward == 1.0 and info["tool_calls"] == 6


def test_calculator_is_exact_and_readable():
    assert calculator("4821 * 7390 - 1337 * 52") == str(4821 * 7390 - 1337 * 52)
    assert calculator(" (2 + 3) ** 2 // 4 % 5 ") == "1"
    assert calculator("7 / 2") == "3.5" and calculator("2 ** -2") == "0.25" and calculator("-7 // 2") == "-4"
    for bad in ["", "x + 1", "2 ^ 8", "1,234", "'a' * 3", "True + 1", "(" * 300 + "1" + ")" * 300, "1" * 600]:
        with pytest.raises(ValueError):
            calculator(bad)
    with pytest.raises(ValueError, match="write powers with"):
        calculator("2 ^ 8")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_correct_trajectory_earns_the_full_reward_and_a_wrong_answer_none(seed, tokenizer):
    env = ChatEnv("calculator_arithmetic", input_mode="tokens", tokenizer=tokenizer)
    env.reset(seed=seed)
    state = env.episode.state
    _, reward, terminated, _, info = _call(env, "calculator", expression=state["expression"])
    assert (reward, terminated) == (0.0, False) and info["tool_calls"] == 1 and info["tool_errors"] == 0
    result = env.messages[-1]["content"]
    assert result == str(state["answer"])
    _, reward, terminated, _, info = _answer(env, f"The result is <answer>{result}</answer>.")
    assert terminated and reward == 1.0
    assert info["reward_components"] == {"correct": 1.0, "used_tool": 1.0}
    env.reset(seed=seed)
    _, reward, terminated, _, info = _answer(env, f"<answer>{state['answer'] + 1}</answer>")
    assert terminated and reward == 0.0 and info["reward_components"] == {"correct": 0.0, "used_tool": 0.0}


def test_reward_helpers_compose_with_combine(tokenizer):
    reward = combine(
        {"correct": (numeric_match, 1.0), "used_tool": (tool_successes, 0.5), "errors": (tool_errors, -0.25)}
    )
    env = ChatEnv(CalculatorArithmeticTask(reward_fn=reward), input_mode="tokens", tokenizer=tokenizer)
    env.reset(seed=3)
    state = env.episode.state
    _call(env, "calculator", expression="import os")  # a failed call
    _call(env, "calculator", expression=state["expression"])
    _, total, terminated, _, info = _answer(env, f"<answer>{state['answer']}</answer>")
    assert terminated and info["reward_components"] == {"correct": 1.0, "used_tool": 1.0, "errors": 1.0}
    assert total == pytest.approx(1.0 + 0.5 - 0.25)
    _assert_tito(env)
    # plain strings carry no tool use; a ToolReply is still a str
    assert tool_successes("<answer>1</answer>", 1) == tool_errors("x", None) == used_tool("x", None) == 0.0
    reply = ToolReply("<answer>5</answer>", ToolStats(calls=4, errors=1))
    assert isinstance(reply, str) and reply.upper() == "<ANSWER>5</ANSWER>" and numeric_match(reply, 5) == 1.0
    assert (tool_successes(reply, 5), tool_errors(reply, 5), used_tool(reply, 5)) == (3.0, 1.0, 1.0)
    with pytest.raises(TypeError, match="must be a str"):
        ToolReply(5)


def test_python_task_runs_code_in_real_sandbox_processes(tokenizer):
    env = ChatEnv(PythonTask(kinds=["prime_sum"]), input_mode="history", tokenizer=tokenizer)
    env.reset(seed=5)
    n = int(re.search(r"below (\d+)", env.messages[-1]["content"]).group(1))
    code = (
        f"n = {n}\nsieve = [True] * n\nsieve[:2] = [False, False]\n"
        "for p in range(2, int(n ** 0.5) + 1):\n"
        "    if sieve[p]:\n        sieve[p*p::p] = [False] * len(sieve[p*p::p])\n"
        "import os\nprint(sum(i for i, s in enumerate(sieve) if s), os.getpid())"
    )
    _, reward, terminated, _, info = _call(env, "python", mode="history", code=code)
    assert (reward, terminated, info["tool_errors"]) == (0.0, False, 0)
    out = env.messages[-1]["content"]
    assert out.startswith("[stdout]\n"), out
    value, pid = (int(x) for x in out.split()[1:3])
    assert value == env.episode.state["answer"]  # the task's own reference, computed without the sandbox
    assert pid == 1 and shared_sandbox().isolation == "namespaces"  # the init of the call's own PID namespace
    _call(env, "python", mode="history", code="raise ValueError('boom')")
    assert "ValueError: boom" in env.messages[-1]["content"]  # the traceback, for the model to read
    _, reward, terminated, _, info = _answer(env, f"<answer>{value}</answer>", mode="history")
    assert terminated and reward == 1.0 and info["tool_calls"] == 2
    _assert_tito(env)
    env.close()


def test_retrieval_search_finds_the_document_holding_the_answer(tokenizer):
    env = ChatEnv(RetrievalTask(facts=["capital", "founded", "currency"]), input_mode="history", tokenizer=tokenizer)
    for seed in range(3):
        env.reset(seed=seed)
        state = env.episode.state
        name = re.search(r"(?:of|was) ([A-Z][a-z]+)", env.messages[-1]["content"]).group(1)
        _call(env, "search", mode="history", query=f"{name} {state['fact']}")
        hits = env.messages[-1]["content"]
        assert hits.startswith(f"[{state['sources'][0]}]") or f"[{state['sources'][0]}]" in hits
        assert state["answer"] in hits
        _call(env, "read", mode="history", doc_id=state["sources"][0])
        assert state["answer"] in env.messages[-1]["content"]
        _call(env, "read", mode="history", doc_id="doc-999")
        assert (
            env.messages[-1]["content"].startswith("Error:") and "no document 'doc-999'" in env.messages[-1]["content"]
        )
        _, reward, terminated, _, _ = _answer(env, f"<answer>{state['answer']}</answer>", mode="history")
        assert terminated and reward == 1.0
    store = DocumentStore({"a": "the capital of Veltrana is Osk", "b": "Osk is a city"}, top_k=1)
    assert store.search("Veltrana capital").startswith("[a]") and store.search("nothing here") == (
        "No documents match 'nothing here'."
    )
    with pytest.raises(ValueError, match="no searchable words"):
        store.search("the of")


def test_one_retrieval_task_serves_several_envs_each_its_own_documents(tokenizer):
    task = RetrievalTask(facts=["capital"])
    envs = [ChatEnv(task, input_mode="history", tokenizer=tokenizer) for _ in range(2)]
    for seed, env in enumerate(envs):
        env.reset(seed=seed)
    for env in envs:  # the second reset does not change what the first episode's tools serve
        state = env.episode.state
        _call(env, "read", mode="history", doc_id=state["sources"][0])
        assert state["answer"] in env.messages[-1]["content"]


def test_gym_make_python_task_and_bad_arguments(tokenizer):
    env = gym.make("chatenv/PythonTask-v0", tokenizer=tokenizer)
    obs, _ = env.reset(seed=0)
    assert env.unwrapped.max_turns == 5 and "python" in [s["function"]["name"] for s in env.unwrapped.tools.schemas()]
    env.close()
    with pytest.raises(ValueError, match="kinds must be"):
        PythonTask(kinds=["nope"])
    with pytest.raises(ValueError, match="countries must be"):
        RetrievalTask(countries=0)
    with pytest.raises(TypeError, match="reward_fn must be"):
        CalculatorArithmeticTask(reward_fn=3)

    def broken(reply, answer):
        raise KeyError("oops")

    env = ChatEnv(CalculatorArithmeticTask(reward_fn=broken), input_mode="history", tokenizer=tokenizer)
    env.reset(seed=0)
    with pytest.raises(RewardError, match="reward_fn raised KeyError"):
        env.step("<answer>1</answer>")
    assert env.turn == 0  # the failed step changed nothing
    assert isinstance(RewardError("x"), ChatEnvError)


@pytest.mark.slow
@pytest.mark.parametrize("env_id", TOOL_ENVS)
def test_check_passes_on_the_tool_envs(env_id, tokenizer):
    report = chatenv.check(lambda: gym.make(env_id, input_mode="tokens", tokenizer=tokenizer), raise_on_failure=False)
    assert report.ok, str(report)


# ----------------------------------------------------------------------------------------------- CLI


def _ids_of(tokenizer, pieces):
    """The vocabulary id of each piece (each is one token of the vocabulary)."""
    vocab = {}
    for i, text in enumerate(tokenizer.batch_decode([[i] for i in range(len(tokenizer))])):
        vocab.setdefault(text, i)
    return [vocab[p] for p in pieces]


def _scripted_llama(chain, path, tokenizer):
    """A tiny Llama whose next token depends only on the last one: it follows ``chain`` (then ends its turn)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden = 64
    assert len(chain) < hidden
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        for k, (prev, nxt) in enumerate(zip(chain, [*chain[1:], tokenizer.eos_token_id])):
            model.model.embed_tokens.weight[prev, k] = 1.0
            model.lm_head.weight[nxt, k] = 30.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.mark.slow
def test_cli_rollout_writes_tool_calls_and_results_per_turn(tokenizer, tmp_path, capsys):
    import copy

    from chatenv.cli import main

    # the tool-call markers as single tokens (as in Qwen2.5's vocabulary), so every id of the call is distinct and
    # a model that looks at the last token only can write it: header "\n" -> <tool_call> -> {"name":... -> </tool_call>
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    body = ['{"', "name", '":"', "python", '","', "arguments", '":', ' {"', "code", '"', ':"', "print", "(", "4", "2"]
    body += [')"', "}}"]
    chain = [*tok.encode("\n", add_special_tokens=False), *tok.convert_tokens_to_ids(["<tool_call>"])]
    chain += [*_ids_of(tok, body), *tok.convert_tokens_to_ids(["</tool_call>"])]
    assert len(set(chain)) == len(chain) and tok.eos_token_id not in chain
    assert tok.decode(chain[1:]) == '<tool_call>{"name":"python","arguments": {"code":"print(42)"}}</tool_call>'
    _scripted_llama(chain, tmp_path / "model", tok)
    out = tmp_path / "run"
    args = ["rollout", "--env", "chatenv/PythonTask-v0", "--episodes", "2", "--envs", "1", "--max-turns", "2"]
    args += ["--model", str(tmp_path / "model"), "--max-new-tokens", "32", "--temperature", "0", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 2
    for e in episodes:
        assert e["turns"] == 2 and e["truncated"] and not e["terminated"]
        assert (e["tool_calls"], e["tool_errors"]) == (2, 0)
        roles = [m["role"] for m in e["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"]
        for reply, result in zip(e["messages"][2::2], e["messages"][3::2]):
            # not the template's own layout (no newlines around the JSON): the reply keeps its text, the call runs
            assert reply["content"] == '<tool_call>{"name":"python","arguments": {"code":"print(42)"}}</tool_call>'
            assert result["content"] == "[stdout]\n42" and result["name"] == "python", result


def test_python_task_runs_in_the_sandbox_it_is_given(tokenizer):
    import warnings

    from chatenv.tools.sandbox import PythonSandbox

    with pytest.raises(TypeError, match="sandbox must be a PythonSandbox"):
        PythonTask(sandbox="docker")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isolation="none" warns on purpose
        own = PythonSandbox(workers=1, isolation="none")
    with own:
        env = ChatEnv(PythonTask(sandbox=own), input_mode="history", tokenizer=tokenizer)
        env.reset(seed=0)
        _call(env, "python", mode="history", code="import os\nprint(os.getpid() > 1)")
        assert env.messages[-1]["content"] == "[stdout]\nTrue"  # not the init of a PID namespace: no isolation
        env.close()
