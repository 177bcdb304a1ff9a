"""Concurrent episodes through one session URL: each continues its own segment, whole and token-exact.

Harnesses that cannot set a header per sample (inspect-ai, verifiers with its default concurrency) send every
episode through one base URL at once. The requests of one session run concurrently (batched together), and each
continues the open segment its messages extend; the rule for several candidates and the forks are checked here.
"""

import asyncio
import json
import math

import openai
import pytest
import torch
from helpers import reference_log_probs

from chatenv.serve import CaptureServer, CaptureService
from chatenv.tokenization import chat_tokenizer

torch.set_num_threads(1)

MODEL = "chatenv-policy"


@pytest.fixture(scope="module")
def policy(tiny_model, tokenizer):
    from wrappers.policies import TransformersWrapper

    settings = {"max_new_tokens": 6}
    return TransformersWrapper(tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=settings)


@pytest.fixture(scope="module")
def server(policy):
    # a long batch wait: requests sent together reach the policy in one call, whatever the machine's load
    with CaptureServer(CaptureService(policy, batch_wait=1.0)) as srv:
        yield srv


def _dump(message):
    return message.model_dump(exclude_none=True)


async def _episode(client, opening, turns):
    """A multi-turn episode as agents run it: the whole history sent back each turn, with a new user message.

    Unseeded, as harnesses sample (a seeded request gets a policy call of its own).
    """
    messages = [{"role": "user", "content": opening}]
    for turn in range(turns):
        r = await client.chat.completions.create(model=MODEL, messages=messages, temperature=1)
        messages += [_dump(r.choices[0].message), {"role": "user", "content": f"Turn {turn + 2}?"}]
    return messages[:-1]


async def _episodes(base_url, openings, turns=2):
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        return await asyncio.gather(*(_episode(client, o, turns) for o in openings))


def _check_whole(segment, chat, tokenizer, tiny_model, turns):
    """One segment is one whole episode: its text = a render of its chat, the mask = the sampled replies (their ids
    kept verbatim: a re-render of random replies' text may tokenize differently), log-probs = a reference pass."""
    ct = chat_tokenizer(tokenizer)
    assert len(segment["turns"]) == turns
    text, render = tokenizer.decode(segment["ids"]), tokenizer.decode(ct.encode(chat).ids)
    # the segment ends where the last reply stopped (its end-of-turn sampled, or cut by its budget before it)
    assert render.startswith(text) and render[len(text) :] in ("", "\n", "<|im_end|>\n")
    for turn, reply in zip(segment["turns"], [m for m in chat if m["role"] == "assistant"]):
        assert tokenizer.decode(segment["ids"][turn["start"] : turn["start"] + turn["length"]]).startswith(
            reply["content"]
        )
    mask = torch.tensor(segment["assistant_mask"])
    assert int(mask.sum()) == sum(t["length"] for t in segment["turns"])
    got = torch.tensor([math.nan if v is None else v for v in segment["log_probs"]])
    ref = reference_log_probs(tiny_model, segment["ids"])
    torch.testing.assert_close(got[mask], ref[mask], atol=1e-4, rtol=0)


def test_concurrent_episodes_in_one_session_give_one_whole_segment_each(server, tokenizer, tiny_model):
    calls = server.service.runner.calls
    openings = ["What is 2+3?", "Name a colour.", "Say hi."]
    chats = asyncio.run(_episodes(server.base_url("many"), openings))
    data = server.session("many")
    assert data["requests"] == 6 and len(data["segments"]) == 3 and data["forks"] == 0
    # requests of one session ran together: each round of three reached the policy in one call
    assert server.service.runner.calls - calls == 2
    by_opening = {s["messages"][0]["content"]: s for s in data["segments"]}
    for chat in chats:
        _check_whole(by_opening[chat[0]["content"]], chat, tokenizer, tiny_model, turns=2)


def test_a_group_of_identical_prompts_gives_one_segment_per_episode(server, tokenizer, tiny_model):
    chats = asyncio.run(_episodes(server.base_url("group"), ["Pick a number."] * 4))
    data = server.session("group")
    assert len(data["segments"]) == 4 and data["forks"] == 0
    replies = sorted(json.dumps(s["messages"][1:], sort_keys=True) for s in data["segments"])
    assert replies == sorted(json.dumps(c[1:], sort_keys=True) for c in chats)  # each episode in one segment
    for chat in chats:
        seg = next(s for s in data["segments"] if s["messages"] == chat)
        _check_whole(seg, chat, tokenizer, tiny_model, turns=2)


def test_two_replies_continued_at_once_fork_the_segment(server, tokenizer, tiny_model):
    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url("fork"), api_key="x", max_retries=0) as client:
            first = [{"role": "user", "content": "Two ideas?"}]
            r = await client.chat.completions.create(model=MODEL, messages=first, n=2, seed=1, temperature=1)
            follow = [[*first, _dump(c.message), {"role": "user", "content": "Why?"}] for c in r.choices]
            done = await asyncio.gather(*(client.chat.completions.create(model=MODEL, messages=m) for m in follow))
            return [[*m, _dump(d.choices[0].message)] for m, d in zip(follow, done)]

    chats = asyncio.run(run())
    data = server.session("fork")
    assert len(data["segments"]) == 2 and data["forks"] == 1 and data["requests"] == 3
    assert data["divergences"] == 0 and data["discarded_choices"] == 0  # both replies continued, each whole
    for chat in chats:
        seg = next(s for s in data["segments"] if s["messages"][:2] == chat[:2])
        _check_whole(seg, chat, tokenizer, tiny_model, turns=2)


def test_a_request_continues_the_segment_that_covers_most_of_it(server):
    base = server.base_url("rule")
    with openai.OpenAI(base_url=base, api_key="x", max_retries=0) as client:
        first = [{"role": "user", "content": "Count."}]
        r1 = client.chat.completions.create(model=MODEL, messages=first, temperature=0)
        longer = [*first, _dump(r1.choices[0].message), {"role": "user", "content": "More."}]
        r2 = client.chat.completions.create(model=MODEL, messages=longer, temperature=0)
        again = client.chat.completions.create(model=MODEL, messages=first, temperature=0)  # a new episode, same start
        assert again.choices[0].message.content == r1.choices[0].message.content  # greedy: the same first reply
        # extends both the first segment (through its 2nd turn) and the second (through its 1st reply): the first
        # covers more of it, so it continues there
        third = [*longer, _dump(r2.choices[0].message), {"role": "user", "content": "Done?"}]
        client.chat.completions.create(model=MODEL, messages=third, temperature=0)
    data = server.session("rule")
    assert [len(s["turns"]) for s in data["segments"]] == [3, 1]
