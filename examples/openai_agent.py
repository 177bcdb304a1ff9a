"""An agent written only against the `openai` client, rolled out as RL episodes with token-exact trajectories.

The agent below knows nothing about chatenv: it gets an OpenAI base URL and the task's opening messages, and runs a
small tool loop (a calculator tool) with `openai.OpenAI(...).chat.completions.create`. `agent_rollout` serves the
policy behind the capture endpoint on loopback, runs the agent for a few Arithmetic-v0 problems, scores each final
answer with the task, and returns the same TensorDict as `chatenv.rollout` (ids, assistant masks, generation
log-probs, rewards), which `chatenv.episodes` turns into one row per episode.

Run: python examples/openai_agent.py  (about half a minute on 2 CPU cores with the embedded SmolLM2-135M)
"""

import argparse
import json

import openai
import torch

import chatenv
from chatenv.serve import AgentEnv, agent_rollout

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression such as '12 * (3 + 4)'.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}


def calculate(expression: str) -> str:
    allowed = set("0123456789+-*/(). ")
    if not set(expression) <= allowed:
        return "error: only numbers and + - * / ( ) are allowed"
    try:
        return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 (digits and operators only)
    except Exception as e:
        return f"error: {e}"


def agent(base_url: str, messages: list, max_steps: int = 3) -> str:
    """A plain OpenAI tool-calling loop: ask, run the calls it makes, send the results back, until it answers."""
    with openai.OpenAI(base_url=base_url, api_key="unused") as client:
        for _ in range(max_steps):
            reply = (
                client.chat.completions.create(
                    model="chatenv-policy", messages=messages, tools=[CALCULATOR], max_tokens=48, temperature=0.7
                )
                .choices[0]
                .message
            )
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                return reply.content or ""
            for call in reply.tool_calls:
                args = json.loads(call.function.arguments)
                result = calculate(str(args.get("expression", "")))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from wrappers.policies import TransformersWrapper

    policy = TransformersWrapper("default", input_mode="tokens", generate_kwargs={"max_new_tokens": 48, "seed": 0})
    envs = [AgentEnv(agent, "arithmetic") for _ in range(2)]  # two agents at a time: their requests share calls
    td = agent_rollout(envs, policy, episodes=args.episodes, seed=0)
    view = chatenv.episodes(td)
    print(f"collected {td.batch_size[0]} replies in {view.batch_size[0]} episodes")
    for e in range(view.batch_size[0]):
        mask = view["masks"].unpadded()[e]
        print(
            f"episode {e}: {int(view['num_turns'][e])} replies, {int(mask.sum())} sampled tokens of {len(mask)}, "
            f"reward {float(view['reward'][e]):.2f}"
        )
    lps = td["log_probs"].unpadded("response")
    print(f"mean generation log-prob per token: {torch.cat(lps).mean():.3f}")


if __name__ == "__main__":
    main()
