"""Anthropic's Messages API on the capture endpoint, driven by the real anthropic client on loopback."""

import math
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest
import torch
from helpers import reference_log_probs
from test_serve import MODEL, TOOLS, ScriptedPolicy

from chatenv.serve import CaptureServer
from chatenv.serve.anthropic.output import EventWriter, message_body
from chatenv.serve.anthropic.request import convert_messages, parse_messages_request
from chatenv.serve.chat.request import parse_request
from chatenv.serve.engine import Generated
from chatenv.serve.replies import make_choice
from chatenv.tokenization import chat_tokenizer

torch.set_num_threads(1)

WEATHER = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


@pytest.fixture(scope="module")
def policy(tiny_model, tokenizer):
    from wrappers.policies import TransformersWrapper

    return TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 12}
    )


@pytest.fixture(scope="module")
def server(policy):
    with CaptureServer(policy) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0) as c:
        yield c


def _blocks(message):
    return [b.model_dump() for b in message.content]


def test_a_request_maps_to_the_chat_completions_request():
    body = {
        "model": MODEL,
        "max_tokens": 7,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "tools": WEATHER,
        "temperature": 0.5,
        "top_k": 5,
        "stop_sequences": ["\n\n"],
        "metadata": {"user_id": "u1"},
    }
    got = parse_messages_request(body)
    same = parse_request(
        {
            "model": MODEL,
            "max_tokens": 7,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "tools": TOOLS,
            "temperature": 0.5,
            "top_k": 5,
            "stop": ["\n\n"],
            "user": "u1",
        }
    )
    assert got == same


def test_blocks_map_to_chatenv_messages():
    assistant = [
        {"type": "thinking", "thinking": "Paris, so", "signature": "sig"},
        {"type": "text", "text": "Checking.", "citations": None},
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}, "caller": None},
    ]
    user = [
        {"type": "tool_result", "tool_use_id": "t1", "content": "sunny", "is_error": False},
        {"type": "text", "text": "And ", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Oslo?"},
    ]
    got = convert_messages(
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": assistant},
            {"role": "user", "content": user},
        ],
        system="Be brief.",
    )
    call = {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert got == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Paris, so", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
        {"role": "user", "content": "And Oslo?"},
    ]


def test_a_failed_tool_result_says_so_and_cached_tools_are_accepted():
    user = [{"type": "tool_result", "tool_use_id": "t1", "content": "no such city", "is_error": True}]
    got = convert_messages([{"role": "user", "content": "Weather?"}, {"role": "user", "content": user}])
    assert got[-1] == {"role": "tool", "tool_call_id": "t1", "content": "Error: no such city"}
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [
            {
                "name": "get_weather",
                "input_schema": {"type": "object", "properties": {}},
                "cache_control": {"type": "ephemeral"},
            }
        ],
    }
    assert parse_messages_request(body).tools[0]["function"]["name"] == "get_weather"


def test_round_trip_and_two_turns_make_one_token_exact_segment(client, server, tiny_model):
    messages = [{"role": "user", "content": "Count to three."}]
    first = client.messages.create(model=MODEL, max_tokens=10, messages=messages, metadata={"user_id": "two"})
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.stop_reason in ("end_turn", "max_tokens") and first.model == MODEL
    messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": "Again."}]
    with client.messages.stream(model=MODEL, max_tokens=10, messages=messages, metadata={"user_id": "two"}) as s:
        texts = list(s.text_stream)
        second = s.get_final_message()
    assert "".join(texts) == "".join(b.text for b in second.content if b.type == "text")
    data = server.session("two")
    assert data["divergences"] == 0 and len(data["segments"]) == 1 and data["requests"] == 2
    seg = data["segments"][0]
    turns = seg["turns"]
    assert [t["length"] for t in turns] == [first.usage.output_tokens, second.usage.output_tokens]
    assert turns[0]["start"] == first.usage.input_tokens and turns[1]["start"] == second.usage.input_tokens
    ct = chat_tokenizer(server.service.policy.tokenizer)
    assert seg["ids"][: turns[0]["start"]] == ct.encode(messages[:1], add_generation_prompt=True).ids.tolist()
    mask = torch.tensor(seg["assistant_mask"])
    assert mask.sum() == sum(t["length"] for t in turns)
    for t in turns:
        assert mask[t["start"] : t["start"] + t["length"]].all()
    got = torch.tensor([math.nan if v is None else v for v in seg["log_probs"]])
    assert torch.isnan(got[~mask]).all()
    torch.testing.assert_close(got[mask], reference_log_probs(tiny_model, seg["ids"])[mask], atol=1e-4, rtol=0)


def test_greedy_ids_equal_those_of_chat_completions(server):
    """The same two-turn chat, greedy, records the same ids through either API."""
    first_user, second_user = {"role": "user", "content": "Name a color."}, {"role": "user", "content": "Another."}
    with anthropic.Anthropic(base_url=server.url + "/s/greedy-a", api_key="x", max_retries=0) as a:
        r1 = a.messages.create(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[first_user])
        a.messages.create(
            model=MODEL,
            max_tokens=8,
            extra_body={"temperature": 0},
            messages=[first_user, {"role": "assistant", "content": r1.content}, second_user],
        )
    with openai.OpenAI(base_url=server.base_url("greedy-o"), api_key="x", max_retries=0) as o:
        c1 = o.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[first_user])
        reply = {"role": "assistant", "content": c1.choices[0].message.content}
        o.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[first_user, reply, second_user])
    a_seg, o_seg = server.session("greedy-a")["segments"], server.session("greedy-o")["segments"]
    assert len(a_seg) == len(o_seg) == 1 and a_seg[0]["ids"] == o_seg[0]["ids"]
    assert a_seg[0]["assistant_mask"] == o_seg[0]["assistant_mask"]


def test_tool_use_and_tool_result_continue_the_segment(tokenizer, tiny_model):
    replies = [
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "assistant", "content": "It is sunny in Paris."},
        {"role": "assistant", "content": "You're welcome!"},
    ]
    scripted = ScriptedPolicy(tokenizer, [*replies, replies[0]], tiny_model)
    with CaptureServer(scripted) as srv, anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0) as c:
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        first = c.messages.create(
            model=MODEL, max_tokens=30, messages=messages, tools=WEATHER, extra_headers={"X-Session-Id": "w"}
        )
        assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["text", "tool_use"]
        call = first.content[1]
        assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id
        result = {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny"}]}
        messages += [{"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
        second = c.messages.create(
            model=MODEL, max_tokens=30, messages=messages, tools=WEATHER, extra_headers={"X-Session-Id": "w"}
        )
        assert second.stop_reason == "end_turn" and _blocks(second)[0]["text"] == "It is sunny in Paris."
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in second.content]},
            {"role": "user", "content": "Thanks"},
        ]
        third = c.messages.create(
            model=MODEL, max_tokens=30, messages=messages, tools=WEATHER, extra_headers={"X-Session-Id": "w"}
        )
        assert third.content[0].text == "You're welcome!"
        with c.messages.stream(model=MODEL, max_tokens=30, messages=messages[:1], tools=WEATHER) as s:
            streamed = s.get_final_message()
        data = srv.session("w")
    assert [b.type for b in streamed.content] == ["text", "tool_use"] and streamed.stop_reason == "tool_use"
    assert streamed.content[1].input == {"city": "Paris"} and streamed.content[0].text == "Checking."
    assert data["divergences"] == 0 and len(data["segments"]) == 1 and data["requests"] == 3
    seg = data["segments"][0]
    tool_message = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    chat = [messages[0], replies[0], tool_message, replies[1], messages[4], replies[2]]
    full = scripted.ct.encode(chat, tools=TOOLS)
    n = len(seg["ids"])
    assert full.ids[:n].tolist() == seg["ids"] and scripted.ct.decode(full.ids[n:]) == "\n"
    assert full.assistant_mask[:n].tolist() == seg["assistant_mask"]


def _anthropic_error(response):
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    return response.status_code, body["error"]


def test_unsupported_and_missing_parameters_are_refused_as_anthropic_errors(client, server):
    ok = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    url = server.url + "/v1/messages"
    cases = [
        {"max_tokens": None},
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"tool_choice": {"type": "tool", "name": "not_a_tool"}, "tools": WEATHER},
        {"tool_choice": {"type": "any"}},
        {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
        {"frobnicate": 1},
        {"temperature": 3.5},
        {"metadata": {"user_id": "ok", "other": 1}},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "system", "content": "hi"}]},
        {"messages": []},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": [{"x": 1}]}]}]},
    ]
    for extra in cases:
        body = {k: v for k, v in {**ok, **extra}.items() if v is not None}
        status, err = _anthropic_error(httpx.post(url, json=body, headers={"X-Session-Id": "bad"}))
        assert status == 400 and err["type"] == "invalid_request_error" and err["message"], (extra, err)
    assert "max_tokens" in _anthropic_error(httpx.post(url, json={**ok, "max_tokens": None}))[1]["message"]
    status, err = _anthropic_error(httpx.post(url, content=b"{no", headers={"content-type": "application/json"}))
    assert status == 400 and err["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=5, messages=ok["messages"], extra_body={"top_k": -3})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "top_k" in e.value.message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=5, messages=ok["messages"], stop_sequences=["a"] * 5)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-9", max_tokens=5, messages=ok["messages"])
    assert httpx.get(server.url + "/v1/sessions/bad").status_code == 404  # refused requests left no session


def test_stop_reasons(client, tokenizer):
    cut = client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Talk."}])
    assert cut.usage.output_tokens <= 3
    if cut.stop_reason == "max_tokens":
        assert cut.usage.output_tokens == 3 and cut.stop_sequence is None
    ct = chat_tokenizer(tokenizer)
    ids = ct.encode_content("Hello world, bye")
    body = {"model": MODEL, "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
    req = parse_messages_request({**body, "stop_sequences": ["bye", "world"]})
    choice = make_choice(ct, Generated(ids, [0.0] * len(ids)), req, "call_")
    got = message_body(SimpleNamespace(choices=[choice], chat_tokenizer=ct, prompt_tokens=5), req)
    assert got["stop_reason"] == "stop_sequence" and got["stop_sequence"] == "world"
    assert got["content"] == [{"type": "text", "text": "Hello "}] and got["usage"]["output_tokens"] == len(ids)
    ended = make_choice(ct, Generated([*ids, *ct.end_of_turn_ids[:1]], [0.0] * (len(ids) + 1)), req, "call_")
    got = message_body(SimpleNamespace(choices=[ended], chat_tokenizer=ct, prompt_tokens=5), req)
    assert got["stop_reason"] == "end_turn" and got["stop_sequence"] is None


def test_event_writer_streams_token_pieces():
    message = {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": []}
    writer = EventWriter({**message, "usage": {"input_tokens": 4, "output_tokens": 0}})
    events = writer.start() + writer.thinking("a") + writer.thinking("b") + writer.text("c") + writer.text("d")
    events += writer.tool_use("t1", "f", {"x": 1}) + writer.finish("tool_use", None, 6)
    kinds = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_api_keys_come_as_the_auth_token(policy):
    with CaptureServer(policy, api_key="secret-key") as srv:
        with anthropic.Anthropic(base_url=srv.url, auth_token="secret-key", max_retries=0) as c:
            ok = c.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        with anthropic.Anthropic(base_url=srv.url, auth_token="wrong-key", max_retries=0) as c:
            with pytest.raises(anthropic.AuthenticationError):
                c.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert ok.usage.output_tokens >= 1


def test_count_tokens_counts_the_rendered_prompt_and_touches_no_session(client, server, policy):
    before = server.store.ids()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, system="Answer briefly.", tools=WEATHER)
    chat = [{"role": "system", "content": "Answer briefly."}, *messages]
    tools = [
        {
            "type": "function",
            "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
        }
        for t in WEATHER
    ]
    ct = server.service.chat_tokenizer(tools)
    assert counted.input_tokens == len(ct.encode(chat, add_generation_prompt=True, tools=tools).ids)
    plain = client.messages.count_tokens(model=MODEL, messages=messages)
    assert plain.input_tokens == len(policy.chat_tokenizer.encode(messages, add_generation_prompt=True).ids)
    assert plain.input_tokens < counted.input_tokens  # the system message and the tool schema count
    assert server.store.ids() == before  # counting made no session
    # the count is the prompt a request is generated after
    reply = client.messages.create(model=MODEL, max_tokens=3, messages=messages)
    assert reply.usage.input_tokens == plain.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.count_tokens(model=MODEL, messages=messages, extra_body={"max_tokens": 5})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="other", messages=messages)


def test_models_answer_the_anthropic_client_in_its_shape(client, server):
    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL] and listed.data[0].type == "model"
    assert client.models.retrieve(MODEL).display_name == MODEL
    with openai.OpenAI(base_url=server.base_url(), api_key="x", max_retries=0) as oa:
        assert [m.id for m in oa.models.list().data] == [MODEL]  # the OpenAI shape for everyone else


def test_a_missing_or_wrong_key_is_refused_in_anthropics_shape(policy):
    key = "secret-key-123"
    with CaptureServer(policy, api_key=key) as server:
        msg = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
        with anthropic.Anthropic(base_url=server.url, auth_token="wrong-key-0", max_retries=0) as wrong:
            with pytest.raises(anthropic.AuthenticationError) as e:
                wrong.messages.create(**msg)
            with pytest.raises(anthropic.AuthenticationError) as counted:
                wrong.messages.count_tokens(model=MODEL, messages=msg["messages"])
        for err in (e.value, counted.value):
            assert err.body["type"] == "error" and err.body["error"]["type"] == "authentication_error"
            assert "API key" in err.body["error"]["message"]
        with openai.OpenAI(base_url=server.base_url(), api_key="wrong-key-0", max_retries=0) as other:
            with pytest.raises(openai.AuthenticationError) as o:  # the other dialects keep OpenAI's shape
                other.chat.completions.create(model=MODEL, messages=msg["messages"])
        assert o.value.body["code"] == "invalid_api_key"
        with anthropic.Anthropic(base_url=server.url, auth_token=key, max_retries=0) as right:
            assert right.messages.create(**msg).role == "assistant"
