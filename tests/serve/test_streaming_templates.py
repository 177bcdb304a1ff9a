"""Streamed replies join to the served reply for every chat template TRL ships (reasoning, content, tool calls).

Each template gets SmolLM2's real tokenizer with the template's markers added (as ``chatenv check --template``
does); replies are the ids the template writes for a message (with reasoning, plain, with tool calls, cut short),
fed to :class:`~chatenv.serve.streaming.LiveReply` one token at a time. At every step what was sent is a prefix of
the reply the endpoint returns (:func:`~chatenv.serve.replies.make_choice`), and once complete the rest joins to it.
"""

import pytest
from helpers import corpus_tokenizer, template_corpus
from test_live_reply import final_content, request_for

from chatenv import chat_tokenizer
from chatenv.serve.streaming import LiveReply

pytestmark = pytest.mark.slow  # every template TRL ships
pytest.importorskip("trl")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": SCHEMA}}]
CALL = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
CHAT = [{"role": "user", "content": "Add 2 and 3, then say hello."}]


def _replies(ct):
    """Reply ids the template writes: plain, with reasoning, with a tool call (after reasoning), cut short."""
    fmt = ct.reasoning_format
    plain = {"role": "assistant", "content": "Hello! 2 + 3 = 5, 日本語 🙂.\n\nDone."}
    out = {"plain": ct.reply(CHAT, plain).ids.tolist()}
    opened = fmt is not None and fmt.prompt == "open"
    if fmt is not None and fmt.key is not None:
        out["reasoning"] = ct.reply(CHAT, {**plain, fmt.key: "2 plus 3 makes 5."}).ids.tolist()
    elif opened:  # the prompt opened the reasoning: the model writes it and closes it
        think = ct.encode_content("2 plus 3 makes 5.") + ct.encode_markup(fmt.close)
        out["reasoning"] = think + out["plain"]
    if ct.tool_format is not None:
        call = ct.reply(CHAT, {"role": "assistant", "content": "", "tool_calls": [CALL]}, tools=TOOLS).ids.tolist()
        if opened and (fmt.close.strip() or fmt.close) not in ct.decode(call):
            call = ct.encode_content("I add them.") + ct.encode_markup(fmt.close) + call
        out["call"] = call
    out["cut"] = out.get("reasoning", out["plain"])[: max(3, len(out["plain"]) // 2)]
    return out


def _stream(ct, request, ids):
    live = LiveReply(ct, request)
    choice, content = final_content(ct, ids, request)
    reasoning = choice.message.get("reasoning_content") or ""
    sent_r, sent_c = "", ""
    for k in range(len(ids)):
        thought, piece = live.feed_parts(ids[k : k + 1])
        sent_r, sent_c = sent_r + thought, sent_c + piece
        assert reasoning.startswith(sent_r), (sent_r, reasoning)
        assert content.startswith(sent_c), (sent_c, content)
    assert sent_r + live.finish_reasoning(choice) == reasoning
    assert sent_c + live.finish(choice, content) == content
    return choice, sent_r, sent_c


@pytest.mark.parametrize("name", template_corpus())
def test_streamed_replies_join_to_the_served_reply(name):
    ct = chat_tokenizer(corpus_tokenizer(name))
    streamed_before_end = 0
    for kind, ids in _replies(ct).items():
        for tools in (False, True):
            if tools and ct.tool_format is None:
                continue
            choice, sent_r, sent_c = _stream(ct, request_for(tools), ids)
            streamed_before_end += bool(sent_r or sent_c)
            if kind == "call" and tools:
                assert choice.finish_reason == "tool_calls", (name, choice.message)
                assert "add" not in sent_c, (name, sent_c)  # no call markup went out as content
            if kind == "reasoning" and choice.message.get("reasoning_content"):
                assert "2 plus 3" not in choice.message["content"], (name, choice.message)
                assert sent_r, (name, "the reasoning streamed only at the end")
    assert streamed_before_end, name  # some text left before the end of every template's replies
