"""vLLM's token routes on the capture endpoint: /tokenize, /detokenize, return_token_ids, the token-prompt routes.

Real server on loopback, the tiny model behind it, httpx and the openai client on the wire; every recorded segment
is checked token-exact (ids = prompt + sampled ids + only the new tokens; log-probs = a scoring forward pass).
"""

import math

import httpx
import openai
import pytest
import torch
from helpers import reference_log_probs

from chatenv.serve import CaptureServer
from chatenv.tokenization import chat_tokenizer

torch.set_num_threads(1)

MODEL = "chatenv-policy"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    from wrappers.policies import TransformersWrapper

    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 12}
    )
    with CaptureServer(policy) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    root = server.base_url().removesuffix("/v1")
    with httpx.Client(base_url=root, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def ct(tokenizer):
    return chat_tokenizer(tokenizer, None)


def _render(ct, messages):
    return ct.encode(messages, add_generation_prompt=True).ids.tolist()


def _continuation(http, messages, reply_ids, new):
    """The ids after a complete reply, as verifiers' token client computes them with /tokenize (its bridge)."""
    dummy = {"role": "assistant", "content": "x"}
    full = http.post("/tokenize", json={"model": MODEL, "messages": [dummy, *new]}).json()["tokens"]
    base = http.post("/tokenize", json={"model": MODEL, "messages": [dummy], "add_generation_prompt": False}).json()[
        "tokens"
    ]
    gap = len(base) - 1 - max(i for i, t in enumerate(base) if t == reply_ids[-1])
    return full[len(base) - gap :]


def _check_segment(seg, tiny_model):
    ref = reference_log_probs(tiny_model, seg["ids"])
    mask = torch.tensor(seg["assistant_mask"])
    got = torch.tensor([math.nan if v is None else v for v in seg["log_probs"]])
    assert int(mask.sum()) == sum(t["length"] for t in seg["turns"])
    for t in seg["turns"]:
        assert mask[t["start"] : t["start"] + t["length"]].all()
    assert torch.isnan(got[~mask]).all()
    assert torch.allclose(got[mask], ref[mask], atol=1e-4)


def test_model_cards_say_the_context_length_as_vllm(http, server):
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == server.service.max_context > 0


def test_tokenize_and_detokenize_as_vllm(http, ct, tokenizer):
    ids = _render(ct, CHAT)
    got = http.post("/tokenize", json={"model": MODEL, "messages": CHAT, "return_token_strs": True}).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] > len(ids)
    assert got["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert ids[: len(bare)] == bare and len(bare) < len(ids)
    text = http.post("/s/tk/tokenize", json={"prompt": "Hello world"}).json()
    assert text["tokens"] == tokenizer.encode("Hello world")
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": ct.decode(ids)}
    for body, param in (
        ({"messages": CHAT, "prompt": "x"}, "messages"),
        ({"messages": CHAT, "chat_template": "{{ x }}"}, "chat_template"),
        ({"messages": CHAT, "bogus": 1}, "bogus"),
    ):
        r = http.post("/tokenize", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post("/detokenize", json={"tokens": [len(tokenizer) + 5]})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


def test_return_token_ids_and_token_id_logprobs_on_chat(request, server, ct):
    client = openai.OpenAI(base_url=server.base_url("rt"), api_key="x", max_retries=0)
    request.addfinalizer(client.close)
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "skip_special_tokens": False}
    r = client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True, seed=1, extra_body=extra)
    body = r.model_dump()
    choice = body["choices"][0]
    assert body["prompt_token_ids"] == _render(ct, CHAT)
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in choice["token_ids"]]
    seg = server.session("rt")["segments"][0]
    assert seg["ids"] == body["prompt_token_ids"] + choice["token_ids"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, seed=1)
    assert "prompt_token_ids" not in r.model_dump() and "token_ids" not in r.model_dump()["choices"][0]
    with pytest.raises(openai.BadRequestError, match="return_token_ids"):
        client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, extra_body=extra)
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, logprobs=True, seed=1, stream=True, extra_body={"return_tokens_as_token_ids": True}
    )
    tokens = [
        e.token
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert tokens == [f"token_id:{i}" for i in choice["token_ids"]]  # the same seed: the same reply


def _first_complete_turn(post, make_body, finished=lambda r: r["choices"][0]["finish_reason"] != "length"):
    """The first seed whose reply ends its turn (a reply cut by the budget cannot be continued by ids)."""
    for seed in range(40):
        r = post(make_body(seed))
        assert r.status_code == 200, r.text
        if finished(r.json()):
            return seed, r.json()
    raise AssertionError("no seed gave a complete reply")


def test_chat_tokens_route_continues_the_segment_and_refuses_other_ids(http, server, ct, tiny_model):
    url = "/s/{}/v1/chat/completions"
    extra = {"logprobs": True, "return_token_ids": True, "max_tokens": 12}
    seed, first = _first_complete_turn(
        lambda b: http.post(url.format(f"ct{b['seed']}"), json=b),
        lambda s: {"model": MODEL, "messages": CHAT, "seed": s, **extra},
    )
    sid = f"ct{seed}"
    reply = first["choices"][0]
    new = [{"role": "user", "content": "Another one?"}]
    messages = [*CHAT, reply["message"], *new]
    tokens = first["prompt_token_ids"] + reply["token_ids"] + _continuation(http, messages, reply["token_ids"], new)
    bad = list(tokens)
    bad[len(first["prompt_token_ids"]) + 1] += 1
    r = http.post(url.format(sid) + "/tokens", json={"model": MODEL, "messages": messages, "tokens": bad, **extra})
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_ids_mismatch", r.text
    assert f"position {len(first['prompt_token_ids']) + 1}" in r.json()["error"]["message"]
    assert server.session(sid)["requests"] == 1  # nothing generated, nothing recorded
    r = http.post(url.format(sid) + "/tokens", json={"model": MODEL, "messages": messages, "tokens": tokens, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == tokens
    snap = server.session(sid)
    assert len(snap["segments"]) == 1 and snap["divergences"] == 0
    seg = snap["segments"][0]
    assert seg["ids"] == tokens + r.json()["choices"][0]["token_ids"]
    _check_segment(seg, tiny_model)
    r = http.post(url.format(sid) + "/tokens", json={"model": MODEL, "messages": messages, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_ids_that_re_render_the_whole_chat_start_a_segment_of_their_own(http, server, ct, tiny_model):
    """A client that re-renders the chat each turn (verifiers 0.4's default renderer) sends ids where the earlier
    reply is re-tokenized; where those differ from the sampled ids, the model is sampled after the client's ids and a
    new segment records exactly that (the earlier reply as prompt tokens), never a mix."""
    url = "/s/{}/v1/chat/completions"
    extra = {"logprobs": True, "return_token_ids": True, "max_tokens": 12}
    new = [{"role": "user", "content": "Why?"}]
    for seed in range(40):  # a sampled reply whose text tokenizes to other ids than were sampled
        sid = f"rr{seed}"
        first = http.post(url.format(sid), json={"model": MODEL, "messages": CHAT, "seed": seed, **extra}).json()
        reply = first["choices"][0]
        messages = [*CHAT, reply["message"], *new]
        rendered = _render(ct, messages)
        kept = first["prompt_token_ids"] + reply["token_ids"]
        if reply["finish_reason"] == "stop" and rendered[: len(kept)] != kept:
            break
    else:
        raise AssertionError("no seed gave a reply that re-tokenizes differently")
    r = http.post(url.format(sid) + "/tokens", json={"model": MODEL, "messages": messages, "tokens": rendered, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == rendered
    snap = server.session(sid)
    assert len(snap["segments"]) == 2 and snap["divergences"] == 1
    assert snap["segments"][0]["ids"] == kept  # the first reply, as sampled
    seg = snap["segments"][1]
    assert seg["ids"] == rendered + r.json()["choices"][0]["token_ids"]
    assert not any(seg["assistant_mask"][: len(rendered)])
    _check_segment(seg, tiny_model)


def test_generate_route_two_turns_one_segment(http, server, ct, tiny_model):
    prompt = _render(ct, CHAT)
    params = {"max_tokens": 12, "logprobs": 1, "skip_special_tokens": False, "stop_token_ids": list(ct.stop_ids)}

    seed, first = _first_complete_turn(
        lambda b: http.post(
            "/inference/v1/generate", json=b, headers={"X-Session-Id": f"gen{b['sampling_params']['seed']}"}
        ),
        lambda s: {"model": MODEL, "token_ids": prompt, "sampling_params": {**params, "seed": s}},
    )
    choice = first["choices"][0]
    assert first["prompt_token_ids"] == prompt and choice["token_ids"][-1] in ct.stop_ids
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{i}" for i in choice["token_ids"]]
    reply = {"role": "assistant", "content": ct.decode(choice["token_ids"][:-1])}
    new = [{"role": "user", "content": "Another one?"}]
    ids = prompt + choice["token_ids"] + _continuation(http, [*CHAT, reply, *new], choice["token_ids"], new)
    sid = {"X-Session-Id": f"gen{seed}"}
    r = http.post(
        "/inference/v1/generate", json={"token_ids": ids[:-3] + [5, 6, 7], "sampling_params": params}, headers=sid
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_ids", r.text
    r = http.post("/inference/v1/generate", json={"token_ids": ids, "sampling_params": params}, headers=sid)
    assert r.status_code == 200, r.text
    snap = server.session(f"gen{seed}")
    assert len(snap["segments"]) == 1 and snap["requests"] == 2
    seg = snap["segments"][0]
    assert seg["ids"] == ids + r.json()["choices"][0]["token_ids"]
    _check_segment(seg, tiny_model)


def test_generate_refuses_what_it_cannot_honour(http, ct):
    prompt = _render(ct, CHAT)
    for body, param in (
        ({"token_ids": prompt, "stream": True}, "stream"),
        ({"token_ids": prompt, "sampling_params": {"logprobs": 5}}, "logprobs"),
        ({"token_ids": prompt, "sampling_params": {"stop_token_ids": [5]}}, "sampling_params.stop_token_ids"),
        ({"token_ids": prompt, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": prompt[:-2]}, "token_ids"),
        ({"token_ids": prompt, "model": "other"}, "model"),
    ):
        r = http.post("/inference/v1/generate", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (body, r.text)


def test_completions_on_prompt_ids_with_the_openai_client(request, server, http, ct, tiny_model):
    client = openai.OpenAI(base_url=server.base_url(), api_key="x", max_retries=0)
    request.addfinalizer(client.close)
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    sid = {}
    prompt = _render(ct, CHAT)
    other = _render(ct, [{"role": "user", "content": "Name a fruit."}])
    for seed in range(40):  # a batch of two prompts: two segments of one session
        sid = {"X-Session-Id": f"cmp{seed}"}
        r = client.completions.create(
            model=MODEL,
            prompt=[prompt, other],
            max_tokens=12,
            logprobs=0,
            seed=seed,
            extra_body=extra,
            extra_headers=sid,
        )
        if r.choices[0].finish_reason == "stop":
            break
    first = r.model_dump()["choices"][0]
    assert first["prompt_token_ids"] == prompt and first["token_ids"][-1] in ct.stop_ids
    assert first["text"] == ct.decode(first["token_ids"][:-1])
    assert first["logprobs"]["tokens"] == [f"token_id:{i}" for i in first["token_ids"]]
    assert r.model_dump()["choices"][1]["prompt_token_ids"] == other
    reply = {"role": "assistant", "content": first["text"]}
    new = [{"role": "user", "content": "Another one?"}]
    ids = prompt + first["token_ids"] + _continuation(http, [*CHAT, reply, *new], first["token_ids"], new)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=ids[:-1] + [7], max_tokens=12, extra_headers=sid)
    assert e.value.code == "prompt_ids_mismatch" and e.value.param == "prompt"
    text = ct.decode(ids)  # a text prompt is tokenized as vLLM does: markup included
    r = client.completions.create(
        model=MODEL, prompt=text, max_tokens=12, logprobs=0, seed=1, extra_body=extra, extra_headers=sid
    )
    assert r.model_dump()["choices"][0]["prompt_token_ids"] == ids
    snap = server.session(sid["X-Session-Id"])
    assert len(snap["segments"]) == 2 and snap["requests"] == 3
    seg = next(s for s in snap["segments"] if s["ids"][: len(prompt)] == prompt)
    assert seg["ids"] == ids + r.choices[0].model_dump()["token_ids"]
    _check_segment(seg, tiny_model)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, echo=True)
    assert e.value.param == "echo"


def test_sglang_generate_as_slime_sends_it(http, server, ct, tiny_model):
    prompt = _render(ct, CHAT)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12, "stop": None}
    params |= {"stop_token_ids": list(ct.stop_ids), "skip_special_tokens": False, "no_stop_trim": True}
    params |= {"spaces_between_special_tokens": False}
    seed, first = _first_complete_turn(
        lambda b: http.post("/s/sgl{}/generate".format(b["sampling_params"]["sampling_seed"]), json=b),
        lambda s: {"input_ids": prompt, "sampling_params": {**params, "sampling_seed": s}, "return_logprob": True},
        finished=lambda r: r["meta_info"]["finish_reason"]["type"] == "stop",
    )
    out = first["output_ids"]
    assert [t[1] for t in first["meta_info"]["output_token_logprobs"]] == out and out[-1] in ct.stop_ids
    assert first["text"] == ct.decode(out[:-1]) and first["meta_info"]["prompt_tokens"] == len(prompt)
    reply = {"role": "assistant", "content": first["text"]}
    new = [{"role": "user", "content": "Another one?"}]
    ids = prompt + out + _continuation(http, [*CHAT, reply, *new], out, new)
    body = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
    r = http.post(f"/s/sgl{seed}/generate", json=body)
    assert r.status_code == 200, r.text
    seg = server.session(f"sgl{seed}")["segments"]
    assert len(seg) == 1 and seg[0]["ids"] == ids + r.json()["output_ids"]
    _check_segment(seg[0], tiny_model)
    lps = [t[0] for t in r.json()["meta_info"]["output_token_logprobs"]]
    assert lps == pytest.approx(seg[0]["log_probs"][len(ids) :], abs=1e-6)
    batch = http.post("/generate", json={"input_ids": [prompt, prompt], "sampling_params": params}).json()
    assert isinstance(batch, list) and len(batch) == 2 and "output_token_logprobs" not in batch[0]["meta_info"]
    for bad, param in (({"stream": True}, "stream"), ({"text": "hi"}, "text"), ({"input_ids": ids[:-2]}, "input_ids")):
        r = http.post("/generate", json={"input_ids": prompt, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
