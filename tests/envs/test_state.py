"""The one episode-state type: envs' episodes and the endpoint's segments grow the same token-exact chat."""

import math

import numpy as np
import pytest

from chatenv import ChatEnv, chat_tokenizer
from chatenv.envs.state import EpisodeState, open_chat
from chatenv.serve.sessions import Choice, Session
from chatenv.tasks import ArithmeticTask

OPENING = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def ct(tokenizer):
    return chat_tokenizer(tokenizer)


def _reply(ct, messages, text):
    reply = {"role": "assistant", "content": text}
    return reply, ct.reply(messages, reply).ids.tolist()


def test_plan_changes_nothing_and_commit_appends_exactly_the_planned_ids(ct):
    state = EpisodeState(ct, OPENING)
    before = (state.token_ids.copy(), state.assistant_mask.copy(), state.messages)
    reply, ids = _reply(ct, OPENING, "5")
    user = [{"role": "user", "content": "And 3+4?"}]
    ext = state.plan(reply, ids, True, user, log_probs=[-0.5] * len(ids))
    assert np.array_equal(state.token_ids, before[0]) and state.messages == before[2]  # planning changed nothing
    ids_after, mask_after, lps_after = state.view_after(ext)
    assert state.tokens_after(ext) == len(ids_after) == len(before[0]) + len(ids) + len(ext.cont_ids)
    assert state.commit(ext) is False
    # the ids are the kept ones plus the reply verbatim plus only the new tokens: equal to a full render here
    full = ct.encode([*OPENING, reply, *user], add_generation_prompt=True)
    assert state.token_ids.tolist() == ids_after == full.ids.tolist()
    assert state.assistant_mask.tolist() == mask_after == full.assistant_mask.tolist()
    lps = state.log_probs
    assert np.allclose(lps[len(before[0]) : len(before[0]) + len(ids)], -0.5)
    assert np.isnan(lps[: len(before[0])]).all() and np.isnan(lps[len(before[0]) + len(ids) :]).all()
    assert [math.isnan(v) for v in lps_after] == [math.isnan(v) for v in lps.tolist()]
    assert state.messages == [*OPENING, reply, *user]


def test_log_probs_of_another_length_are_refused(ct):
    state = EpisodeState(ct, OPENING)
    reply, ids = _reply(ct, OPENING, "5")
    wrong = [0.0] * (len(ids) + 3)
    with pytest.raises(ValueError, match=f"{len(wrong)} log-probs for a reply of {len(ids)} ids"):
        state.plan(reply, ids, True, log_probs=wrong)


def test_a_fork_is_independent(ct):
    state = EpisodeState(ct, OPENING, keep_text=True)
    fork = state.fork()
    reply, ids = _reply(ct, OPENING, "5")
    fork.commit(fork.plan(reply, ids, True, [{"role": "user", "content": "ok"}]))
    assert len(fork) > len(state) and state.messages == OPENING
    assert fork.text.startswith(state.text) and fork.text == ct.decode(fork.token_ids.tolist())


def test_generated_mask_marks_only_the_replies_added(ct):
    opening = [*OPENING, {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 3+4?"}]
    envlike, recorded = EpisodeState(ct, opening), EpisodeState(ct, opening, generated_mask=True)
    assert envlike.assistant_mask.any() and not recorded.assistant_mask.any()  # the opening's assistant text
    assert np.array_equal(envlike.token_ids, recorded.token_ids)
    reply, ids = _reply(ct, opening, "7")
    ext = recorded.plan(reply, ids, True, [{"role": "user", "content": "thanks"}])
    recorded.commit(ext)
    mask = recorded.assistant_mask
    start = len(envlike)
    assert mask[start : start + len(ids)].all() and mask.sum() == len(ids)


def test_an_env_episode_and_an_endpoint_segment_record_the_same_chain(ct, tokenizer):
    """The same opening and reply, as an env step and as two endpoint requests, give the same ids."""
    env = ChatEnv("arithmetic", input_mode="tokens", tokenizer=tokenizer, max_turns=3)
    env.reset(seed=0, options={"messages": OPENING, "answer": 5})
    reply, ids = _reply(env.chat_tokenizer, OPENING, "4")
    env.step(ids)  # wrong: the task answers with feedback
    feedback = env.messages[len(OPENING) + 1 :]
    assert feedback and feedback[0]["role"] == "user"

    session = Session("s")
    first = session.plan(env.chat_tokenizer, OPENING, None)
    session.commit(first, [Choice(ids, [-1.0] * len(ids), reply, True, "stop")])
    second = session.plan(env.chat_tokenizer, [*OPENING, reply, *feedback], None)
    assert not second.new  # the request extends the segment through the reply
    assert second.ids == env.token_ids.tolist()
    assert second.log_probs[len(first.ids) : len(first.ids) + len(ids)] == [-1.0] * len(ids)


def test_open_chat_draws_from_the_task_or_takes_the_given_opening():
    task = ArithmeticTask()
    drawn, state = open_chat(task, np.random.default_rng(0), None)
    again, state2 = open_chat(task, np.random.default_rng(0), {})
    assert drawn == again and state == state2 and drawn[-1]["role"] == "user"
    given, given_state = open_chat(task, np.random.default_rng(0), {"messages": OPENING, "answer": 5})
    assert given == OPENING and given_state is not None
    assert open_chat(None, np.random.default_rng(0), {"messages": OPENING}) == (OPENING, None)
    with pytest.raises(ValueError, match="no task to draw an opening from"):
        open_chat(None, np.random.default_rng(0), None)
    with pytest.raises(TypeError, match="reset options must be a dict"):
        open_chat(task, np.random.default_rng(0), ["messages"])
