"""Tool-calling agent: two episodes of CalculatorArithmetic-v0 with the embedded SmolLM2, printed turn by turn.

The env shows the model a ``calculator`` tool (its schema is in the system prompt, via the ``smollm2-tools``
template). A reply with tool calls is answered with ``tool`` messages; the first reply without calls is scored.
The rollout TensorDict counts calls per turn in ``("next", "tool_calls")`` / ``("next", "tool_errors")``, and
``chatenv.episodes`` sums them per episode.

Run: .venv/bin/python examples/tool_agent.py
"""

import json

import gymnasium as gym

import chatenv
from wrappers.policies import TransformersWrapper


def show(message: dict) -> str:
    """One message as a line: tool calls and tool results spelled out."""
    text = (message.get("content") or "").strip().replace("\n", " ")
    calls = [
        f"{c['function']['name']}({json.dumps(c['function']['arguments'])})" for c in message.get("tool_calls", [])
    ]
    if calls:
        text = f"{text} -> calls {', '.join(calls)}".strip()
    return f"  [{message['role']}] {text[:200]}"


def main() -> None:
    envs = [gym.make("chatenv/CalculatorArithmetic-v0", input_mode="tokens", max_turns=3) for _ in range(2)]
    policy = TransformersWrapper(
        "default", input_mode="tokens", generate_kwargs={"max_new_tokens": 40, "temperature": 0.7, "seed": 0}
    )
    td = chatenv.rollout(envs, policy, episodes=2, seed=0)  # one batched generate per round
    per_turn = zip(
        td["episode"].tolist(), td["next", "tool_calls"][:, 0].tolist(), td["next", "tool_errors"][:, 0].tolist()
    )
    for episode, calls, errors in per_turn:
        print(f"episode {episode}: a turn with {calls} tool calls ({errors} failed)")
    view = chatenv.episodes(td)
    for k, chat in enumerate(c for c in td["next", "chat"] if c):
        messages = json.loads(chat)
        print(f"\nepisode {k}: reward {view['reward'][k].item():.2f}, {view['num_turns'][k].item()} turns")
        for message in messages[1:]:  # the system prompt (with the tool schemas) is long: skip it
            print(show(message))
        print(f"tool calls: {view['tool_calls'][k].item()}, tool errors: {view['tool_errors'][k].item()}")
    for env in envs:
        env.close()
    scripted_turn()


def scripted_turn() -> None:
    """What a tool turn looks like, whatever the small model did: a reply with a call, as a message dict."""
    env = gym.make("chatenv/CalculatorArithmetic-v0", input_mode="history")
    obs, _ = env.reset(seed=0)
    expression = env.unwrapped.episode.state["expression"]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "calculator", "arguments": {"expression": expression}}],
    }
    obs, reward, terminated, truncated, info = env.step(call)
    result = obs[-1]["content"]
    obs, reward, terminated, truncated, info = env.step(f"<answer>{result}</answer>")
    print(f"\nscripted episode: {expression} -> calculator says {result}; reward {reward:.2f}")
    print(f"tool calls: {info['tool_calls']}, components: {info['reward_components']}")
    env.close()


if __name__ == "__main__":
    main()
