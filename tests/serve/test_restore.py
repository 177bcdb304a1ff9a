"""Replies sent back without their reasoning, or re-spaced, continue the one recorded segment (``restored``)."""

import pytest

from chatenv import chat_tokenizer
from chatenv.serve.messages import sent_back
from chatenv.serve.sessions import Choice, Session

OPENING = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def ct(tokenizer):
    return chat_tokenizer(tokenizer)


def _first_turn(ct, text):
    session = Session("s")
    reply = {"role": "assistant", "content": text}
    ids = ct.reply(OPENING, reply).ids.tolist()
    first = session.plan(ct, OPENING, None)
    session.commit(first, [Choice(ids, [-0.5] * len(ids), reply, True, "stop")])
    return session, ids


@pytest.mark.parametrize("sent", ["5", " 5\n", "<think>2+3 is 5.</think> 5"])
def test_a_reply_without_its_reasoning_continues_the_segment(ct, sent):
    session, ids = _first_turn(ct, "<think>2+3 is 5.</think> 5")
    follow = [*OPENING, {"role": "assistant", "content": sent}, {"role": "user", "content": "And 3+4?"}]
    plan = session.plan(ct, follow, None)
    assert not plan.new
    start = len(session.segments[0])
    assert plan.ids[start : start + len(ids)] == ids  # the sampled ids, not a render of what the client sent
    assert plan.mask[start : start + len(ids)] == [True] * len(ids)
    session.commit(plan, [Choice([2], [-1.0], {"role": "assistant", "content": ""}, True, "stop")])
    data = session.snapshot()
    assert len(data["segments"]) == 1 and data["divergences"] == 0
    assert data["restored"] == (0 if sent.startswith("<think>") else 1)


@pytest.mark.parametrize("sent", ["6", "5 (checked)", "<think>other</think> 6"])
def test_a_reply_whose_words_changed_starts_a_new_segment(ct, sent):
    session, _ = _first_turn(ct, "<think>2+3 is 5.</think> 5")
    follow = [*OPENING, {"role": "assistant", "content": sent}, {"role": "user", "content": "And 3+4?"}]
    plan = session.plan(ct, follow, None)
    assert plan.new and not plan.restored


def test_sent_back_compares_everything_but_reasoning_and_spacing():
    recorded = {"role": "assistant", "content": "<think>r</think>\nok", "reasoning_content": "x"}
    assert sent_back({"role": "assistant", "content": "<think>r</think>\nok"}, recorded) == "same"
    assert sent_back({"role": "assistant", "content": "ok"}, recorded) == "restored"
    assert sent_back({"role": "user", "content": "ok"}, recorded) is None
    assert (
        sent_back({"role": "assistant", "content": "<think>added</think> ok"}, {"role": "assistant", "content": "ok"})
        is None
    )
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    with_call = {"role": "assistant", "content": "<think>r</think>", "tool_calls": [call]}
    assert sent_back({"role": "assistant", "content": "", "tool_calls": [call]}, with_call) == "restored"
    other = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": {"a": 2}}}
    assert sent_back({"role": "assistant", "content": "", "tool_calls": [other]}, with_call) is None
