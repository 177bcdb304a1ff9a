"""verifiers 0.3.1's token client (the path prime-rl trains through) on a two-turn environment, unmodified.

Run with verifiers 0.3.1's venv: ``python verifiers03_tokens.py BASE_URL MODEL N_EPISODES MAX_CONCURRENT``. Each
episode is a user question, the model's reply, one more user message and the model's second reply; turn 1 goes to
``/v1/chat/completions`` (``return_token_ids``), turn 2 to ``/v1/chat/completions/tokens`` with the ids verifiers
stitched (its ``/tokenize`` bridge). Prints one JSON line per episode: its chat, its turns' token ids and log-probs.
"""

import asyncio
import json
import logging
import sys

import verifiers.legacy as vf
from datasets import Dataset
from openai import AsyncOpenAI
from verifiers.legacy.clients.openai_chat_completions_token_client import OpenAIChatCompletionsTokenClient


class Fallbacks(logging.Handler):
    """Counts the token client's fallbacks to message-based requests (its token route was not used)."""

    count = 0

    def emit(self, record):
        if "MITO" in record.getMessage() or "falling back" in record.getMessage():
            Fallbacks.count += 1


class TwoTurns(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "And another one?"}]


def main(base_url: str, model: str, n: int, max_concurrent: int) -> None:
    questions = ["Name a colour.", "Name a fruit.", "Name a city.", "Name a number.", "Name a tree.", "Say hi."]
    data = Dataset.from_list([{"question": questions[k % len(questions)], "answer": ""} for k in range(n)])
    logging.getLogger("verifiers").addHandler(Fallbacks())
    logging.getLogger("verifiers").setLevel(logging.DEBUG)
    env = TwoTurns(dataset=data, max_turns=2, rubric=vf.Rubric())
    client = OpenAIChatCompletionsTokenClient(AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0))
    inputs = [
        {"prompt": [{"role": "user", "content": row["question"]}], "answer": "", "example_id": k}
        for k, row in enumerate(data)
    ]
    out = asyncio.run(
        env.generate(
            inputs,
            client=client,
            model=model,
            sampling_args={"max_tokens": 12, "seed": 3},
            max_concurrent=max_concurrent,
            on_progress=[],
            state_columns=["trajectory"],
        )
    )
    for row in out["outputs"]:
        steps = row["trajectory"]
        print(
            json.dumps(
                {
                    "error": row.get("error"),
                    "chat": [
                        m if isinstance(m, dict) else m.model_dump(exclude_none=True)
                        for m in [*row["prompt"], *row["completion"]]
                    ],
                    "turns": [
                        {k: s["tokens"][k] for k in ("prompt_ids", "completion_ids", "completion_logprobs")}
                        if s["tokens"]
                        else None
                        for s in steps
                    ],
                },
                default=str,
            )
        )
    print(json.dumps({"fallbacks": Fallbacks.count}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
