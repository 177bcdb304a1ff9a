"""policy.stream(td): each row's reply read token by token while it is generated, then the same output as calling
the policy; checked on the tiny random Llama (transformers) and on real vLLM engines (vllm.LLM and AsyncLLM)."""

import threading

import pytest
import torch
from helpers import async_vllm_policy, history_td
from tensordict import TensorDict

from chatenv import Tokens
from wrappers.policies import TransformersWrapper
from wrappers.policies.streaming import PolicyStream, TokenDelta

END = 2  # <|im_end|>: SmolLM2's end-of-turn, EOS and pad id
# prompts of different lengths for tokens mode (any ids: the model is random)
PROMPTS = [[1, 504, 3127, 28], [1, 9000, 17, 42, 8, 31, 2033, 77, 12], [1, 40000]]


def tokens_td(prompts=PROMPTS):
    ids = [torch.tensor(p) for p in prompts]
    return TensorDict(tokens=Tokens.from_sequences(ids, padded=True, pad_value=END), batch_size=[len(prompts)])


def read(stream):
    """Every delta of ``stream``, and per (row, sample) the ids (and log-probs) of its deltas joined."""
    deltas = list(stream)
    ids, lps = {}, {}
    for d in deltas:
        assert isinstance(d, TokenDelta) and len(d.ids) >= 1, d
        ids.setdefault((d.row, d.sample), []).extend(d.ids)
        lps.setdefault((d.row, d.sample), []).append(d.log_probs)
    return deltas, ids, lps


def responses(container, num_samples):
    """Per (row, sample), the unpadded response of a ``Tokens`` or ``LogProbs`` of a policy's output."""
    if num_samples is None:
        return {(b, 0): x for b, x in enumerate(container.unpadded("response"))}
    return {(b, k): x for b in range(container.batch_size[0]) for k, x in enumerate(container[b].unpadded("response"))}


def replies(out, num_samples):
    """Per (row, sample), the response ids of a policy's output."""
    return {key: ids.tolist() for key, ids in responses(out["tokens"], num_samples).items()}


def reply_log_probs(out, num_samples):
    """Per (row, sample), the response log-probs of a policy's output."""
    return responses(out["log_probs"], num_samples)


def assert_same_output(a, b):
    """Two policy outputs hold the same tokens, masks, log-probs and text."""
    assert a.batch_size == b.batch_size and sorted(a.keys()) == sorted(b.keys())
    for part in ("prompt", "response", "full", "prompt_length", "response_length"):
        assert torch.equal(getattr(a["tokens"], part), getattr(b["tokens"], part)), part
    for name in ("all_attention_mask", "all_assistant_mask"):
        assert torch.equal(getattr(a["masks"], name), getattr(b["masks"], name)), name
    torch.testing.assert_close(a["log_probs"].full, b["log_probs"].full, equal_nan=True, rtol=0, atol=1e-5)
    if "text" in a.keys():
        assert a["text"].full == b["text"].full
    if "history" in a.keys():
        assert a["history"].response.to_chats() == b["history"].response.to_chats()


# ------------------------------------------------------------------------------------------ transformers

CASES = {
    "greedy": ("history", {"temperature": 0, "min_new_tokens": 4}, None),
    "greedy-tokens": ("tokens", {"temperature": 0, "min_new_tokens": 2}, None),
    "sampled": ("history", {"temperature": 1.0, "seed": 3}, None),
    "sampled-n2": ("history", {"temperature": 1.0, "seed": 3}, 2),
    "sampled-tokens-n2": ("tokens", {"temperature": 1.0, "seed": 8}, 2),
}


@pytest.mark.parametrize("case", CASES)
def test_transformers_deltas_join_into_the_replies_and_result_equals_a_call(case, tiny_model, tokenizer):
    mode, settings, n = CASES[case]
    make_td = history_td if mode == "history" else tokens_td
    base = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode=mode, num_samples=n, generate_kwargs={"max_new_tokens": 24}
    )
    # two fresh siblings: the first call of each draws from the same seed
    streaming, calling = (base.get_new_version(generate_kwargs=settings) for _ in range(2))
    stream = streaming.stream(make_td())
    assert isinstance(stream, PolicyStream)
    deltas, joined, lps = read(stream)
    assert stream.done
    out = stream.result()
    assert stream.result() is out
    expected = replies(out, n)
    assert len(expected) == 3 * (n or 1)
    # every (row, sample) streamed exactly its reply: nothing before it ended was missed, nothing after it
    # (generate's padding of finished rows) was handed on
    assert joined == expected
    # token by token as generate produced them (none left for the final catch-up), with no log-probs yet
    assert all(len(d.ids) == 1 and d.log_probs is None for d in deltas)
    assert all(all(v is None for v in row) for row in lps.values())
    # step by step: the first step hands every row its first token, in row order
    assert [(d.row, d.sample) for d in deltas[: len(expected)]] == sorted(expected)
    assert_same_output(out, calling(make_td()))
    if "seed" in settings:  # rows ended at different steps: the ones that ended early got no padding
        lengths = [len(r) for r in expected.values()]
        assert min(lengths) < max(lengths)
        assert any(r[-1] == END and len(r) < max(lengths) for r in expected.values())


def test_transformers_single_row_and_history_written_in_place(tiny_model, tokenizer):
    policy = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 12, "seed": 1})
    stream = policy.stream(history_td()[1])  # batch shape (): one row
    _, joined, _ = read(stream)
    out = stream.result()
    assert out.batch_size == () and list(joined) == [(0, 0)]
    assert joined[(0, 0)] == out["tokens"].response[: int(out["tokens"].response_length)].tolist()
    # in place, like a call: the caller's tensordict holds the outputs
    full = history_td()
    stream = policy.get_new_version().stream(full)
    list(stream)
    assert stream.result() is full and "tokens" in full.keys()


def test_a_stream_counts_as_a_call_for_the_seeds(tiny_model, tokenizer):
    base = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 8, "seed": 4})
    streaming, calling = base.get_new_version(), base.get_new_version()
    first = streaming.stream(history_td()).result()
    assert_same_output(first, calling(history_td()))
    # the next call of each draws the second call's samples (not the first's again)
    second = streaming.stream(history_td()).result()
    assert_same_output(second, calling(history_td()))
    assert not torch.equal(first["tokens"].response, second["tokens"].response)


def test_transformers_stop_string_and_max_new_tokens_cut(tiny_model, tokenizer):
    settings = {"temperature": 1.0, "seed": 5, "max_new_tokens": 24}
    base = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=settings)
    uncut = replies(base.get_new_version()(history_td()), None)
    # a stop string the first reply spells a few tokens in, but not before
    first = uncut[(0, 0)]
    assert len(first) > 8, first
    stop = tokenizer.decode(first[5:7])
    cut_at = next(j for j in range(len(first)) if stop in tokenizer.decode(first[: j + 1])) + 1
    assert 5 < cut_at <= 7
    policy = base.get_new_version(generate_kwargs={"stop": [stop]})
    stream = policy.stream(history_td())
    _, joined, _ = read(stream)
    out = stream.result()
    got = replies(out, None)
    assert joined == got
    assert got[(0, 0)] == first[:cut_at] and stop in out["text"].response[0]
    for key, reply in got.items():  # the same draws: every reply is a prefix of its uncut one
        assert reply == uncut[key][: len(reply)]
    assert_same_output(out, base.get_new_version(generate_kwargs={"stop": [stop]})(history_td()))

    # max_new_tokens: replies cut at the limit, streamed up to it
    short = base.get_new_version(generate_kwargs={"max_new_tokens": 3})
    stream = short.stream(history_td())
    _, joined, _ = read(stream)
    got = replies(stream.result(), None)
    assert joined == got and all(len(r) <= 3 for r in got.values())
    assert any(len(r) == 3 and r[-1] != END for r in got.values())
    assert all(r == uncut[key][:3] for key, r in got.items())


def test_tokens_arrive_while_generating(tiny_model, tokenizer):
    """The first token reaches the reader before the generation's second step runs (it waits for the reader)."""
    policy = TransformersWrapper(
        tiny_model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate_kwargs={"max_new_tokens": 32, "ignore_eos": True, "temperature": 0},
    )
    read_first = threading.Event()
    forwards, waited = [], []

    def hold_second_step(module, args, kwargs):
        forwards.append(None)
        if len(forwards) == 2:
            waited.append(read_first.wait(timeout=10))

    handle = tiny_model.register_forward_pre_hook(hold_second_step, with_kwargs=True)
    try:
        stream = policy.stream(tokens_td(PROMPTS[:2]))
        deltas = iter(stream)
        first = next(deltas)
        running = not stream.done
        read_first.set()
        rest = list(deltas)
    finally:
        handle.remove()
    assert waited == [True], "the first token was not handed on before the generation went on"
    assert running and first.row == 0 and len(first.ids) == 1
    assert len(forwards) >= 32 and len(rest) == 2 * 32 - 1
    assert [len(r) for r in replies(stream.result(), None).values()] == [32, 32]


# ------------------------------------------------------------------------------------------ errors


class FailingWrapper(TransformersWrapper):
    """The real wrapper, whose generation fails after a few tokens were handed on (while ``fail`` is set)."""

    fail = True

    def _generate_ids(self, prompts, settings, on_tokens=None):
        handed = []

        def on_tokens_then_fail(row, ids, log_probs):
            if type(self).fail and len(handed) == 4:
                raise RuntimeError("the engine fell over")
            handed.append(ids)
            on_tokens(row, ids, log_probs)

        return super()._generate_ids(prompts, settings, on_tokens_then_fail if on_tokens is not None else None)


def test_bad_input_raises_at_once_on_the_callers_thread(tiny_model, tokenizer):
    policy = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 4, "seed": 0})
    empty = history_td()[:0]
    with pytest.raises(ValueError, match="empty batch") as streamed:
        policy.stream(empty)
    with pytest.raises(ValueError) as called:
        policy(empty)
    assert str(streamed.value) == str(called.value)
    wrong_key = tokens_td()
    with pytest.raises(KeyError, match=r"input key \('history', 'prompt'\) not found"):
        policy.stream(wrong_key)
    assert set(wrong_key.keys()) == {"tokens"}, "a refused stream wrote nothing"
    with pytest.raises(ValueError, match="batch shape"):
        policy.stream(torch.stack([history_td(), history_td()]))
    tokens_policy = policy.get_new_version(input_mode="tokens")
    with pytest.raises(ValueError, match="max_new_tokens|context"):
        tokens_policy.stream(tokens_td([[5] * 1030]))
    with pytest.raises(ValueError, match="generate=False"):
        policy.get_new_version(generate=False).stream(history_td())
    # a refused stream changed nothing: the next one is the policy's first call
    stream = policy.stream(history_td())
    list(stream)
    assert_same_output(stream.result(), policy.get_new_version()(history_td()))


def test_generation_error_is_raised_by_iterating_and_by_result(tiny_model, tokenizer):
    settings = {"max_new_tokens": 16, "temperature": 1.0, "seed": 2}
    policy = FailingWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=settings)
    stream = policy.stream(history_td())
    got = []
    with pytest.raises(RuntimeError, match="the engine fell over"):
        for delta in stream:
            got.append(delta)
    assert len(got) == 4 and stream.done
    with pytest.raises(RuntimeError, match="the engine fell over"):
        stream.result()
    with pytest.raises(RuntimeError, match="the engine fell over"):  # iterating again raises again
        list(stream)
    # result() without iterating raises it too
    stream = policy.stream(history_td())
    with pytest.raises(RuntimeError, match="the engine fell over"):
        stream.result(timeout=30)
    # the failed calls did not count: once it works, the policy samples what a fresh one's first call does
    FailingWrapper.fail = False
    try:
        stream = policy.stream(history_td())
        _, joined, _ = read(stream)
        out = stream.result()
    finally:
        FailingWrapper.fail = True
    assert joined == replies(out, None)
    fresh = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=settings)
    assert_same_output(out, fresh(history_td()))


# ------------------------------------------------------------------------------------------ vLLM


@pytest.mark.slow
def test_vllm_llm_hands_each_reply_on_when_it_ends(vllm_engine):
    from wrappers.policies import VLLMWrapper

    base = VLLMWrapper(vllm_engine, generate_kwargs={"max_new_tokens": 16, "temperature": 0, "min_new_tokens": 3})
    stream = base.get_new_version().stream(history_td())
    deltas, joined, lps = read(stream)
    out = stream.result()
    expected = replies(out, None)
    # vllm.LLM cannot stream: one delta per row, the whole reply, with its log-probs
    assert len(deltas) == 3 and sorted((d.row, d.sample) for d in deltas) == sorted(expected)
    assert joined == expected
    for key, lp in reply_log_probs(out, None).items():
        torch.testing.assert_close(torch.tensor(lps[key][0]), lp, equal_nan=True, rtol=0, atol=1e-6)
    assert_same_output(out, base.get_new_version()(history_td()))


def _served_with_log_probs(policy):
    """A greedy 24-token reply through the capture endpoint, whole and streamed with log-probs (the openai client)."""
    import openai

    from chatenv.serve import CaptureServer

    asked = {
        "model": "chatenv-policy",
        "messages": [{"role": "user", "content": "Count to ten."}],
        "temperature": 0,
        "max_tokens": 24,
        "logprobs": True,
        "extra_body": {"min_tokens": 24},
    }
    with CaptureServer(policy) as server, openai.OpenAI(base_url=server.base_url(), api_key="x") as client:
        plain = client.chat.completions.create(**asked)
        chunks = list(client.chat.completions.create(**asked, stream=True))
    return plain, chunks


@pytest.mark.slow
def test_vllm_async_engine_streams_samples_with_log_probs(tiny_model_dir):
    pytest.importorskip("vllm")
    settings = {"max_new_tokens": 32, "temperature": 1.0, "seed": 6}
    policy = async_vllm_policy(tiny_model_dir, num_samples=2, generate_kwargs=settings)
    try:
        assert policy.is_async
        stream = policy.get_new_version().stream(history_td())
        deltas, joined, lps = read(stream)
        out = stream.result()
        called = policy.get_new_version()(history_td())
        served = _served_with_log_probs(policy.get_new_version(num_samples=None, input_mode="tokens"))
    finally:
        policy.shutdown()
    plain, chunks = served
    streamed_entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed_entries] == [
        (e.token, e.logprob) for e in plain.choices[0].logprobs.content
    ]
    # the engine's log-probs travel with the content chunks, not only with the last one
    early = [c for c in chunks if c.choices and c.choices[0].delta.content and c.choices[0].logprobs.content]
    assert len(early) > 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert out.batch_size == (3, 2)
    expected = replies(out, 2)
    assert joined == expected
    # the log-probs came with the tokens, and joined they are the output's
    assert all(d.log_probs is not None and len(d.log_probs) == len(d.ids) for d in deltas)
    for key, lp in reply_log_probs(out, 2).items():
        streamed = torch.tensor([v for chunk in lps[key] for v in chunk])
        torch.testing.assert_close(streamed, lp, equal_nan=True, rtol=0, atol=1e-6)
        assert torch.isfinite(lp).all()
    # streamed as the engine produced them: some reply came in more than one delta
    counts = {key: len(chunks) for key, chunks in lps.items()}
    assert max(counts.values()) > 1, counts
    assert len({tuple(r) for r in expected.values()}) > 1  # seeded samples differ
    assert_same_output(out, called)
