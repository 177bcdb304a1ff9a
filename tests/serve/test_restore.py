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
    assert sent_back(dict(recorded), recorded) == "same"
    assert sent_back({"role": "assistant", "content": "<think>r</think>\nok"}, recorded) == "restored"  # no field
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


def test_only_assistant_replies_are_restored_and_never_by_guessing(ct):
    assert sent_back({"role": "user", "content": "hello"}, {"role": "user", "content": "hello  "}) is None
    assert sent_back({"role": "user", "content": "x"}, {"role": "user", "content": "<think>a</think>x"}) is None
    with_reasoning = {"role": "assistant", "content": "ok", "reasoning_content": "because"}
    assert sent_back({"role": "assistant", "content": "ok"}, with_reasoning) == "restored"
    assert sent_back({"role": "assistant", "content": "ok", "reasoning_content": "other"}, with_reasoning) is None
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    renamed = {**call, "id": "c9"}
    recorded = {"role": "assistant", "content": "", "tool_calls": [call]}
    assert sent_back({"role": "assistant", "content": "", "tool_calls": [renamed]}, recorded) is None

    session = Session("s")
    replies = [{"role": "assistant", "content": " B"}, {"role": "assistant", "content": "B"}]
    choices = [
        Choice(ids, [-0.1] * len(ids), r, True, "stop") for r in replies for ids in [ct.reply(OPENING, r).ids.tolist()]
    ]
    session.commit(session.plan(ct, OPENING, None), choices)
    follow = [*OPENING, {"role": "assistant", "content": "B"}, {"role": "user", "content": "ok"}]
    plan = session.plan(ct, follow, None)
    assert plan.choice == 1 and not plan.restored  # the reply sent back exactly, not the first that restores to it

    session = Session("t")
    replies = [
        {"role": "assistant", "content": "<think>r0</think>A"},
        {"role": "assistant", "content": "<think>r1</think>A"},
    ]
    choices = [
        Choice(ids, [-0.1] * len(ids), r, True, "stop") for r in replies for ids in [ct.reply(OPENING, r).ids.tolist()]
    ]
    session.commit(session.plan(ct, OPENING, None), choices)
    follow = [*OPENING, {"role": "assistant", "content": "A"}, {"role": "user", "content": "ok"}]
    assert session.plan(ct, follow, None).new  # two replies it could be: a new segment, never a guess


def test_malformed_json_is_a_400_not_a_500(tiny_model, tokenizer):
    import httpx

    from chatenv.serve import CaptureServer
    from wrappers.policies import TransformersWrapper

    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 2}
    )
    with CaptureServer(policy) as server:
        url = server.base_url() + "/chat/completions"
        for body in ('{"n": ' + "1" * 5000 + "}", "[" * 100000 + "]" * 100000, b"\xff\xfe"):
            r = httpx.post(url, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
