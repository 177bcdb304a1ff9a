"""Templates whose replies end with several tokens, or whose past replies lose or move their reasoning.

Three small templates stand for families that once failed: a Cohere2-style one closes an assistant turn with
``<|END_RESPONSE|><|END_OF_TURN_TOKEN|>`` (a model may stop after the first token or sample both), a Gemma-4-style
one strips the thinking (``<|channel>thought ...<channel|>``) a reply holds in its content, and a
Nemotron-Super-v1.5-style one drops what precedes ``</think>`` in past replies (its prompt opens no reasoning). Each
runs three turns token-exact: ids kept as sampled, continuations as the template writes them, drift recorded where a
fresh render writes a reply differently, never an error.
"""

import numpy as np
import pytest

from chatenv import ChatEnv, chat_tokenizer
from chatenv.errors import TemplateError
from chatenv.models import load_default_tokenizer
from chatenv.tasks import Task, TaskResponse, TaskStart
from chatenv.templates.continuation import continuation_tail
from chatenv.templates.derive import tokenizer_for_template
from chatenv.templates.renderer import ChatTemplate

COHERE2_STYLE = (
    "{{ bos_token }}{% for m in messages %}<|START_OF_TURN_TOKEN|>"
    "{% if m['role'] == 'user' %}<|USER_TOKEN|>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<|CHATBOT_TOKEN|><|START_RESPONSE|>{{ m['content'] }}<|END_RESPONSE|>"
    "{% else %}<|SYSTEM_TOKEN|>{{ m['content'] }}{% endif %}<|END_OF_TURN_TOKEN|>{% endfor %}"
    "{% if add_generation_prompt %}<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>{% endif %}"
)

GEMMA_STYLE = (
    "{%- macro visible(text) -%}{%- set ns = namespace(out='') -%}"
    "{%- for part in text.split('<channel|>') -%}"
    "{%- if '<|channel>' in part -%}{%- set ns.out = ns.out + part.split('<|channel>')[0] -%}"
    "{%- else -%}{%- set ns.out = ns.out + part -%}{%- endif -%}{%- endfor -%}{{- ns.out | trim -}}{%- endmacro -%}"
    "{{ bos_token }}{%- for m in messages -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}{{ '<|turn>' + role + '\\n' }}"
    "{%- if role == 'model' -%}{{ visible(m['content']) }}{%- else -%}{{ m['content'] | trim }}{%- endif -%}"
    "{{ '<turn|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{ '<|turn>model\\n' }}{%- endif -%}"
)

NEMOTRON_STYLE = (
    "{{ bos_token }}{%- for m in messages -%}{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip() -%}{%- endif -%}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ content | trim }}<|eot_id|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)


class Questions(Task):
    """Three questions, one per turn; a reply earns 1 when it holds the question's answer."""

    def reset(self, rng):
        return TaskStart([{"role": "user", "content": "What is 1 + 1?"}], {"n": 1})

    def respond(self, messages, state):
        reward = float(str(2 * state["n"]) in messages[-1]["content"])
        state["n"] += 1
        done = state["n"] > 3
        n = state["n"]
        return TaskResponse(reward, done, [] if done else [{"role": "user", "content": f"What is {n} + {n}?"}])


@pytest.fixture(scope="module")
def base_tokenizer():
    return load_default_tokenizer()


def _episode(tok, replies):
    """Three turns with the replies ``replies(ct, messages, k)`` gives: (env, chat tokenizer, kept ids, infos)."""
    env = ChatEnv(Questions(), tokenizer=tok, input_mode="tokens")
    ct = chat_tokenizer(tok)
    env.reset(seed=0)
    kept, infos = [], []
    for k in range(1, 4):
        ids = replies(ct, env.messages, k)
        before = env.unwrapped._episode.num_tokens  # noqa: SLF001
        obs, reward, terminated, _, info = env.step(np.array(ids))
        assert reward == 1.0
        assert obs.tolist()[before : before + len(ids)] == ids  # the reply kept as sampled
        cont = obs.tolist()[before + len(ids) :]
        fresh = ct.encode(env.unwrapped.messages, add_generation_prompt=True).ids.tolist()
        assert fresh[-len(cont) :] == cont  # the continuation is what the template writes
        kept.append(ids)
        infos.append(info)
    assert terminated
    return env, ct, kept, infos


def test_cohere2_style_end_sequence(base_tokenizer):
    tok = tokenizer_for_template(COHERE2_STYLE, base_tokenizer)
    end_response, end_turn = (tok.convert_tokens_to_ids(t) for t in ("<|END_RESPONSE|>", "<|END_OF_TURN_TOKEN|>"))

    def replies(ct, messages, k):
        ids = ct.reply(messages, {"role": "assistant", "content": f"It is {2 * k}."}).ids.tolist()
        assert ids[-1] == end_response  # a reply ends at the first token of the end sequence
        return ids + [end_turn] if k == 2 else ids  # the second reply goes on with the rest of the sequence

    env, ct, kept, infos = _episode(tok, replies)
    view = env.unwrapped._episode.token_ids.tolist()  # noqa: SLF001
    mask = env.unwrapped._episode.assistant_mask.tolist()  # noqa: SLF001
    whole = ct.encode(env.unwrapped.messages, add_generation_prompt=True)
    assert view == whole.ids.tolist()  # no end token written twice: a fresh render, token for token
    assert [i["template_drift"] for i in infos] == [0, 0, 0]
    sampled = [p for p in range(len(view)) if view[p] == end_turn and mask[p]]
    assert len(sampled) == 1  # the end-of-turn token the model sampled is its own; those the env wrote are not
    expected = whole.assistant_mask.tolist()
    expected[sampled[0]] = True
    assert mask == expected
    assert ct.end_sequence_ids == (end_response, end_turn)
    assert ct.parse_response(kept[1]) == [{"role": "assistant", "content": "It is 4."}]  # nothing after the end


def _thinking_reply(ct, messages, k, opening, closing):
    """A reply whose content holds the model's thinking in its own format, then the answer."""
    answer = ct.reply(messages, {"role": "assistant", "content": f"It is {2 * k}."}).ids.tolist()
    thought = ct.encode_content(f"{k} and {k} make {2 * k}.")
    return ct.encode_markup(opening) + thought + ct.encode_markup(closing) + answer


@pytest.mark.parametrize(
    ("source", "opening", "closing"),
    [(GEMMA_STYLE, "<|channel>thought\n", "<channel|>"), (NEMOTRON_STYLE, "<think>\n", "\n</think>\n\n")],
    ids=["gemma4-style", "nemotron-style"],
)
def test_past_reasoning_stripped_or_rewritten_drifts_never_raises(base_tokenizer, source, opening, closing):
    tok = tokenizer_for_template(source, base_tokenizer)
    env, ct, kept, infos = _episode(tok, lambda ct, m, k: _thinking_reply(ct, m, k, opening, closing))
    assert all(i["template_drift"] > 0 for i in infos)  # a fresh render writes each reply without its thinking
    view = env.unwrapped._episode.token_ids.tolist()  # noqa: SLF001
    assert view != ct.encode(env.unwrapped.messages, add_generation_prompt=True).ids.tolist()
    # the kept ids are the whole trajectory: the opening, then each reply and what the template wrote after it
    mask = np.array(env.unwrapped._episode.assistant_mask.tolist())  # noqa: SLF001
    assert [i for r in kept for i in r] == np.array(view)[mask].tolist()
    # a fresh render of the chat (what an inference server shows) renders too, the thinking stripped
    text = ct.encode(env.unwrapped.messages, add_generation_prompt=True).text
    assert "1 and 1 make 2." not in text and "It is 2." in text


def test_nemotron_style_reasoning_is_read_from_the_reply(base_tokenizer):
    """Derived from the template: it strips ``<think>`` ... ``</think>`` from past replies, so a reply's reasoning
    is read into ``reasoning_content`` and the task sees the answer only."""
    tok = tokenizer_for_template(NEMOTRON_STYLE, base_tokenizer)
    ct = chat_tokenizer(tok)
    fmt = ct.reasoning_format
    assert (fmt.key, fmt.open, fmt.close, fmt.prompt) == (None, "<think>", "</think>", "none")
    ids = _thinking_reply(ct, [{"role": "user", "content": "What is 1 + 1?"}], 1, "<think>\n", "\n</think>\n\n")
    reply = {"role": "assistant", "content": "It is 2.", "reasoning_content": "1 and 1 make 2."}
    assert ct.parse_response(ids)[0] == reply


def test_a_rewrite_that_is_not_what_the_template_writes_for_it_is_refused():
    """What is located for a rewritten reply must render the same again (a template that doubles every "e" of a reply
    does not): a reply's text is never taken for markup by guessing."""
    source = GEMMA_STYLE.replace("{{ visible(m['content']) }}", "{{ visible(m['content']) | replace('e', 'ee') }}")
    template = ChatTemplate("doubling", source, context={"bos_token": ""})
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<|channel>x<channel|>yes"}]
    with pytest.raises(TemplateError, match="rewrites the content of assistant message"):
        template.render([*chat, {"role": "user", "content": "Bye"}])
    stripped = ChatTemplate("gemma4-style", GEMMA_STYLE, context={"bos_token": ""})
    rendered = stripped.render([*chat, {"role": "user", "content": "Bye"}])
    content = [rendered.text[s.start : s.end] for s in rendered.segments if s.is_content]
    assert content == ["Hi", "yes", "Bye"]  # the reply's rewritten text is its content (plain text), nothing else


def test_replies_the_template_refuses_to_render_do_not_stop_the_episode(base_tokenizer):
    """A template that refuses thinking in any reply's content (as gpt-oss refuses channel tags): the later turns
    render their tails with neutral replies, the drift recorded, the ids as sampled."""
    refusing = "{% if '<|channel>' in m['content'] %}{{ raise_exception('thinking belongs elsewhere') }}{% endif %}"
    source = GEMMA_STYLE.replace("{{ visible(m['content']) }}", refusing + "{{ m['content'] }}")
    tok = tokenizer_for_template(source, base_tokenizer)
    env = ChatEnv(Questions(), tokenizer=tok, input_mode="tokens")
    ct = env.chat_tokenizer
    opening = env.reset(seed=0)[0].tolist()
    first = [{"role": "user", "content": "What is 1 + 1?"}]
    kept = []
    for k in (1, 2, 3):
        ids = _thinking_reply(ct, first, k, "<|channel>thought\n", "<channel|>")
        _, reward, terminated, _, info = env.step(np.array(ids))
        assert reward == 1.0 and info["template_drift"] > 0
        kept.append(ids)
    assert terminated
    view = env.unwrapped._episode.token_ids.tolist()  # noqa: SLF001
    mask = env.unwrapped._episode.assistant_mask.tolist()  # noqa: SLF001
    assert view[: len(opening)] == opening
    assert [i for i, m in zip(view, mask) if m] == [i for r in kept for i in r]  # every reply as sampled, masked
    messages = env.unwrapped.messages
    with pytest.raises(TemplateError, match="thinking belongs elsewhere"):
        ct.encode(messages)  # a fresh render is refused: only the kept ids hold the episode
    # rendered whole (not from a window that leaves the first reply out), the second turn's tail is the template's
    tail = continuation_tail(ct.template, messages[:4], messages[4:5], kept=ct.decode(kept[1]))
    assert tail.text == "\n<|turn>user\nWhat is 3 + 3?<turn|>\n<|turn>model\n" and tail.drift is not None
