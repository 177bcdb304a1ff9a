"""verifiers 0.4.0's train client (``/inference/v1/generate``, the path prime-rl trains through), unmodified.

Run with verifiers 0.4.0's venv: ``python verifiers04_generate.py BASE_URL MODEL TOKENIZER_DIR N_EPISODES``. Each
episode runs two turns as verifiers' interception server does (``prepare_turn`` on the episode's trace, the train
client's ``get_response``, ``turn.commit``): the client renders the prompt with its renderer, bridges the second
turn onto the first turn's ids and posts ids to ``/inference/v1/generate``. The episodes run concurrently. Prints
one JSON line per episode: its trace id, its chat, and each turn's prompt ids, completion ids and log-probs.
"""

import asyncio
import json
import sys

from verifiers.v1 import graph
from verifiers.v1.clients.train import TrainClient
from verifiers.v1.configs.client import TrainClientConfig
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.trace import Trace
from verifiers.v1.types import SamplingConfig

QUESTIONS = ["Name a colour.", "Name a fruit.", "Name a city.", "Name a number.", "Name a tree.", "Say hi."]


async def episode(client, dialect, model, k):
    trace = Trace.model_construct()
    messages = [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]}]
    turns = []
    for follow_up in ("And another one?", None):
        body = {"model": model, "messages": messages}
        request = dialect.parse_request(body)
        turn = graph.prepare_turn(trace, request.messages, request.tools)
        sampling = SamplingConfig(max_tokens=40, seed=k)
        response = await client.get_response(dialect, body, sampling, session_id=trace.id, turn=turn)
        turn.commit(response)
        tokens = response.tokens
        turns.append(
            {
                "prompt_ids": list(tokens.prompt_ids),
                "completion_ids": list(tokens.completion_ids),
                "completion_logprobs": list(tokens.completion_logprobs),
                "bridged": tokens.bridged,
                "finish_reason": response.finish_reason,
            }
        )
        messages = [*messages, response.raw["choices"][0]["message"]]
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
    return {"trace": trace.id, "chat": messages, "turns": turns}


async def main(base_url, model, tokenizer_dir, n):
    config = TrainClientConfig(base_url=base_url, api_key_var="CHATENV_TEST_KEY", renderer_model_name=tokenizer_dir)
    client = TrainClient(config)
    try:
        done = await asyncio.gather(*(episode(client, ChatDialect(), model, k) for k in range(n)))
    finally:
        await client.close()
    for row in done:
        print(json.dumps(row))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
