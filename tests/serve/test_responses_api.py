"""The Responses API on the capture endpoint, driven by the real openai client: one segment per agent, exact ids."""

import json
import math

import httpx
import openai
import pytest
import test_serve
import torch
from helpers import reference_log_probs
from test_serve import ScriptedPolicy

from chatenv.errors import APIError
from chatenv.serve import CaptureServer
from chatenv.serve.responses.request import parse_responses_request
from chatenv.tokenization import chat_tokenizer

torch.set_num_threads(1)

#: the endpoint on the tiny model, as the chat-completions tests serve it (a server per module)
policy, server, client = test_serve.policy, test_serve.server, test_serve.client

MODEL = "chatenv-policy"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def _items(response):
    """The response's output items as an agent appends them to its next input."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def test_a_response_round_trip_and_its_stream(client, server):
    r = client.responses.create(
        model=MODEL, input="Say hi.", instructions="Be brief.", temperature=0.5, max_output_tokens=6, user="rt"
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and r.output_text == message.content[0].text
    assert r.usage.output_tokens <= 6 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 6
    seg = server.session("rt")["segments"][0]
    ct = chat_tokenizer(server.service.policy.tokenizer)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    assert seg["ids"][: seg["turns"][0]["start"]] == ct.encode(prompt, add_generation_prompt=True).ids.tolist()
    assert r.usage.input_tokens == seg["turns"][0]["start"] and r.usage.output_tokens == seg["turns"][0]["length"]

    asked = {"model": MODEL, "input": "Tell me something.", "max_output_tokens": 10, "temperature": 0}
    plain = client.responses.create(**asked)
    events = list(client.responses.create(**asked, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == f"response.{plain.status}" and events[-1].response.output_text == plain.output_text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == next(e.text for e in events if e.type == "response.output_text.done")
    assert events[-1].response.usage == plain.usage


def test_a_two_turn_agent_records_one_segment_with_exact_ids(client, server, tiny_model):
    items = [{"role": "user", "content": "Count to three."}]
    replies = []
    for _ in range(2):
        r = client.responses.create(model=MODEL, input=items, user="agent", temperature=1.0, max_output_tokens=8)
        replies.append(r.output_text)
        items += [*_items(r), {"role": "user", "content": [{"type": "input_text", "text": "Again."}]}]
    data = server.session("agent")
    assert data["requests"] == 2 and data["divergences"] == 0 and len(data["segments"]) == 1
    seg = data["segments"][0]
    assert [t["reply"]["content"] for t in seg["turns"]] == replies
    ct = chat_tokenizer(server.service.policy.tokenizer)
    chat = [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": "Again."},
    ]
    first, second = seg["turns"]
    assert seg["ids"][: first["start"]] == ct.encode(chat[:1], add_generation_prompt=True).ids.tolist()
    if first["finish_reason"] == "stop":  # a complete reply: its sampled ids, then only the new messages' tokens
        full = ct.encode(chat, add_generation_prompt=True).ids.tolist()
        tail = seg["ids"][first["start"] + first["length"] : second["start"]]
        assert tail == full[-len(tail) :] and ct.decode(seg["ids"][: second["start"]]) == ct.decode(full)
    mask = torch.tensor(seg["assistant_mask"])
    generated = torch.zeros_like(mask)
    for t in seg["turns"]:
        generated[t["start"] : t["start"] + t["length"]] = True
    assert torch.equal(mask, generated)
    got = torch.tensor([math.nan if v is None else v for v in seg["log_probs"]])
    assert torch.isnan(got[~mask]).all()
    torch.testing.assert_close(got[mask], reference_log_probs(tiny_model, seg["ids"])[mask], atol=1e-4, rtol=0)


def test_function_calls_go_out_as_items_and_come_back_in_the_same_segment(tokenizer, tiny_model):
    replies = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "assistant", "content": "It is sunny in Paris."},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
    ]
    scripted = ScriptedPolicy(tokenizer, replies, tiny_model)
    with CaptureServer(scripted) as srv, openai.OpenAI(base_url=srv.base_url("f"), api_key="x", max_retries=0) as c:
        items = [{"role": "user", "content": "Weather in Paris?"}]
        first = c.responses.create(model=MODEL, input=items, tools=TOOLS)
        assert [o.type for o in first.output] == ["function_call"]
        call = first.output[0]
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
        items += [*_items(first), {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        second = c.responses.create(model=MODEL, input=items, tools=TOOLS)
        assert second.output_text == "It is sunny in Paris." and second.status == "completed"
        items += [*_items(second), {"role": "user", "content": "And Oslo?"}]
        with c.responses.stream(model=MODEL, input=items, tools=TOOLS) as stream:
            events = list(stream)
            third = stream.get_final_response()
        data = srv.session("f")
    assert [o.type for o in third.output] == ["message", "function_call"] and third.output_text == "Checking."
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Oslo"} == json.loads(third.output[1].arguments)
    assert data["divergences"] == 0 and len(data["segments"]) == 1 and data["requests"] == 3
    seg = data["segments"][0]
    chat = [
        {"role": "user", "content": "Weather in Paris?"},
        replies[0],
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
        replies[1],
        {"role": "user", "content": "And Oslo?"},
        replies[2],
    ]
    full = scripted.ct.encode(
        chat, tools=[{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
    )
    n = len(seg["ids"])
    assert full.ids[:n].tolist() == seg["ids"] and full.assistant_mask[:n].tolist() == seg["assistant_mask"]
    assert [t["reply"].get("tool_calls", [{}])[0].get("id") for t in seg["turns"][:1]] == [call.call_id]


def test_reasoning_items_become_the_next_assistant_messages_reasoning():
    body = {
        "model": MODEL,
        "input": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "greet back"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
    }
    messages = parse_responses_request(body).chat.messages
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": "Hello",
            "reasoning_content": "greet back",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}],
        },
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
    ]


def test_function_calls_alone_make_one_assistant_message_and_stray_reasoning_is_refused():
    calls = [{"type": "function_call", "call_id": f"c{k}", "name": "f", "arguments": "{}"} for k in range(2)]
    body = {"model": MODEL, "input": [{"role": "user", "content": "Hi"}, *calls]}
    messages = parse_responses_request(body).chat.messages
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c0", "c1"] and messages[1]["content"] == ""
    for stray, param in (
        ([{"type": "reasoning", "summary": []}], "input"),
        ([{"type": "reasoning", "summary": []}, {"role": "user", "content": "x"}], "input[2]"),
    ):
        with pytest.raises(APIError) as e:
            parse_responses_request({"model": MODEL, "input": [{"role": "user", "content": "Hi"}, *stray]})
        assert e.value.param == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ],
)
def test_unsupported_parameters_are_refused_naming_them(client, server, extra, param):
    before = len(server.store.ids())
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
    assert len(server.store.ids()) == before


def test_the_session_path_and_header_name_the_session(server):
    r = httpx.post(server.url + "/s/path-sid/v1/responses", json={"model": MODEL, "input": "Hi", "store": True})
    assert r.status_code == 200 and r.headers["X-Session-Id"] == "path-sid" and r.json()["store"] is False  # none kept
    r = httpx.post(
        server.url + "/v1/responses", json={"model": MODEL, "input": "Hi"}, headers={"X-Session-Id": "hdr-sid"}
    )
    assert r.status_code == 200 and r.headers["X-Session-Id"] == "hdr-sid" and r.json()["store"] is False
