"""Eval harnesses run unmodified against the endpoint: inspect-ai's default ``openai/`` provider and openai-agents.

Each client runs from its own released venv (``make clients``) as a program of its own (:func:`helpers.run_client`),
against a :class:`~chatenv.serve.CaptureServer` on loopback serving the tiny random Llama. The model is served
under the name ``gpt-5-mini`` too, so inspect-ai takes its OpenAI path for such a model: the Responses API with
``store: false``, ``include: ["reasoning.encrypted_content"]``, a reasoning probe (``reasoning: {"effort": "low"}``)
and ``parallel_tool_calls``. openai-agents runs an Agent with a function tool and ``ModelSettings(tool_choice=
"required", parallel_tool_calls=False)`` on both its chat-completions and its Responses model. Every episode must
record one whole token-exact segment (each request extends it; no divergence).
"""

import json

import httpx
import pytest
import torch
from conftest import make_tiny_llama
from helpers import corpus_tokenizer, run_client
from test_streaming import HookedPolicy, scripted

from chatenv import chat_tokenizer
from chatenv.templates import get_template

pytest.importorskip("xgrammar")
torch.set_num_threads(1)
pytestmark = pytest.mark.slow  # each client is a process of its own (imports take seconds)

AGENT = '''
import asyncio, json, sys
from typing import Literal

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner
from agents import ToolsToFinalOutputResult, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

set_tracing_disabled(True)
CALLS = []


@function_tool
def weather(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city."""
    CALLS.append(city)
    return "sunny"


def after_two_calls(context, results):
    return ToolsToFinalOutputResult(is_final_output=len(CALLS) >= 2, final_output=" ".join(CALLS))


async def main(base, kind):
    client = AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
    model = (OpenAIChatCompletionsModel if kind == "chat" else OpenAIResponsesModel)("chatenv-policy", client)
    agent = Agent(
        name="forecaster",
        instructions="Use the tool.",
        tools=[weather],
        model=model,
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=96),
        reset_tool_choice=False,  # forced on every turn; the run ends after two calls
        tool_use_behavior=after_two_calls,
    )
    result = await Runner.run(agent, "Weather in Paris?", max_turns=4)
    print(json.dumps({"calls": CALLS, "final": result.final_output}))


asyncio.run(main(*sys.argv[1:]))
'''

INSPECT = '''
import json, sys
from typing import Literal

from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate, use_tools, user_message
from inspect_ai.tool import ToolFunction, tool


@tool
def weather():
    async def execute(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city.

        Args:
            city: The city.
        """
        return "sunny"

    return execute


base, mode, log_dir = sys.argv[1:4]
if mode == "tool":  # two forced calls, each answered by the tool
    solver = [use_tools(weather(), tool_choice=ToolFunction("weather")), generate("single"), generate("single")]
else:  # two turns
    solver = [generate(), user_message("And 3 + 4?"), generate()]
task = Task(dataset=[Sample(input="What is 2 + 3?", target="5")], solver=solver, scorer=includes())
(log,) = eval(
    task, model="openai/gpt-5-mini", model_base_url=base, log_dir=log_dir, display="none", max_tokens=96,
    parallel_tool_calls=False,
)
sample = log.samples[0]
messages = [
    {"role": m.role, "calls": len(getattr(m, "tool_calls", None) or []),
     "kinds": [c.type for c in m.content] if isinstance(m.content, list) else ["text"]}
    for m in sample.messages
]
print(json.dumps({"status": log.status, "error": str(log.error) if log.error else None, "messages": messages}))
'''


@pytest.fixture(scope="module")
def tools_server(tiny_model, tokenizer):
    from chatenv.serve import CaptureServer
    from wrappers.policies import TransformersWrapper

    policy = TransformersWrapper(
        tiny_model,
        tokenizer=tokenizer,
        template=get_template("smollm2-tools"),
        input_mode="tokens",
        generate_kwargs={"max_new_tokens": 96},
    )
    with CaptureServer(policy, aliases=("gpt-5-mini",)) as srv:
        yield srv


def _session(server, session):
    data = httpx.get(f"{server.url}/v1/sessions/{session}").json()
    return data, [seg for seg in data["segments"] if seg["turns"]]


def _one_episode(server, session, turns):
    """The episode's one segment (beside inspect's reasoning probe, a chat of its own) holding all its turns."""
    data, segments = _session(server, session)
    probe = [s for s in segments if s["turns"][0]["prompt_messages"][-1]["content"] == "Please say 'hello, world'"]
    (segment,) = [s for s in segments if s not in probe]
    assert data["divergences"] == len(probe) and len(segment["turns"]) == turns
    return segment


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_openai_agents_with_required_single_calls(tools_server, kind):
    session = f"agents-{kind}"
    done = run_client("agents", AGENT, f"{tools_server.url}/s/{session}/v1", kind)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(out["calls"]) == 2 and set(out["calls"]) <= {"Paris", "Rome"}
    segment = _one_episode(tools_server, session, 2)
    assert [t["finish_reason"] for t in segment["turns"]] == ["tool_calls", "tool_calls"]
    assert all(len(t["reply"]["tool_calls"]) == 1 for t in segment["turns"])  # parallel_tool_calls=False


def test_inspect_openai_provider_forced_tool_calls(tools_server, tmp_path):
    done = run_client(
        "inspect", INSPECT, f"{tools_server.url}/s/inspect-tool/v1", "tool", str(tmp_path), env={"OPENAI_API_KEY": "x"}
    )
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["status"] == "success", out
    assert [(m["role"], m["calls"]) for m in out["messages"]] == [
        ("user", 0),
        ("assistant", 1),
        ("tool", 0),
        ("assistant", 1),
        ("tool", 0),
    ]
    _one_episode(tools_server, "inspect-tool", 2)


def test_inspect_two_turns_send_encrypted_reasoning_back(tmp_path):
    """Qwen3's template (reasoning, an ``enable_thinking`` switch) with a scripted reply that reasons first."""
    from chatenv.serve import CaptureServer

    pytest.importorskip("trl")
    ct = chat_tokenizer(corpus_tokenizer("qwen3"))
    tok = ct.tokenizer
    model = make_tiny_llama(0, vocab_size=len(tok)).eval()
    policy = HookedPolicy(model, tokenizer=tok, input_mode="tokens", generate_kwargs={"max_new_tokens": 40})
    ask = [{"role": "user", "content": "What is 2 + 3?"}]
    reply = {"role": "assistant", "reasoning_content": "2 plus 3 makes 5.", "content": "It is 5."}
    with CaptureServer(policy, aliases=("gpt-5-mini",)) as srv, scripted(ct.reply(ask, reply).ids.tolist()):
        done = run_client(
            "inspect", INSPECT, f"{srv.url}/s/inspect-r/v1", "chat", str(tmp_path), env={"OPENAI_API_KEY": "x"}
        )
        out = json.loads(done.stdout.strip().splitlines()[-1])
        segment = _one_episode(srv, "inspect-r", 2)
    assert out["status"] == "success", out
    assistants = [m for m in out["messages"] if m["role"] == "assistant"]
    assert len(assistants) == 2 and all("reasoning" in m["kinds"] for m in assistants)
    # the second turn's prompt holds the first reply with its reasoning, as recorded (sent back sealed)
    assert segment["turns"][1]["prompt_messages"][1]["reasoning_content"] == reply["reasoning_content"]
