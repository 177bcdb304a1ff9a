"""Streaming on the capture endpoint as the policy generates, driven by the real openai and anthropic clients.

The policy is the real TransformersWrapper on the tiny random Llama, subclassed with two hooks: a gate that holds a
streamed generation after its n-th token (or fails there), so a test can see tokens reach the client while the
policy is still generating; and a script that constrains sampling to given ids (a logits processor, as constrained
decoding does), so the model writes a tool call. Greedy replies are deterministic, so a streamed reply can be
compared with the same request answered whole in another session.
"""

import contextlib
import math
import threading
import time

import anthropic
import httpx
import openai
import pytest
import torch
from test_serve import MODEL, TOOLS
from transformers import LogitsProcessor

from chatenv.templates import get_template
from chatenv.tokenization import chat_tokenizer
from wrappers.policies import TransformersWrapper

torch.set_num_threads(1)

WEATHER = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
ASK = [{"role": "user", "content": "Tell me about the weather."}]
#: greedy: the same prompt gives the same reply (the policy's own settings make it at least 8 tokens long)
GREEDY = {"model": MODEL, "messages": ASK, "temperature": 0}
HELD_AFTER = 4  # tokens a gated generation hands on before it waits


class Gate:
    """Holds a streamed generation after its ``after``-th token until :meth:`open` (or fails there: ``fail``)."""

    def __init__(self, after=HELD_AFTER, fail=False):
        self.after, self.fail = after, fail
        self.opened = threading.Event()
        self.finished = threading.Event()  # the policy's generation ended (either way)
        self.streamed = False  # the policy was asked to hand tokens on as it generates
        self.state = "generating"

    def wrap(self, on_tokens):
        seen = [0]

        def gated(row, ids, log_probs):
            on_tokens(row, ids, log_probs)
            seen[0] += len(ids)
            if seen[0] == self.after:
                if self.fail:
                    self.state = "failed"
                    raise RuntimeError("the accelerator fell over")
                self.state = "holding"
                self.state = "released" if self.opened.wait(60) else "timed out"

        return gated

    def open(self):
        self.opened.set()


class Scripted(LogitsProcessor):
    """Every row's next token is the script's next id (the model still runs; its choice is constrained)."""

    def __init__(self, ids):
        self.ids, self.start = list(ids), None

    def __call__(self, input_ids, scores):
        self.start = input_ids.shape[1] if self.start is None else self.start
        step = min(input_ids.shape[1] - self.start, len(self.ids) - 1)
        forced = torch.full_like(scores, -math.inf)
        forced[:, self.ids[step]] = 0.0
        return forced


class HookedPolicy(TransformersWrapper):
    """The real transformers policy with the tests' gate and script (class attributes: the per-request versions
    the endpoint makes with ``get_new_version`` are of this class and share them)."""

    gate: Gate | None = None
    script: list[int] | None = None

    def _generate_ids(self, prompts, settings, on_tokens=None):
        gate = HookedPolicy.gate
        if gate is None:
            return super()._generate_ids(prompts, settings, on_tokens)
        gate.streamed = on_tokens is not None
        try:
            return super()._generate_ids(prompts, settings, on_tokens and gate.wrap(on_tokens))
        finally:
            gate.finished.set()

    def _generation_kwargs(self, s, *args):
        kwargs = super()._generation_kwargs(s, *args)
        if HookedPolicy.script is not None:
            kwargs["logits_processor"].append(Scripted(HookedPolicy.script))
        return kwargs


@contextlib.contextmanager
def gated(after=HELD_AFTER, fail=False):
    gate = HookedPolicy.gate = Gate(after, fail)
    try:
        yield gate
    finally:
        gate.open()
        HookedPolicy.gate = None


@contextlib.contextmanager
def scripted(ids):
    HookedPolicy.script = list(ids)
    try:
        yield
    finally:
        HookedPolicy.script = None


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    from chatenv.serve import CaptureServer

    policy = HookedPolicy(
        tiny_model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate_kwargs={"max_new_tokens": 40, "min_new_tokens": 8},
    )
    with CaptureServer(policy) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url(), api_key="x", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=30) as c:
        yield c


def sid(name):
    return {"X-Session-Id": name}


def snapshot(server, session):
    r = httpx.get(f"{server.url}/v1/sessions/{session}")
    assert r.status_code == 200, r.text
    return r.json()


def assert_same_recording(server, streamed, plain):
    """Two sessions of one request each, streamed and not, recorded the same ids, mask and log-probs."""
    a, b = snapshot(server, streamed), snapshot(server, plain)
    assert a["requests"] == b["requests"] == 1 and len(a["segments"]) == len(b["segments"]) == 1
    for key in ("ids", "assistant_mask", "log_probs"):
        assert a["segments"][0][key] == b["segments"][0][key], key
    assert [t["length"] for t in a["segments"][0]["turns"]] == [t["length"] for t in b["segments"][0]["turns"]]


def arrived_while_held(gate):
    """Tokens reached the client while the policy streamed and could not have finished (the gate was never opened)."""
    held = gate.state in ("generating", "holding") and not gate.opened.is_set()
    return gate.streamed and held and not gate.finished.is_set()


def content_of(chunks, index=0):
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)


def calls_of(chunks):
    return [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]


def wait_for(condition, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------ tokens leave as generated


def test_chat_chunks_leave_while_the_policy_generates_and_join_into_the_plain_reply(client, server):
    asked = {**GREEDY, "max_tokens": 40, "extra_body": {"min_tokens": 40}, "logprobs": True}
    with gated() as gate:
        stream = client.chat.completions.create(
            **asked, stream=True, stream_options={"include_usage": True}, extra_headers=sid("chat-streamed")
        )
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if content_of(chunks):
                break
        assert arrived_while_held(gate), gate.state
        early = content_of(chunks)
        gate.open()
        chunks += list(stream)
    plain = client.chat.completions.create(**asked, extra_headers=sid("chat-plain"))
    choice = plain.choices[0]
    assert content_of(chunks) == choice.message.content and len(early) < len(choice.message.content)
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage == plain.usage and not chunks[-1].choices
    entries = [
        e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert entries == [e.model_dump() for e in choice.logprobs.content] and len(entries) == 40
    assert_same_recording(server, "chat-streamed", "chat-plain")


def test_messages_text_leaves_while_the_policy_generates(claude, server):
    asked = {"model": MODEL, "max_tokens": 30, "messages": ASK, "extra_body": {"temperature": 0}}
    with gated() as gate:
        with claude.messages.stream(**asked, extra_headers=sid("msg-streamed")) as s:
            texts = iter(s.text_stream)
            first = next(texts)
            assert first and arrived_while_held(gate), gate.state
            gate.open()
            rest = list(texts)
            final = s.get_final_message()
    plain = claude.messages.create(**asked, extra_headers=sid("msg-plain"))
    assert first + "".join(rest) == final.content[0].text == plain.content[0].text
    assert final.stop_reason == plain.stop_reason == "end_turn" and final.usage == plain.usage
    assert_same_recording(server, "msg-streamed", "msg-plain")


def test_responses_text_deltas_leave_before_the_response_completes(client, server):
    asked = {"model": MODEL, "input": "Tell me about the weather.", "temperature": 0, "max_output_tokens": 30}
    with gated() as gate:
        stream = client.responses.create(**asked, stream=True, extra_headers=sid("resp-streamed"))
        events = []
        for event in stream:
            events.append(event)
            if event.type == "response.output_text.delta":
                break
        assert arrived_while_held(gate), gate.state
        assert not any(e.type == "response.completed" for e in events)
        gate.open()
        events += list(stream)
    plain = client.responses.create(**asked, extra_headers=sid("resp-plain"))
    done = events[-1]
    assert done.type == "response.completed" and done.response.output_text == plain.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert done.response.usage == plain.usage and done.response.status == plain.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert_same_recording(server, "resp-streamed", "resp-plain")


# ------------------------------------------------------------------------------------------ hang-ups and failures


def test_a_client_that_hangs_up_mid_stream_leaves_its_session_as_it_was(client, server):
    client.chat.completions.create(**GREEDY, max_tokens=10, extra_headers=sid("hangup"))
    held = snapshot(server, "hangup")
    session = server.store.get("hangup", create=False)
    with gated() as gate:
        stream = client.chat.completions.create(
            **GREEDY, max_tokens=40, extra_body={"min_tokens": 40}, stream=True, extra_headers=sid("hangup")
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        assert arrived_while_held(gate)
        stream.close()
        wait_for(lambda: session.pending == 0, "the server to cancel the request")  # while the policy is held
        gate.open()
        assert gate.finished.wait(30)
    assert gate.state == "released"  # the policy generated the whole reply: it was not recorded
    assert snapshot(server, "hangup") == held
    r = client.chat.completions.create(**GREEDY, max_tokens=10, extra_headers=sid("hangup"))
    assert r.choices[0].message.content and snapshot(server, "hangup")["requests"] == 2


def test_a_failure_after_tokens_were_streamed_reaches_the_client_and_changes_nothing(client, claude, server):
    client.chat.completions.create(**GREEDY, max_tokens=10, extra_headers=sid("broken"))
    held = snapshot(server, "broken")
    with gated(fail=True) as gate:
        stream = client.chat.completions.create(**GREEDY, max_tokens=40, stream=True, extra_headers=sid("broken"))
        chunks = []
        with pytest.raises(openai.APIError, match="the policy failed: RuntimeError: the accelerator fell over"):
            for chunk in stream:
                chunks.append(chunk)
        assert content_of(chunks) and gate.state == "failed"  # some text was sent before the failure
    assert snapshot(server, "broken") == held
    with gated(fail=True) as gate:
        with claude.messages.stream(model=MODEL, max_tokens=30, messages=ASK, extra_headers=sid("broken")) as s:
            texts = []
            with pytest.raises(anthropic.APIError, match="the policy failed"):
                for text in s.text_stream:
                    texts.append(text)
        assert "".join(texts) and gate.state == "failed"
    with gated(fail=True):
        events = list(client.responses.create(model=MODEL, input="Hi", stream=True, extra_headers=sid("broken")))
    assert events[-1].type == "error" and "the policy failed" in events[-1].message
    assert not any(e.type == "response.completed" for e in events)
    assert snapshot(server, "broken") == held
    r = client.chat.completions.create(**GREEDY, max_tokens=10, stream=True, extra_headers=sid("broken"))
    assert content_of(list(r)) and snapshot(server, "broken")["requests"] == 2  # the server serves on


def test_a_refusal_before_generating_is_an_http_error_not_a_stream(client, claude, server):
    chat, long = server.url + "/v1/chat/completions", [{"role": "user", "content": "word " * 1100}]
    cases = [
        (chat, {"model": "gpt-9", "messages": ASK}, 404),
        (chat, {"model": MODEL, "messages": long}, 400),
        (chat, {"model": MODEL, "messages": ASK, "max_tokens": 5000}, 400),
        (server.url + "/v1/messages", {"model": "claude-9", "max_tokens": 8, "messages": ASK}, 404),
        (server.url + "/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": long}, 400),
        (server.url + "/v1/responses", {"model": "gpt-9", "input": "Hi"}, 404),
        (server.url + "/v1/responses", {"model": MODEL, "input": "word " * 1100}, 400),
    ]
    for url, body, status in cases:
        r = httpx.post(url, json={**body, "stream": True}, headers=sid("refused-stream"))
        assert r.status_code == status and r.headers["content-type"] == "application/json", (body, r.text[:200])
        assert r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=ASK, stream=True)
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|maximum context length"):
        client.chat.completions.create(model=MODEL, messages=long, stream=True)
    with pytest.raises(anthropic.NotFoundError):
        with claude.messages.stream(model="claude-9", max_tokens=8, messages=ASK) as s:
            list(s.text_stream)
    # refused by the policy (the transformers backend has no presence penalty): the same answer as without stream
    body = {"model": MODEL, "messages": ASK, "presence_penalty": 0.5}
    plain = httpx.post(chat, json=body, headers=sid("refused-stream"))
    streamed = httpx.post(chat, json={**body, "stream": True}, headers=sid("refused-stream"))
    assert plain.status_code == streamed.status_code == 400 and streamed.json() == plain.json()
    assert "presence_penalty" in plain.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/sessions/refused-stream").status_code == 404  # no session was made


# ------------------------------------------------------------------------------------------ several replies, tools


def test_two_streamed_choices_each_join_into_their_plain_reply(client):
    asked = {"model": MODEL, "messages": ASK, "n": 2, "seed": 5, "max_tokens": 12, "logprobs": True}
    chunks = list(client.chat.completions.create(**asked, stream=True, extra_headers=sid("two-streamed")))
    plain = client.chat.completions.create(**asked, extra_headers=sid("two-plain"))
    with_text = {c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.content}
    assert with_text == {0, 1} and plain.choices[0].message.content != plain.choices[1].message.content
    for k, choice in enumerate(plain.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == k]
        assert content_of(chunks, k) == choice.message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        lps = [e.logprob for c in mine if c.logprobs for e in c.logprobs.content]
        assert lps == [e.logprob for e in choice.logprobs.content]


def test_a_streamed_tool_call_sends_its_content_never_its_markup(client, claude, server, tokenizer):
    ct = chat_tokenizer(tokenizer, get_template("smollm2-tools"))
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    reply = {"role": "assistant", "content": "Checking.", "tool_calls": [call]}
    ids = ct.reply(ASK, reply).ids.tolist()
    marked = next(k for k in range(len(ids)) if "<tool_call>\n{" in ct.decode(ids[:k]))
    asked = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 40}
    with scripted(ids):
        with gated(after=marked) as gate:  # held once the markup has been generated: the content is out already
            stream = client.chat.completions.create(**asked, stream=True, extra_headers=sid("tool-streamed"))
            chunks = []
            for chunk in stream:
                chunks.append(chunk)
                if content_of(chunks) == "Checking.":
                    break
            assert arrived_while_held(gate)  # all the content is out; the call's markup is not
            gate.open()
            chunks += list(stream)
        plain = client.chat.completions.create(**asked, extra_headers=sid("tool-plain"))
        with claude.messages.stream(model=MODEL, max_tokens=40, messages=ASK, tools=WEATHER) as s:
            texts = list(s.text_stream)
            final = s.get_final_message()
        events = list(client.responses.create(model=MODEL, input=ASK, tools=RESPONSES_TOOLS, stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == plain.choices[0].message.content == "Checking."
    assert not any("<" in p or "tool_call" in p for p in pieces)
    calls = calls_of(chunks)
    expected = plain.choices[0].message.tool_calls
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [
        (tc.function.name, tc.function.arguments) for tc in expected
    ]
    assert expected[0].function.arguments == '{"city": "Paris"}'
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    assert_same_recording(server, "tool-streamed", "tool-plain")
    assert "".join(texts) == "Checking." and [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "Checking." and not any("<" in d for d in deltas)
    output = events[-1].response.output
    assert [item.type for item in output] == ["message", "function_call"] and output[1].arguments == '{"city": "Paris"}'
    # a reply that only calls: no text at all
    only = ct.reply(ASK, {"role": "assistant", "content": "", "tool_calls": [call]}).ids.tolist()
    with scripted(only):
        chunks = list(client.chat.completions.create(**asked, stream=True))
    assert content_of(chunks) == "" and [tc.function.name for tc in calls_of(chunks)] == ["get_weather"]
