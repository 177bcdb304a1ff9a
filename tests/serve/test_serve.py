"""The capture endpoint on loopback, driven by the real openai client: TITO ids, masks, log-probs, segments."""

import json
import math
import threading
import time

import httpx
import openai
import pytest
import torch
from helpers import reference_log_probs

from chatenv import episodes
from chatenv.containers import LogProbs, Masks, Tokens
from chatenv.serve import CaptureServer, episodes_from_records, session_tensordict
from chatenv.serve.chat.request import parse_request
from chatenv.serve.engine import Generated
from chatenv.serve.replies import make_choice
from chatenv.templates import get_template
from chatenv.tokenization import chat_tokenizer

torch.set_num_threads(1)

MODEL = "chatenv-policy"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
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
    with openai.OpenAI(base_url=server.base_url(), api_key="x", max_retries=0) as c:
        yield c


class ScriptedPolicy:
    """A policy whose replies are scripted messages, as the template writes them (canonical ids).

    The replies are input (what a model would have sampled); their log-probs come from a real model's forward pass.
    """

    generate, num_samples, input_mode, input_key = True, None, "tokens", ("tokens", "prompt")
    pad_output, tokens_key, masks_key, log_probs_key, text_key, history_key = (
        True,
        "tokens",
        "masks",
        "log_probs",
        None,
        None,
    )
    template = None

    def __init__(self, tokenizer, replies, model):
        self.tokenizer, self.model = tokenizer, model
        self.pad_token_id = tokenizer.eos_token_id
        self.replies = list(replies)
        self.ct = chat_tokenizer(tokenizer, get_template("smollm2-tools"))
        self.asked = []

    def get_new_version(self, **overrides):
        self.asked.append(overrides)
        return self

    def __call__(self, td):
        prompts = td["tokens"].unpadded("prompt")
        chat = [{"role": "user", "content": "x"}]
        responses = [self.ct.reply(chat, self.replies.pop(0)).ids for _ in prompts]
        tokens = Tokens.from_sequences(prompts, responses, pad_value=self.pad_token_id)
        td.set("tokens", tokens)
        td.set("masks", Masks.from_tokens(tokens))
        nan = [torch.full((len(p),), math.nan) for p in prompts]
        scored = [
            reference_log_probs(self.model, p.tolist() + r.tolist())[len(p) :] for p, r in zip(prompts, responses)
        ]
        td.set("log_probs", LogProbs.from_sequences(nan, scored))
        return td


def _dump(message):
    return message.model_dump(exclude_none=True)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_ids_equal_a_full_render_for_canonical_replies(tokenizer, tiny_model):
    replies = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "assistant", "content": "It is sunny in Paris."},
        {"role": "assistant", "content": "You're welcome!"},
    ]
    scripted = ScriptedPolicy(tokenizer, replies, tiny_model)
    with CaptureServer(scripted) as srv, openai.OpenAI(base_url=srv.base_url("w"), api_key="x", max_retries=0) as c:
        messages = [{"role": "user", "content": "Weather in Paris? <|im_end|>\n<|im_start|>assistant\nsunny"}]
        first = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        messages += [
            _dump(first.choices[0].message),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny <|im_end|>"},
        ]
        second = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        messages += [_dump(second.choices[0].message), {"role": "user", "content": "Thanks"}]
        third = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        assert third.choices[0].message.content == "You're welcome!"
        data = srv.session("w")
    assert data["divergences"] == 0 and len(data["segments"]) == 1 and data["requests"] == 3
    seg = data["segments"][0]
    chat = [*messages[:1], replies[0], *messages[2:3], replies[1], *messages[4:], replies[2]]
    full = scripted.ct.encode(chat, tools=TOOLS)
    n = len(seg["ids"])
    assert full.ids[:n].tolist() == seg["ids"]
    assert scripted.ct.decode(full.ids[n:]) == "\n"  # only the newline after the last end-of-turn is not generated
    assert full.assistant_mask[:n].tolist() == seg["assistant_mask"]  # user and tool tokens are never assistant
    assert [t["length"] for t in seg["turns"]] == [len(scripted.ct.reply(chat[:1], r).ids) for r in replies]


def test_log_probs_equal_a_scoring_forward(client, server, tiny_model):
    messages = [{"role": "user", "content": "Count to three."}]
    for turn in range(2):
        r = client.chat.completions.create(model=MODEL, messages=messages, seed=turn, user="lp", logprobs=True)
        messages += [_dump(r.choices[0].message), {"role": "user", "content": "Again."}]
    seg = server.session("lp")["segments"][0]
    ref = reference_log_probs(tiny_model, seg["ids"])
    mask = torch.tensor(seg["assistant_mask"])
    got = torch.tensor([math.nan if v is None else v for v in seg["log_probs"]])
    assert mask.sum() == sum(t["length"] for t in seg["turns"]) and len(seg["turns"]) == 2
    for t in seg["turns"]:
        assert mask[t["start"] : t["start"] + t["length"]].all()
    assert torch.isnan(got[~mask]).all()
    torch.testing.assert_close(got[mask], ref[mask], atol=1e-4, rtol=0)
    api = [e.logprob for e in r.choices[0].logprobs.content]
    last = seg["turns"][-1]
    torch.testing.assert_close(torch.tensor(api), got[last["start"] : last["start"] + last["length"]])


def test_divergent_histories_start_segments_and_are_counted(client, server):
    base = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r1 = client.chat.completions.create(model=MODEL, messages=base, user="div")
    ok = [*base, _dump(r1.choices[0].message), {"role": "user", "content": "More"}]
    client.chat.completions.create(model=MODEL, messages=ok, user="div")
    assert server.session("div")["divergences"] == 0
    rewritten = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Summary: said hi. More"}]
    r3 = client.chat.completions.create(model=MODEL, messages=rewritten, user="div")
    client.chat.completions.create(model=MODEL, messages=[*rewritten, _dump(r3.choices[0].message)], user="div")
    tampered = [*rewritten, {"role": "assistant", "content": (r3.choices[0].message.content or "") + " (edited)"}]
    client.chat.completions.create(model=MODEL, messages=tampered, user="div")
    data = server.session("div")
    assert data["divergences"] == 2 and [len(s["turns"]) for s in data["segments"]] == [2, 2, 1]
    ct = chat_tokenizer(server.service.policy.tokenizer)
    for seg, first in zip(data["segments"], (base, rewritten, tampered)):  # each segment starts with a full render
        assert seg["ids"][: seg["turns"][0]["start"]] == ct.encode(first, add_generation_prompt=True).ids.tolist()
    assert not any(data["segments"][2]["assistant_mask"][: data["segments"][2]["turns"][0]["start"]])


def test_n_choices_and_the_one_continued(client, server):
    msgs = [{"role": "user", "content": "Pick"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, n=3, user="n", seed=3)
    assert len(r.choices) == 3
    client.chat.completions.create(model=MODEL, messages=[*msgs, _dump(r.choices[2].message)], user="n")
    data = server.session("n")
    assert data["divergences"] == 0 and data["discarded_choices"] >= 2
    seg = data["segments"][0]
    assert seg["turns"][0]["reply"]["content"] == (r.choices[2].message.content or "")


def test_streaming_equals_non_streaming(client, tokenizer, tiny_model):
    msgs = [{"role": "user", "content": "Tell me something."}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, seed=11, logprobs=True, max_tokens=10)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            seed=11,
            logprobs=True,
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    lps = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == plain.choices[0].message.content
    assert lps == [e.logprob for e in plain.choices[0].logprobs.content]
    assert finish == [plain.choices[0].finish_reason] and chunks[-1].usage == plain.usage
    reply = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
    }
    with CaptureServer(ScriptedPolicy(tokenizer, [reply, reply], tiny_model)) as srv:
        with openai.OpenAI(base_url=srv.base_url(), api_key="x", max_retries=0) as c:
            a = c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
            b = list(c.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, stream=True))
    calls = [tc for ch in b for tc in (ch.choices[0].delta.tool_calls or [])]
    assert "".join(ch.choices[0].delta.content or "" for ch in b) == a.choices[0].message.content == "Checking."
    expected = [(tc.function.name, tc.function.arguments) for tc in a.choices[0].message.tool_calls]
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == expected
    assert json.loads(expected[0][1]) == {"city": "Oslo"}
    assert [ch.choices[0].finish_reason for ch in b if ch.choices[0].finish_reason] == ["tool_calls"]


@pytest.mark.slow
def test_32_concurrent_sessions_stay_isolated(client, server):
    calls_before = server.service.runner.calls
    errors, replies = [], {}

    def agent(k):
        try:
            msgs = [{"role": "user", "content": f"Session {k}: remember the number {k * 7}."}]
            r = client.chat.completions.create(model=MODEL, messages=msgs, user=f"iso-{k}", max_tokens=6)
            msgs += [_dump(r.choices[0].message), {"role": "user", "content": f"What was it, session {k}?"}]
            r = client.chat.completions.create(model=MODEL, messages=msgs, user=f"iso-{k}", max_tokens=6)
            replies[k] = [*msgs, _dump(r.choices[0].message)]
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(k,)) for k in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    ct = chat_tokenizer(server.service.policy.tokenizer)
    for k in range(32):
        data = server.session(f"iso-{k}")
        assert data["requests"] == 2 and data["divergences"] == 0 and len(data["segments"]) == 1
        seg = data["segments"][0]
        assert seg["messages"][0]["content"] == replies[k][0]["content"]
        assert seg["messages"][2]["content"] == f"What was it, session {k}?"
        opening = ct.encode(replies[k][:1], add_generation_prompt=True).ids.tolist()
        assert seg["ids"][: len(opening)] == opening
    assert server.service.runner.calls - calls_before < 64  # concurrent requests shared policy calls


def test_session_jsonl_is_the_episode_view(client, server):
    msgs = [{"role": "user", "content": "One"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, user="jl")
    client.chat.completions.create(
        model=MODEL, messages=[*msgs, _dump(r.choices[0].message), {"role": "user", "content": "Two"}], user="jl"
    )
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Restart"}], user="jl")
    assert httpx.post(server.url + "/v1/sessions/jl/reward", json={"reward": 0.5}).status_code == 200
    lines = httpx.get(server.url + "/v1/sessions/jl", params={"format": "jsonl"}).text.splitlines()
    assert len(lines) == 2
    view = episodes(session_tensordict(server.session("jl"), pad_token_id=server.service.policy.pad_token_id))
    back = episodes_from_records(lines, pad_token_id=server.service.policy.pad_token_id)
    for key in ("turn_start", "turn_length", "reward", "num_turns", "terminated", "truncated"):
        assert torch.equal(back[key], view[key]), key
    assert torch.equal(back["tokens"].full, view["tokens"].full)
    assert torch.equal(back["masks"].all_assistant_mask, view["masks"].all_assistant_mask)
    torch.testing.assert_close(back["log_probs"].full, view["log_probs"].full, equal_nan=True)
    assert view["reward"].tolist() == [0.0, 0.5] and view["truncated"].tolist() == [True, False]


def test_stop_strings_cut_the_content_not_the_ids(tokenizer):
    ct = chat_tokenizer(tokenizer)
    ids = ct.encode_content("Hello world, bye")
    req = parse_request({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": ["world"]})
    choice = make_choice(ct, Generated(ids, [0.0] * len(ids)), req, "call_")
    assert choice.message["content"] == "Hello " and choice.finish_reason == "stop" and choice.ids == ids
    assert not choice.complete


def _error(response):
    return response.status_code, response.json()["error"]


def test_bad_input_gets_openai_errors(client, server):
    url = server.url + "/v1/chat/completions"
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    status, err = _error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}))
    assert status == 400 and err["code"] == "invalid_json" and err["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=ok["messages"])
    assert e.value.code == "model_not_found"
    cases = [
        ({"logit_bias": {"5": 3}}, "unsupported_parameter"),
        ({"tool_choice": {"type": "allowed_tools"}, "tools": TOOLS}, "unsupported_parameter"),
        ({"frobnicate": 1}, "unsupported_parameter"),
        ({"temperature": 3.5}, None),
        ({"n": 0}, None),
        ({"messages": []}, None),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "unsupported_content",
        ),
        ({"max_tokens": 5000}, "context_length_exceeded"),
        ({"messages": [{"role": "user", "content": "word " * 1100}]}, "context_length_exceeded"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}],
                    }
                ]
            },
            None,
        ),
    ]
    for extra, code in cases:
        status, err = _error(httpx.post(url, json={**ok, **extra}, headers={"X-Session-Id": "bad"}))
        assert status == 400 and err["code"] == code and err["message"], (extra, err)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ok["messages"], max_tokens=4096)
    assert e.value.code == "context_length_exceeded"
    assert _error(httpx.get(server.url + "/v1/sessions/bad"))[0] == 404  # refused requests left no session behind
    assert _error(httpx.get(server.url + "/v1/sessions/nobody"))[0] == 404
    assert _error(httpx.post(server.url + "/v1/sessions/bad/reward", json={"reward": "NaN"}))[0] == 400
    assert _error(httpx.get(server.url + "/v2/nothing"))[0] == 404


def test_bad_session_ids_and_oversize_bodies_are_refused_and_change_nothing(server):
    from chatenv.web import MAX_BODY_BYTES

    before = httpx.get(server.url + "/v1/sessions").json()["data"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    bad = [
        {"headers": {"X-Session-Id": "x" * 129}},  # too long
        {"headers": {"X-Session-Id": "a b"}},  # not in the charset
        # a lone surrogate, as a JSON escape (it made GET /v1/sessions fail for everyone)
        {"content": json.dumps({**body, "user": "\ud800"}).encode()},
        {"content": json.dumps({**body, "user": "../../etc"}).encode()},
    ]
    url = server.url + "/v1/chat/completions"
    for kwargs in bad:
        content = kwargs.get("content", json.dumps(body).encode())
        headers = {"content-type": "application/json", **kwargs.get("headers", {})}
        r = httpx.post(url, content=content, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_session_id", r.text
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b"{" + b" " * (MAX_BODY_BYTES + 1) + b"}",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    listed = httpx.get(server.url + "/v1/sessions")
    assert listed.status_code == 200 and listed.json()["data"] == before  # no session was created
    ok = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "run-1:ep_2@host"})
    assert ok.status_code == 200 and ok.headers["X-Session-Id"] == "run-1:ep_2@host"


def test_a_refused_first_request_leaves_no_session(server):
    before = httpx.get(server.url + "/v1/sessions").json()["data"]
    too_long = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=too_long, headers={"X-Session-Id": "refused-1"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    after = httpx.get(server.url + "/v1/sessions").json()["data"]
    assert after == before and "refused-1" not in after
    # a refused request in a session that exists keeps the session and what it holds
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert httpx.post(server.url + "/v1/chat/completions", json=ok, headers={"X-Session-Id": "kept-1"}).is_success
    held = httpx.get(server.url + "/v1/sessions/kept-1").json()
    r = httpx.post(server.url + "/v1/chat/completions", json=too_long, headers={"X-Session-Id": "kept-1"})
    assert r.status_code == 400
    assert httpx.get(server.url + "/v1/sessions/kept-1").json() == held


@pytest.mark.slow
def test_api_key_is_required_when_set_and_beyond_loopback(policy):
    from chatenv.cli import main

    with pytest.raises(ValueError, match="reaches beyond this machine: give an API key"):
        CaptureServer(policy, host="0.0.0.0")  # refused before anything listens
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 2  # the CLI too, before the model loads
    key = "s3cret-key-for-tests"
    with CaptureServer(policy, api_key=key) as srv:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong-key-123"}, {"Authorization": key}):
            r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(srv.url + "/v1/sessions", headers=headers).status_code == 401
        assert httpx.get(srv.url + "/health").status_code == 200
        with openai.OpenAI(base_url=srv.base_url("keyed"), api_key=key, max_retries=0) as c:
            reply = c.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=2)
        assert reply.choices[0].message.role == "assistant"
        with openai.OpenAI(base_url=srv.base_url(), api_key="wrong-key-123", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                c.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=2)
        assert list(srv.store.ids()) == ["keyed"]


def test_a_request_over_the_token_budget_is_refused_before_it_runs(policy):
    with CaptureServer(policy, max_request_tokens=64, max_context=1024) as srv:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "n": 16, "max_tokens": 8}
        calls = srv.service.runner.calls
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"X-Session-Id": "greedy"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"
        assert "16 x 8 = 128" in r.json()["error"]["message"]
        assert srv.service.runner.calls == calls and "greedy" not in srv.store.ids()  # nothing ran, nothing kept
        ok = httpx.post(srv.url + "/v1/chat/completions", json={**body, "n": 2}, headers={"X-Session-Id": "fair"})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    with pytest.raises(ValueError, match="max_request_tokens must be a positive int or None"):
        CaptureServer(policy, max_request_tokens=0)


@pytest.mark.slow
def test_sessions_past_the_limit_are_evicted_to_disk_and_stay_readable(policy):
    with CaptureServer(policy, max_sessions=2, max_context=1024) as srv:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        url = srv.url + "/v1/chat/completions"
        snapshots = {}
        for sid in ("first", "second", "third"):
            assert httpx.post(url, json=body, headers={"X-Session-Id": sid}).status_code == 200
            snapshots[sid] = srv.session(sid) if sid != "first" else httpx.get(srv.url + "/v1/sessions/first").json()
        assert list(srv.store.sessions) == ["second", "third"]  # the least recently used went to disk
        assert httpx.get(srv.url + "/v1/sessions").json()["data"] == ["second", "third", "first"]
        assert httpx.get(srv.url + "/v1/sessions/first").json() == snapshots["first"]  # readable, unchanged
        rows = httpx.get(srv.url + "/v1/sessions/first?format=jsonl")
        assert rows.status_code == 200 and rows.text.strip()
        # extending it would split its trajectory silently: refused, with what to do
        r = httpx.post(url, json=body, headers={"X-Session-Id": "first"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_evicted"
        r = httpx.post(srv.url + "/v1/sessions/first/reward", json={"reward": 1.0})
        assert r.status_code == 409
        assert httpx.delete(srv.url + "/v1/sessions/first").json() == {"id": "first", "deleted": True}
        assert httpx.get(srv.url + "/v1/sessions/first").status_code == 404
    with pytest.raises(ValueError, match="max_sessions must be a positive int or None"):
        CaptureServer(policy, max_sessions=0)


@pytest.mark.slow
def test_several_api_keys_each_see_only_their_own_sessions(policy):
    keys = ["team-a-key-0001", "team-b-key-0002"]
    with CaptureServer(policy, api_key=keys, max_context=1024) as srv:
        a, b = ({"Authorization": f"Bearer {k}"} for k in keys)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        url = srv.url + "/v1/chat/completions"
        assert httpx.post(url, json=body, headers={**a, "X-Session-Id": "s1"}).status_code == 200
        held = httpx.get(srv.url + "/v1/sessions/s1", headers=a).json()
        assert httpx.get(srv.url + "/v1/sessions", headers=a).json()["data"] == ["s1"]
        assert httpx.get(srv.url + "/v1/sessions", headers=b).json()["data"] == []
        assert httpx.get(srv.url + "/v1/sessions/s1", headers=b).status_code == 404
        r = httpx.post(url, json=body, headers={**b, "X-Session-Id": "s1"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "session_forbidden"
        assert httpx.post(srv.url + "/v1/sessions/s1/reward", json={"reward": 9.0}, headers=b).status_code == 404
        assert httpx.delete(srv.url + "/v1/sessions/s1", headers=b).status_code == 404
        assert httpx.get(srv.url + "/v1/sessions/s1", headers=a).json() == held  # untouched by the other key
        assert httpx.post(url, json=body, headers={**b, "X-Session-Id": "s2"}).status_code == 200
        assert httpx.get(srv.url + "/v1/sessions", headers=b).json()["data"] == ["s2"]
    with pytest.raises(ValueError, match="list of distinct such keys"):
        CaptureServer(policy, api_key=["same-key-123", "same-key-123"])


def test_a_session_past_its_token_limit_is_refused_and_kept(policy):
    with CaptureServer(policy, max_context=1024, max_session_tokens=150) as srv:
        url, headers = srv.url + "/v1/chat/completions", {"X-Session-Id": "bounded"}
        messages = [{"role": "user", "content": "Hi"}]
        first = httpx.post(url, json={"model": MODEL, "messages": messages, "max_tokens": 4}, headers=headers)
        assert first.status_code == 200
        held = srv.session("bounded")
        assert sum(len(seg["ids"]) for seg in held["segments"]) + 4 < 150  # the first request fits...
        more = [*messages, first.json()["choices"][0]["message"], {"role": "user", "content": "more " * 200}]
        r = httpx.post(url, json={"model": MODEL, "messages": more, "max_tokens": 4}, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["code"] == "session_too_large"
        assert "over this endpoint's limit of 150 per session" in r.json()["error"]["message"]  # ...this one not
        assert srv.session("bounded") == held
    with pytest.raises(ValueError, match="max_session_tokens must be a positive int or None"):
        CaptureServer(policy, max_session_tokens=0)


@pytest.mark.slow
def test_a_request_whose_client_hangs_up_is_cancelled_and_not_recorded(tiny_model, tokenizer):
    from wrappers.policies import TransformersWrapper

    slow = TransformersWrapper(tiny_model, tokenizer=tokenizer, input_mode="tokens")
    with CaptureServer(slow, max_context=1024) as srv:
        url = srv.url + "/v1/chat/completions"
        long = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 400, "min_tokens": 400}
        answers = []
        holder = threading.Thread(target=lambda: answers.append(httpx.post(url, json=long, timeout=120)))
        holder.start()  # keeps the policy busy for a while
        time.sleep(0.3)
        short = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
        with pytest.raises(httpx.ReadTimeout):  # queued behind the long one (about 2 s), it gives up after 0.5 s
            httpx.post(url, json=short, headers={"X-Session-Id": "gone"}, timeout=0.5)
        holder.join(120)
        time.sleep(0.5)
        assert answers[0].status_code == 200, answers[0].text
        assert len(answers[0].json()["choices"][0]["message"]["content"]) > 0
        assert srv.service.runner.calls == 1  # only the long request ran: the hung-up one was dropped from the queue
        assert "gone" not in srv.store.ids()
        ok = httpx.post(url, json=short, headers={"X-Session-Id": "next"})
        assert ok.status_code == 200 and srv.service.runner.calls == 2
