"""Request parameters the endpoint implements: top log-probs, the template's reasoning switches, include / store.

The policy is the real transformers wrapper on a tiny random Llama over SmolLM2's tokenizer with Qwen3's template
(TRL's corpus: it reads ``enable_thinking`` and writes reasoning), its sampling constrained to a scripted reply where
a test needs one (as in ``test_reasoning_replies``).
"""

import math

import httpx
import openai
import pytest
import torch
from conftest import make_tiny_llama
from helpers import corpus_tokenizer
from test_streaming import HookedPolicy, scripted

from chatenv import chat_tokenizer

pytest.importorskip("trl")
torch.set_num_threads(1)

MODEL = "chatenv-policy"
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
REPLY = {"role": "assistant", "reasoning_content": "2 plus 3 makes 5.", "content": "It is 5."}
K = 3


@pytest.fixture(scope="module")
def ct():
    return chat_tokenizer(corpus_tokenizer("qwen3"))


@pytest.fixture(scope="module")
def server(ct):
    from chatenv.serve import CaptureServer

    tok = ct.tokenizer
    model = make_tiny_llama(0, vocab_size=len(tok)).eval()
    policy = HookedPolicy(model, tokenizer=tok, input_mode="tokens", generate_kwargs={"max_new_tokens": 24})
    with CaptureServer(policy) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url(), api_key="x", max_retries=0, timeout=60) as c:
        yield c


def segments(server, session):
    return httpx.get(f"{server.url}/v1/sessions/{session}").json()["segments"]


def check_top(entries, k=K):
    for e in entries:
        top = [t.logprob for t in e.top_logprobs]
        assert len(top) == k and top == sorted(top, reverse=True) and e.logprob <= top[0] + 1e-6
        alternatives = {t.token: t.logprob for t in e.top_logprobs}
        if e.token in alternatives:  # the sampled token's own value where it is among them
            assert math.isclose(alternatives[e.token], e.logprob, abs_tol=1e-5)


def test_top_logprobs_plain_and_streamed(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, logprobs=True, top_logprobs=K)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    check_top(entries)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=6, logprobs=True, top_logprobs=K, stream=True
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(streamed) == 6  # all of them, with their alternatives (sent with the last chunk)
    check_top(streamed)
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs': true"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, top_logprobs=2)


def test_responses_output_text_logprobs(client):
    r = client.responses.create(
        model=MODEL,
        input="Hi",
        max_output_tokens=5,
        top_logprobs=K,
        include=["message.output_text.logprobs"],
        store=True,  # nothing is stored; the reply is the same
    )
    (message,) = [item for item in r.output if item.type == "message"]
    logprobs = message.content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens and all(len(e.top_logprobs) == K for e in logprobs)


def _prompt_text(server, ct, session):
    """The session's prompt as rendered (its one segment without the one generated token)."""
    (segment,) = segments(server, session)
    return ct.decode(segment["ids"][:-1])


def test_reasoning_switches_are_the_templates_own(client, server, ct):
    for session, extra in (
        ("think-off", {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}),
        ("effort-none", {"reasoning_effort": "none"}),
        ("effort-high", {"reasoning_effort": "high"}),
    ):
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=1, extra_headers={"X-Session-Id": session}, **extra
        )
    off = _prompt_text(server, ct, "think-off")
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" in off  # the template's own closed reasoning
    assert _prompt_text(server, ct, "effort-none") == off
    assert "<think>\n\n</think>" not in _prompt_text(server, ct, "effort-high")
    with pytest.raises(
        openai.BadRequestError, match=r"sets \['thinking'\], which the template .* reads \['enable_thinking'\]"
    ):
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=1, extra_body={"chat_template_kwargs": {"thinking": True}}
        )
    with pytest.raises(openai.BadRequestError, match="'reasoning_effort' must be one of"):
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, reasoning_effort="huge")


def test_encrypted_reasoning_carries_the_reasoning_back(client, server, ct):
    ids = ct.reply(ASK, REPLY).ids.tolist()
    headers = {"X-Session-Id": "sealed"}
    with scripted(ids):
        first = client.responses.create(
            model=MODEL,
            input=ASK,
            store=False,
            include=["reasoning.encrypted_content"],
            reasoning={"effort": "medium", "summary": "auto"},
            extra_headers=headers,
        )
    (thought,) = [item for item in first.output if item.type == "reasoning"]
    assert thought.encrypted_content and thought.content[0].text == REPLY["reasoning_content"]
    # a store=false client sends back only what it keeps: the sealed blob, no reasoning text
    back = {"type": "reasoning", "id": thought.id, "summary": [], "encrypted_content": thought.encrypted_content}
    message = next(item for item in first.output if item.type == "message").model_dump(exclude_none=True)
    follow = [*ASK, back, message, {"role": "user", "content": "And 3 + 4?"}]
    again = {"reasoning": {"effort": "medium", "summary": "auto"}, "extra_headers": headers}  # the same settings
    client.responses.create(model=MODEL, input=follow, max_output_tokens=2, **again)
    assert len(segments(server, "sealed")) == 1  # the recorded reply continued, never re-rendered
    foreign = {**back, "encrypted_content": "gAAAAB-not-ours"}
    with pytest.raises(openai.BadRequestError, match="encrypted_content.*not returned by this endpoint"):
        client.responses.create(model=MODEL, input=[*ASK, foreign, message, follow[-1]], max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="cannot be included here"):
        client.responses.create(model=MODEL, input="Hi", include=["file_search_call.results"])
