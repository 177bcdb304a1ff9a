"""Continuations rendered from a window of the chat: the proof per template and the run-time check."""

import warnings

import pytest

from chatenv import ChatTokenizer, TemplateError
from chatenv.templates import ChatTemplate, get_template
from chatenv.templates.continuation import continuation_tail, window, window_is_exact
from chatenv.tokenization import TemplateWindowWarning

# ChatML with two twists that read messages outside the window (first message + last two)

# user turns are numbered, but only in chats without a system prompt
NUMBERED_WITHOUT_SYSTEM = """
{%- set ns = namespace(users=0) %}
{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}
        {{- '\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] }}
        {%- if message['role'] == 'user' and messages[0]['role'] != 'system' %}
            {%- set ns.users = ns.users + 1 %}
            {{- ' #' + ns.users | string }}
        {%- endif %}
        {{- '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# from the 41st message on, user headers carry the message's position (longer than any proof chat)
NUMBERED_WHEN_LONG = """
{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}
        {{- '\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] }}
        {%- if loop.index > 40 %}{{- ' (message ' + loop.index | string + ')' }}{%- endif %}
        {{- '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# refuses chats where the message after the system prompt is not a user message (a window can look like that)
USER_AFTER_SYSTEM = """
{%- if messages | length > 1 and messages[0]['role'] == 'system' and messages[1]['role'] != 'user' %}
    {{- raise_exception('the system prompt must be followed by a user message') }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}
        {{- '\n' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

# the single probe chat the tokenizer was verified with before windowing was proven on many shapes
OLD_PROBE = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 10 * 4?\nExplain."},
    {"role": "assistant", "content": "40, since 10 * 4 = 40."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]


def _chat(turns, system=True, tool_every=0, call_content="Let me look."):
    chat = [{"role": "system", "content": "You help."}] if system else []
    for t in range(turns):
        chat.append({"role": "user", "content": f"Question {t}?"})
        if tool_every and t % tool_every == 1:
            chat.append({"role": "assistant", "content": call_content, "tool_calls": [{"name": "f", "arguments": {}}]})
            chat.append({"role": "tool", "content": f"result {t}"})
        chat.append({"role": "assistant", "content": f"Answer {t}."})
    return chat


def _step(ct, chat):
    """The ids of stepping through ``chat`` as an env does: prompt, then per assistant turn its reply's ids
    (what the model generates) and the continuation."""
    first = next(i for i, m in enumerate(chat) if m["role"] == "assistant")
    ids = ct.encode(chat[:first], add_generation_prompt=True).ids.tolist()
    i = first
    while i < len(chat):
        ids += ct.reply(chat[:i], chat[i]).ids.tolist()
        j = next((k for k in range(i + 1, len(chat)) if chat[k]["role"] == "assistant"), len(chat))
        ids += ct.continuation(chat[: i + 1], chat[i + 1 : j], add_generation_prompt=j < len(chat)).ids.tolist()
        i = j
    return ids


def test_window():
    chat = [{"role": "user", "content": str(i)} for i in range(5)]
    assert window(chat[:3]) is None
    assert window(chat) == [chat[0], chat[3], chat[4]]


@pytest.mark.parametrize("name", ["smollm2", "chatml", "llama3", "qwen2.5", "smollm2-tools"])
def test_builtin_templates_are_proven_windowable(template_tokenizers, name, tokenizer):
    assert window_is_exact(get_template(name))
    tok = template_tokenizers.get(name, tokenizer)
    ct = ChatTokenizer(tok, name)
    assert ct.windowed
    # a Llama 3 call is bare JSON: no text content
    chat = _chat(9, tool_every=3, call_content="" if name == "llama3" else "Let me look.")
    assert _step(ct, chat) == ct.encode(chat).ids.tolist()


def test_proof_catches_a_template_the_single_probe_missed(tokenizer):
    template = ChatTemplate("numbered-without-system-test", NUMBERED_WITHOUT_SYSTEM)
    # the old check: one continuation of one probe chat (with a system prompt) from a window and in full
    windowed = continuation_tail(template, window(OLD_PROBE[:5]), OLD_PROBE[5:6])
    assert windowed == continuation_tail(template, OLD_PROBE[:5], OLD_PROBE[5:6])
    # the proof also tries chats without a system prompt
    assert not window_is_exact(template)
    ct = ChatTokenizer(tokenizer, template)
    assert not ct.windowed
    chat = _chat(6, system=False)
    cont = ct.continuation(chat[:6], chat[6:7])
    assert tokenizer.decode(cont.ids) == "\n<|im_start|>user #4\nQuestion 3?<|im_end|>\n<|im_start|>assistant\n"
    assert _step(ct, chat) == ct.encode(chat).ids.tolist()


def test_runtime_check_catches_what_the_proof_missed_and_returns_full_render_ids(tokenizer):
    template = ChatTemplate("numbered-when-long-test", NUMBERED_WHEN_LONG)
    assert window_is_exact(template)  # no proof chat is that long
    ct = ChatTokenizer(tokenizer, template, check_window_every=1)
    assert ct.windowed
    chat = _chat(30)
    with pytest.warns(TemplateWindowWarning, match="renders a continuation differently from a window") as record:
        stepped = _step(ct, chat)
    assert len(record) == 1
    assert not ct.windowed
    assert stepped == ct.encode(chat).ids.tolist()
    assert "<|im_start|>user (message 42)\nQuestion 20?" in ct.decode(stepped)


def test_runtime_check_samples_every_nth_continuation_deterministically(tokenizer):
    template = ChatTemplate("numbered-when-long-test", NUMBERED_WHEN_LONG)
    sampled = ChatTokenizer(tokenizer, template)  # default: every 32nd windowed continuation, from the first
    assert sampled.check_window_every == 32
    exact = ChatTokenizer(tokenizer, template, verify=False, check_window_every=1)
    chat = _chat(36)
    points = [2 * t + 3 for t in range(1, 35)]  # continuation t: after system and t+1 user/assistant pairs
    with pytest.warns(TemplateWindowWarning):
        want = [exact.continuation(chat[:n], chat[n : n + 1]).ids.tolist() for n in points]
    caught = []
    for t, n in enumerate(points, start=1):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            got = sampled.continuation(chat[:n], chat[n : n + 1]).ids.tolist()
        caught += [t] * len(record)
        # the new user message is message n + 1: numbered from 41 on, which a window cannot see
        if n + 1 <= 40 or t >= 33:
            assert got == want[t - 1]
        else:
            assert got != want[t - 1]  # not sampled: the window's (wrong) ids
    # windowed continuations 1, 33, 65, ... are checked: the first difference is found on the 33rd
    assert caught == [33]
    assert not sampled.windowed


def test_window_that_raises_is_caught_by_the_proof(tokenizer):
    template = ChatTemplate("user-after-system-test", USER_AFTER_SYSTEM)
    ct = ChatTokenizer(tokenizer, template)
    assert not ct.windowed  # a window [system, tool, assistant] is refused by the template
    chat = _chat(5, tool_every=2)
    assert _step(ct, chat) == ct.encode(chat).ids.tolist()


def test_window_that_raises_falls_back_even_when_not_sampled(tokenizer):
    template = ChatTemplate("user-after-system-test", USER_AFTER_SYSTEM)
    ct = ChatTokenizer(tokenizer, template, verify=False, check_window_every=None)
    assert ct.windowed  # unverified: nothing proven, nothing sampled
    chat = _chat(5, tool_every=2)
    with pytest.warns(TemplateWindowWarning) as record:
        stepped = _step(ct, chat)
    assert len(record) == 1
    assert not ct.windowed
    assert stepped == ct.encode(chat).ids.tolist()


def test_a_chat_the_template_refuses_still_raises(tokenizer):
    template = ChatTemplate("user-after-system-test", USER_AFTER_SYSTEM)
    ct = ChatTokenizer(tokenizer, template, verify=False, check_window_every=1)
    chat = [{"role": "system", "content": "S"}, {"role": "assistant", "content": "a"}] + _chat(2, system=False)
    with pytest.raises(TemplateError, match="the system prompt must be followed by a user message"):
        ct.continuation(chat, [{"role": "user", "content": "u"}])
    assert ct.windowed  # the template refuses the chat itself: no sign the window is wrong


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "2"])
def test_check_window_every_must_be_a_positive_int_or_none(tokenizer, every):
    with pytest.raises(ValueError, match=f"check_window_every must be a positive int or None, got {every!r}"):
        ChatTokenizer(tokenizer, "chatml", check_window_every=every)
