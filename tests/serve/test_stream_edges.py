"""Edges of streamed replies found in review: split characters next to stop strings and markers, reasoning that ends
in a split character, stop strings with reasoning, old policy subclasses, deltas merged with and without log-probs.

Each dialect's writer is fed the ids token by token (as the endpoint feeds it) and must join to its non-streaming
body; the templates are real (SmolLM2's, and Qwen3's from TRL's corpus on SmolLM2's tokenizer).
"""

import json
import math

import pytest
from helpers import corpus_tokenizer
from test_live_reply import request_for, stream

from chatenv import chat_tokenizer
from chatenv.serve.anthropic.output import MessagesStreamWriter, message_body
from chatenv.serve.chat.request import parse_request
from chatenv.serve.engine import Generated, Job, PolicyRunner
from chatenv.serve.replies import make_choice
from chatenv.serve.responses.output import ResponsesRequest, ResponsesStreamWriter, response_body
from chatenv.serve.service import Completion
from chatenv.serve.streaming import _merged
from wrappers.policies import TransformersWrapper


@pytest.fixture(scope="module")
def qwen3():
    pytest.importorskip("trl")
    return chat_tokenizer(corpus_tokenizer("qwen3"))


def events(lines):
    return [json.loads(e.split("data: ", 1)[1]) for e in lines if "data: " in e and "[DONE]" not in e]


class Live:
    def __init__(self, ct):
        self.chat_tokenizer, self.prompt_tokens = ct, 3


def streamed(writer, ct, ids, done):
    out = writer.start(Live(ct))
    for i in ids:
        out += writer.delta(0, [i], None)
    return events(out + writer.finish(done))


def request(**extra):
    return parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})


@pytest.mark.parametrize("stop", ["bye 你好", "Q：", "→ 42"])
def test_a_stop_string_whose_character_is_split_across_tokens_is_never_sent(tokenizer, stop):
    ct = chat_tokenizer(tokenizer)
    ids = ct.encode_content(f"ok then {stop} more")
    cut = next(k for k in range(1, len(ids) + 1) if stop in ct.decode(ids[:k]))  # where the policy stops
    sent, rest, content = stream(ct, request_for(False, stops=[stop]), ids[:cut])
    assert sent + rest == content == ct.decode(ids[:cut]).split(stop)[0]


def test_a_marker_spelled_with_a_split_character_is_never_sent():
    pytest.importorskip("trl")
    ct = chat_tokenizer(corpus_tokenizer("deepseekv3"))
    call = {"id": "c0", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    schema = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    chat = [{"role": "user", "content": "x"}]
    ids = ct.reply(chat, {"role": "assistant", "content": "", "tool_calls": [call]}, tools=[schema]).ids.tolist()
    ids = ct.encode_content(ct.decode(ids[:-1])) + ids[-1:]  # the markers spelled as text, byte by byte
    sent, rest, content = stream(ct, request_for(True), ids)
    assert content.startswith(sent) and sent + rest == content


def test_reasoning_that_ends_in_a_split_character_streams_as_it_is_returned(qwen3):
    emoji = qwen3.encode_content("😀")
    think = qwen3.encode_markup("<think>") + qwen3.encode_content("\nabc") + emoji[:1] + qwen3.encode_markup("</think>")
    ids = think + qwen3.encode_content("\n\nHi there") + [qwen3.stop_ids[0]]
    req = request(max_tokens=50)
    choice = make_choice(qwen3, Generated(ids, [0.0] * len(ids)), req, "c_")
    assert choice.message["reasoning_content"] == "abc\ufffd"
    done = Completion({"created": 0, "model": "m"}, qwen3, [choice], 3, None)
    got = streamed(MessagesStreamWriter(req), qwen3, ids, done)
    starts = [e["content_block"]["type"] for e in got if e["type"] == "content_block_start"]
    assert starts == [b["type"] for b in message_body(done, req)["content"]] == ["thinking", "text"]
    thinking = "".join(e["delta"].get("thinking", "") for e in got if e["type"] == "content_block_delta")
    assert thinking == "abc\ufffd"
    got = streamed(ResponsesStreamWriter(ResponsesRequest(req)), qwen3, ids, done)
    items = [e["item"] for e in got if e["type"] == "response.output_item.done"]
    assert items == got[-1]["response"]["output"]  # what was streamed is what the response holds
    assert items[0]["content"][0]["text"] == "abc\ufffd"


def test_stop_strings_with_reasoning_cut_where_they_are_and_name_the_stop_sequence(qwen3):
    ids = qwen3.reply(
        [{"role": "user", "content": "x"}],
        {"role": "assistant", "reasoning_content": "abc", "content": "Hello END more"},
    ).ids.tolist()
    cut = next(k for k in range(1, len(ids)) if "END" in qwen3.decode(ids[:k]))
    req = request(max_tokens=50, stop=["END"])
    choice = make_choice(qwen3, Generated(ids[:cut], [0.0] * cut), req, "c_")
    assert choice.message == {"role": "assistant", "content": "Hello ", "reasoning_content": "abc"}
    assert (choice.finish_reason, choice.stop_string) == ("stop", "END")
    body = message_body(Completion({"created": 0}, qwen3, [choice], 3, None), req)
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    inside = qwen3.reply(
        [{"role": "user", "content": "x"}], {"role": "assistant", "reasoning_content": "ab END cd", "content": "Hi"}
    ).ids.tolist()
    cut = next(k for k in range(1, len(inside)) if "END" in qwen3.decode(inside[:k]))
    choice = make_choice(qwen3, Generated(inside[:cut], [0.0] * cut), req, "c_")
    assert choice.message == {"role": "assistant", "content": "", "reasoning_content": "ab "}


def test_a_closed_reasoning_stays_completed_when_the_content_is_cut(qwen3):
    ids = qwen3.reply(
        [{"role": "user", "content": "x"}],
        {"role": "assistant", "reasoning_content": "abc", "content": "Hello there friend"},
    ).ids.tolist()[:-3]
    req = request(max_tokens=50)
    choice = make_choice(qwen3, Generated(ids, [0.0] * len(ids)), req, "c_")
    assert choice.finish_reason == "length"
    parsed = ResponsesRequest(req)
    done = Completion({"created": 0, "model": "m"}, qwen3, [choice], 3, None)
    body = response_body(parsed, done)
    assert [(i["type"], i["status"]) for i in body["output"]] == [("reasoning", "completed"), ("message", "incomplete")]
    got = streamed(ResponsesStreamWriter(parsed), qwen3, ids, done)
    assert [i["status"] for i in got[-1]["response"]["output"]] == [
        e["item"]["status"] for e in got if e["type"] == "response.output_item.done"
    ]
    tokens = body["usage"]["output_tokens_details"]["reasoning_tokens"]
    assert qwen3.decode(ids[:tokens]).endswith("</think>")


def test_a_policy_subclass_with_the_two_argument_hook_still_streams(tiny_model, tokenizer):
    class Old(TransformersWrapper):  # written against the hook before it took on_tokens
        def _generate_ids(self, prompts, settings):
            return super()._generate_ids(prompts, settings)

    policy = Old(tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 5})
    runner = PolicyRunner(policy)
    ids = tokenizer.encode("hello")
    got = []
    replies = runner.generate_now(Job(ids, [False] * len(ids), [], 1, {}, on_delta=lambda *a: got.append(a)))
    assert [i for _, ids_, _ in got for i in ids_] == replies[0].ids  # handed on whole, once it ended


def test_deltas_merged_per_reply_keep_one_log_prob_per_token():
    merged = _merged([(0, [1, 2], None), (1, [7], [-0.5]), (0, [3], [-1.0]), (1, [8], [-0.25])])
    assert merged[0][:2] == (0, [1, 2, 3]) and merged[1] == (1, [7, 8], [-0.5, -0.25])
    assert [math.isnan(v) for v in merged[0][2]] == [True, True, False] and merged[0][2][2] == -1.0


@pytest.mark.parametrize("which", ["smollm2", "llama3"])
def test_incremental_text_equals_decoding_everything(tokenizer, llama3_tokenizer, which):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from chatenv.serve.streaming import _Decoded

    tok = tokenizer if which == "smollm2" else llama3_tokenizer
    ct = chat_tokenizer(tok)
    pieces = ["Hello", " 日本語", "🙂", "\n\n", "  x", "<|im_end|>", "é", "→", "Q："]
    byte_ids = ct.encode_content("🙂日本")  # byte-level pieces of multi-byte characters

    @settings(max_examples=150, deadline=None)
    @given(
        st.lists(
            st.one_of(st.sampled_from(pieces).map(ct.encode_markup), st.lists(st.sampled_from(byte_ids), max_size=3)),
            max_size=25,
        ),
        st.lists(st.integers(1, 4), min_size=1, max_size=5),
    )
    def check(chunks, sizes):
        ids = [i for c in chunks for i in c]
        decoded, k, step = _Decoded(ct.decode), 0, 0
        while k < len(ids):
            n = sizes[step % len(sizes)]
            decoded.extend(ids[k : k + n])
            k, step = k + n, step + 1
            assert decoded.text() == ct.decode(ids[:k])

    check()


def test_incremental_text_of_a_byte_fallback_tokenizer_equals_decoding_everything():
    """SentencePiece-style decoding (Llama 2, Mistral, Gemma): byte tokens are written as text only as a valid run."""
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from chatenv.serve.streaming import _Decoded

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ["▁", "▁hi", "hi", "▁world", "\n", "x"]:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False)

    chars = [[vocab[f"<0x{b:02X}>"] for b in c.encode()] for c in ["😀", "日", "é", "a"]]
    words = [[vocab[w]] for w in ["▁hi", "hi", "▁world", "\n", "x"]]
    stray = [[vocab["<0xF0>"]], [vocab["<0x9F>"]]]  # bytes that never make a character

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.sampled_from(chars + words + stray), max_size=20), st.lists(st.integers(1, 9), min_size=1))
    def check(pieces, sizes):
        ids = [i for p in pieces for i in p]
        decoded, k, step = _Decoded(decode), 0, 0
        while k < len(ids):
            n = sizes[step % len(sizes)]
            decoded.extend(ids[k : k + n])
            k, step = k + n, step + 1
            assert decoded.text() == decode(ids[:k]), ids[:k]

    assert decode(chars[0] + chars[0][:1]) == "\ufffd" * 5  # an unfinished run is all replacement characters
    check()
