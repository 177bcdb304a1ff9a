"""Forced tool calls: ``tool_choice`` ``required`` / a named function by constrained decoding, in every dialect.

The policy is the real transformers wrapper on the tiny random Llama with SmolLM2's tools template (hermes calls);
a random model left alone writes no call, so every call below is the constraint's doing. A forced reply is read back
as a call of an offered function whose arguments are JSON with the schema's required keys, and its recorded
log-probs are checked against an independent computation: one forward pass over the recorded ids, each step's
logits restricted to what a fresh grammar matcher (replaying the reply) allows, renormalized (the distribution
sampled from: the policy's, temperature 1, restricted to the grammar's tokens).
"""

import functools
import json

import anthropic
import httpx
import openai
import pytest
import torch

from chatenv import chat_tokenizer
from chatenv.errors import TemplateError
from chatenv.templates import get_template
from chatenv.templates.forced_calls import call_frame, first_call_grammar, forced_call_grammar

xg = pytest.importorskip("xgrammar")
torch.set_num_threads(1)

MODEL = "chatenv-policy"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Weather.", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "clock",
            "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]},
        },
    },
]


@pytest.fixture(scope="module")
def ct(tokenizer):
    return chat_tokenizer(tokenizer, get_template("smollm2-tools"))


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    from chatenv.serve import CaptureServer
    from wrappers.policies import TransformersWrapper

    policy = TransformersWrapper(
        tiny_model,
        tokenizer=tokenizer,
        template=get_template("smollm2-tools"),
        input_mode="tokens",
        generate_kwargs={"max_new_tokens": 64},
    )
    with CaptureServer(policy) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url(), api_key="x", max_retries=0, timeout=60) as c:
        yield c


@functools.cache
def _info(tokenizer, stop_ids):
    return xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=list(stop_ids))


def matcher(tokenizer, grammar, stop_ids):
    return xg.GrammarMatcher(xg.GrammarCompiler(_info(tokenizer, tuple(stop_ids))).compile_grammar(grammar))


def constrained_reference(model, tokenizer, ids, reply_len, grammar, stop_ids):
    """log p(reply token | prefix) under the model's logits restricted to the grammar's tokens (one forward pass)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(ids) - reply_len - 1 : -1].float()
    m = matcher(tokenizer, grammar, stop_ids)
    out = []
    for t, token in enumerate(ids[len(ids) - reply_len :]):
        bitmask = xg.allocate_token_bitmask(1, logits.shape[-1])
        m.fill_next_token_bitmask(bitmask)
        masked = logits[t : t + 1].clone()
        xg.apply_token_bitmask_inplace(masked, bitmask)
        step = masked[0].log_softmax(-1)
        out.append((float(step[token]), int(step.isfinite().sum())))
        assert m.accept_token(token), f"the grammar refuses the recorded token at {t}"
    return out


def check_call(call, names, schema=WEATHER):
    assert call["name"] in names
    args = json.loads(call["arguments"]) if isinstance(call["arguments"], str) else call["arguments"]
    assert isinstance(args, dict) and set(schema["required"]) <= set(args)


def test_required_call_is_valid_and_scored_as_sampled(client, server, ct, tiny_model, tokenizer):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS[:1],
        tool_choice="required",
        parallel_tool_calls=False,
        logprobs=True,
        extra_headers={"X-Session-Id": "forced"},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0].function.model_dump(), ["weather"])
    (segment,) = httpx.get(f"{server.url}/v1/sessions/forced").json()["segments"]
    sent = [e.logprob for e in choice.logprobs.content]
    grammar = forced_call_grammar(ct, TOOLS[:1], parallel=False)
    ref = constrained_reference(tiny_model, tokenizer, segment["ids"], len(sent), grammar, ct.stop_ids)
    assert sent == pytest.approx([lp for lp, _ in ref], abs=1e-4)
    # where the frame leaves one token, the forced token is certain; the end-of-turn is the grammar's only end
    assert all(lp == 0.0 for lp, n in ref if n == 1) and any(n > 1 for _, n in ref)
    assert segment["ids"][-1] in ct.stop_ids


def test_named_function_in_every_dialect(client, server):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "clock"}}
    )
    clock = TOOLS[1]["function"]["parameters"]
    check_call(r.choices[0].message.tool_calls[0].function.model_dump(), ["clock"], clock)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    resp = client.responses.create(
        model=MODEL, input=ASK[0]["content"], tools=tools, tool_choice={"type": "function", "name": "weather"}
    )
    calls = [item for item in resp.output if item.type == "function_call"]
    assert calls and all(c.name == "weather" for c in calls)
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=60) as claude:
        tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
        msg = claude.messages.create(
            model=MODEL,
            max_tokens=64,
            messages=ASK,
            tools=tools,
            tool_choice={"type": "tool", "name": "weather", "disable_parallel_tool_use": True},
        )
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert msg.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "weather"
        assert {"city", "unit"} <= set(uses[0].input)
        msg = claude.messages.create(model=MODEL, max_tokens=64, messages=ASK, tools=tools, tool_choice={"type": "any"})
        assert msg.stop_reason == "tool_use"


def test_refusals_name_the_field(client):
    with pytest.raises(openai.BadRequestError, match="needs 'tools'"):
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="'nope', which is not among the tools"):
        client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    with pytest.raises(openai.BadRequestError, match="tool_choice.*not supported"):
        client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice={"type": "allowed_tools"})


def test_one_call_at_most_without_forcing(client, ct, tokenizer):
    """``parallel_tool_calls: false`` with ``auto``: free text, then at most one call, which ends the reply."""
    grammar = first_call_grammar(ct, TOOLS)
    one = '<tool_call>\n{"name": "clock", "arguments": {"zone": "utc"}}\n</tool_call>'
    for text, ok in (("Just text", True), ("Let me look.\n" + one, True), (one + "\n" + one, False)):
        m = matcher(tokenizer, grammar, ct.stop_ids)
        assert bool(m.accept_string(text) and m.accept_token(ct.stop_ids[0])) == ok, text
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=24)
    assert len(r.choices[0].message.tool_calls or []) <= 1


def test_grammar_follows_parallel_and_the_templates_frame(ct, tokenizer):
    one = '<tool_call>\n{"name": "clock", "arguments": {"zone": "utc"}}\n</tool_call>'
    two = one + "\n" + one
    for parallel, accepts_two in ((True, True), (False, False)):
        grammar = forced_call_grammar(ct, TOOLS, parallel=parallel)
        m = matcher(tokenizer, grammar, ct.stop_ids)
        assert matcher(tokenizer, grammar, ct.stop_ids).accept_string(one)  # one call: either way
        m = matcher(tokenizer, grammar, ct.stop_ids)
        assert bool(m.accept_string(two)) == accepts_two
    bad = '<tool_call>\n{"name": "clock", "arguments": {"zone": "mars"}}\n</tool_call>'  # off the schema's enum
    assert not matcher(tokenizer, forced_call_grammar(ct, TOOLS), ct.stop_ids).accept_string(bad)


@pytest.mark.slow
def test_frames_are_read_from_the_template_and_refused_where_arguments_are_not_json():
    from helpers import corpus_tokenizer

    pytest.importorskip("trl")
    llama = call_frame(chat_tokenizer(corpus_tokenizer("llama3_1")))
    assert (llama.format, llama.between) == ("llama3_json", '", "parameters": ')
    qwen3 = call_frame(chat_tokenizer(corpus_tokenizer("qwen3")))  # its reply prefix (a closed think block) first
    assert qwen3.before.startswith("<think>") and qwen3.before.endswith('<tool_call>\n{"name": "')
    with pytest.raises(TemplateError, match="'qwen3_xml' format"):
        call_frame(chat_tokenizer(corpus_tokenizer("nemotron_3_nano")))


@pytest.mark.slow
def test_vllm_forced_call_is_valid_and_scored_as_sampled(vllm_engine, tiny_model, tokenizer, ct):
    from wrappers.policies import VLLMWrapper

    grammar = forced_call_grammar(ct, TOOLS[:1], parallel=False)
    policy = VLLMWrapper(
        vllm_engine,
        input_mode="tokens",
        template=get_template("smollm2-tools"),
        generate_kwargs={"max_new_tokens": 64, "grammar": grammar, "seed": 2},
    )
    prompt = ct.encode(ASK, add_generation_prompt=True, tools=TOOLS[:1]).ids.tolist()
    (sample,) = policy._generate_ids([prompt], policy.settings)[0]
    assert sample.finished and sample.ids[-1] in ct.stop_ids
    parsed = ct.parse_tool_calls(sample.ids[:-1])
    assert parsed.canonical and [c.name for c in parsed.calls] == ["weather"]
    ref = constrained_reference(tiny_model, tokenizer, prompt + sample.ids, len(sample.ids), grammar, ct.stop_ids)
    assert sample.log_probs.tolist() == pytest.approx([lp for lp, _ in ref], abs=2e-3)
