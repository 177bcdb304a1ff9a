"""Replies of templates that write reasoning: the reasoning apart from the content in every API dialect.

The policy is the real transformers wrapper on a tiny random Llama over SmolLM2's tokenizer with Qwen3's template
(from TRL's corpus, markers added), its sampling constrained to the ids the template writes for a reply with
reasoning (as constrained decoding does). Each dialect returns the reasoning in its own place (chat completions
``reasoning_content``, a Messages ``thinking`` block, a Responses ``reasoning`` item), streams it before the content,
and a client that sends the reply back as returned continues the one recorded segment.
"""

import anthropic
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


@pytest.fixture(scope="module")
def ct():
    return chat_tokenizer(corpus_tokenizer("qwen3"))


@pytest.fixture(scope="module")
def server(ct):
    from chatenv.serve import CaptureServer

    tok = ct.tokenizer
    model = make_tiny_llama(0, vocab_size=len(tok)).eval()
    policy = HookedPolicy(model, tokenizer=tok, input_mode="tokens", generate_kwargs={"max_new_tokens": 40})
    with CaptureServer(policy) as srv:
        yield srv


@pytest.fixture(scope="module")
def reply_ids(ct):
    ids = ct.reply(ASK, REPLY).ids.tolist()
    assert "<think>" in ct.decode(ids) and ct.decode(ids[-1:]) == "<|im_end|>"
    return ids


def segments(server, session):
    return httpx.get(f"{server.url}/v1/sessions/{session}").json()["segments"]


def test_chat_completions_return_and_stream_reasoning_content(server, reply_ids):
    with openai.OpenAI(base_url=server.base_url(), api_key="x", max_retries=0) as client, scripted(reply_ids):
        plain = client.chat.completions.create(model=MODEL, messages=ASK, extra_headers={"X-Session-Id": "chat-r"})
        message = plain.choices[0].message
        assert (message.content, message.model_extra["reasoning_content"]) == (
            REPLY["content"],
            REPLY["reasoning_content"],
        )
        chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        kinds = [
            k
            for d in deltas
            for k in ("reasoning_content", "content")
            if (d.model_extra or {}).get(k) or (k == "content" and d.content)
        ]
        assert kinds.index("content") > kinds.index("reasoning_content")  # the reasoning first
        assert (
            "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == REPLY["reasoning_content"]
        )
        assert "".join(d.content or "" for d in deltas) == REPLY["content"]
        # the reply sent back as returned (reasoning included) continues the segment; dropped, it is restored
        again = [*ASK, message.model_dump(exclude_none=True), {"role": "user", "content": "And 3 + 4?"}]
        second = client.chat.completions.create(model=MODEL, messages=again, extra_headers={"X-Session-Id": "chat-r"})
        bare = {"role": "assistant", "content": second.choices[0].message.content}  # the agent kept no reasoning
        dropped = [*again, bare, {"role": "user", "content": "And 4 + 5?"}]
        client.chat.completions.create(model=MODEL, messages=dropped, extra_headers={"X-Session-Id": "chat-r"})
    assert len(segments(server, "chat-r")) == 1
    assert httpx.get(f"{server.url}/v1/sessions/chat-r").json()["restored"] == 1


def test_responses_return_and_stream_a_reasoning_item(server, reply_ids):
    with openai.OpenAI(base_url=server.base_url(), api_key="x", max_retries=0) as client, scripted(reply_ids):
        plain = client.responses.create(model=MODEL, input=ASK, extra_headers={"X-Session-Id": "resp-r"})
        kinds = [item.type for item in plain.output]
        assert kinds == ["reasoning", "message"]
        assert plain.output[0].content[0].text == REPLY["reasoning_content"] and plain.output_text == REPLY["content"]
        reasoning_tokens = plain.usage.output_tokens_details.reasoning_tokens
        assert 0 < reasoning_tokens < plain.usage.output_tokens
        with client.responses.stream(model=MODEL, input=ASK) as stream:
            events = list(stream)
            final = stream.get_final_response()
        types = [e.type for e in events]
        first_text = types.index("response.output_text.delta")
        assert types.index("response.reasoning_text.delta") < first_text
        assert types.index("response.output_item.done") < first_text  # the reasoning item ended before the text
        streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert streamed == REPLY["reasoning_content"]
        assert [i.type for i in final.output] == kinds and final.output_text == REPLY["content"]
        assert [i.id for i in final.output] == [e.item.id for e in events if e.type == "response.output_item.done"]
        # the output sent back as input continues the segment
        follow = [*ASK, *[i.model_dump(exclude_none=True) for i in plain.output], {"role": "user", "content": "More?"}]
        client.responses.create(model=MODEL, input=follow, extra_headers={"X-Session-Id": "resp-r"})
    assert len(segments(server, "resp-r")) == 1


def test_messages_return_and_stream_a_thinking_block(server, reply_ids):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as claude, scripted(reply_ids):
        plain = claude.messages.create(model=MODEL, max_tokens=40, messages=ASK, metadata={"user_id": "msg-r"})
        assert [b.type for b in plain.content] == ["thinking", "text"]
        assert plain.content[0].thinking == REPLY["reasoning_content"] and plain.content[1].text == REPLY["content"]
        with claude.messages.stream(model=MODEL, max_tokens=40, messages=ASK) as stream:
            events = list(stream)
            final = stream.get_final_message()
        deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
        assert deltas.index("text_delta") > deltas.index("thinking_delta")
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in plain.content]
        history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in plain.content]}]
        claude.messages.create(
            model=MODEL,
            max_tokens=40,
            messages=[*history, {"role": "user", "content": "More?"}],
            metadata={"user_id": "msg-r"},
        )
    assert len(segments(server, "msg-r")) == 1
