import importlib.resources
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatenv import History, TemplateError, TemplateParseError, get_template, list_templates, register_template
from chatenv.templates import ChatTemplate, resolve_template
from chatenv.templates.derive import TemplateDerivationError
from chatenv.templates.registry import builtin_source

CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "  spaced  "},
        {"role": "assistant", "content": "ok"},
    ],
]


class _Tok:
    def __init__(self, chat_template):
        self.chat_template = chat_template
        self.bos_token = self.eos_token = ""


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gp", [False, True])
def test_smollm2_renders_exactly_like_its_tokenizer(tokenizer, chat, gp):
    ours = get_template("smollm2").render(chat, add_generation_prompt=gp).text
    theirs = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gp)
    assert ours == theirs


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("gp", [False, True])
def test_plain_chatml_adds_no_system_prompt(tokenizer, chat, gp):
    text = get_template("chatml").render(chat, add_generation_prompt=gp).text
    if chat[0]["role"] == "system":
        # with a system message of its own, SmolLM2 renders plain ChatML
        assert text == tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gp)
    else:
        assert text.startswith(f"<|im_start|>{chat[0]['role']}\n{chat[0]['content']}<|im_end|>\n")
        assert "SmolLM" not in text
        system = {"role": "system", "content": get_template("smollm2").default_system}
        assert get_template("smollm2").render([system, *chat], add_generation_prompt=gp).text.endswith(text)


def test_default_system_prompts_come_from_the_templates():
    assert (
        get_template("smollm2").default_system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    )
    assert (
        get_template("qwen2.5").default_system == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    )
    assert get_template("chatml").default_system is None
    assert get_template("llama3").default_system is None


@pytest.mark.parametrize("name", ["smollm2", "chatml", "llama3", "qwen2.5"])
def test_builtin_sources_are_jinja_files_in_the_package(name):
    path = importlib.resources.files("chatenv.templates").joinpath(f"{name}.jinja")
    assert path.is_file()
    assert get_template(name).source == path.read_text(encoding="utf-8") == builtin_source(name)
    assert get_template(name).has_generation_markers


def test_smollm2_tokenizer_resolves_to_smollm2_by_behaviour(tokenizer):
    assert resolve_template(None, tokenizer).name == "smollm2"


PLAIN_CHATML_SOURCE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
    "+ '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_plain_chatml_tokenizer_resolves_to_chatml_not_smollm2():
    tok = _Tok(PLAIN_CHATML_SOURCE)
    assert resolve_template(None, tok).name == "chatml"


def test_template_without_an_end_of_turn_token_is_refused_with_a_counterexample():
    with pytest.raises(TemplateDerivationError, match="no special token follows the assistant's content") as err:
        resolve_template(None, _Tok("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"))
    assert [m["role"] for m in err.value.chat] == ["user", "assistant", "user"]


def test_tokenizer_template_with_markers_is_used_directly():
    source = (
        "{% for m in messages %}<{{ m['role'] }}>"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}</s>{% endgeneration %}"
        "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
    )
    t = resolve_template(None, _Tok(source))
    r = t.render([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
    assert r.text == "<user>q</s><assistant>a</s>"
    assert [r.text[a:b] for a, b in r.generation_spans()] == ["a</s>"]


def test_no_template_at_all():
    with pytest.raises(TemplateError, match="the tokenizer has none; pass template="):
        resolve_template(None, _Tok(None))


def test_unknown_template_name_suggests():
    with pytest.raises(KeyError, match="unknown chat template 'chatlm'; did you mean 'chatml'"):
        get_template("chatlm")


def test_registered_names():
    assert {"smollm2", "chatml", "llama3", "qwen2.5"} <= set(list_templates())


def test_register_requires_generation_markers_and_unique_names():
    with pytest.raises(ValueError, match="has no \\{% generation %\\} markers"):
        register_template("plain-test", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match="already registered"):
        register_template("chatml", get_template("chatml").source)
    with pytest.raises(TemplateError, match="does not compile"):
        register_template("broken-test", "{% generation %}{% for %}")


def _bracket_parser(text):
    out = []
    for block in text.split("\x1e")[:-1]:
        role, content = block.split("\x1f", 1)
        out.append({"role": role, "content": content})
    return out


def test_user_registration_round_trips():
    source = (
        "{% for m in messages %}{{ m['role'] + '\x1f' }}"
        "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '\x1e' }}{% endgeneration %}"
        "{% else %}{{ m['content'] + '\x1e' }}{% endif %}{% endfor %}"
    )
    t = register_template("unit-sep-test", source, _bracket_parser, overwrite=True)
    chat = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert History.from_text(t.render(chat).text, "unit-sep-test").to_chats() == chat


def test_qwen_tool_calls_render_and_parse():
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"name": "get", "arguments": {"city": "Paris"}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "20C"},
        {"role": "assistant", "content": "Sunny, 20C."},
    ]
    text = get_template("qwen2.5").render(chat).text
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n20C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nSunny, 20C.<|im_end|>\n"
    )
    parsed = History.from_text(text, "qwen2.5").to_chats()
    call = {"id": "call_0", "type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}}
    assert parsed == [*chat[:2], {"role": "assistant", "content": "", "tool_calls": [call]}, *chat[3:]]
    assert get_template("qwen2.5").render(parsed).text == text  # both call forms render the same


def test_qwen_tools_block():
    tools = [{"type": "function", "function": {"name": "get", "parameters": {}}}]
    text = get_template("qwen2.5").render([{"role": "user", "content": "u"}], tools=tools).text
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert '\n{"type": "function", "function": {"name": "get", "parameters": {}}}\n</tools>' in text


@pytest.mark.parametrize("name", ["smollm2", "chatml", "llama3", "qwen2.5"])
def test_incomplete_last_message(name):
    t = get_template(name)
    chat = [{"role": "user", "content": "q"}]
    prompt = t.render(chat, add_generation_prompt=True).text
    parsed = History.from_text(prompt + "partial ans", name).to_chats()
    assert parsed[-1] == {"role": "assistant", "content": "partial ans", "is_complete": False}
    parsed = History.from_text(prompt, name).to_chats()
    assert parsed[-1] == {"role": "assistant", "content": "", "is_complete": False}


@pytest.mark.parametrize(
    "name,text", [("chatml", "hello"), ("llama3", "<|begin_of_text|>oops"), ("chatml", "<|im_start|>\nx")]
)
def test_unparseable_text(name, text):
    with pytest.raises(TemplateParseError):
        History.from_text(text, name)


def test_reserved_characters_are_refused():
    with pytest.raises(ValueError, match="noncharacter"):
        get_template("chatml").render([{"role": "user", "content": "a\ufdd2b"}])


# ------------------------------------------------------------------------------ round trip (hypothesis)

_CONTROL = (
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|begin_of_text|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
_markup_like = st.sampled_from(["<b>", "{% if x %}", "{{ y }}", "<|fake|>", "</s>", "[INST]", "\n\n", "<think>"])
_text = (
    st.lists(st.one_of(st.text(max_size=12), _markup_like), max_size=4)
    .map("".join)
    .filter(lambda s: not any(c in s for c in _CONTROL) and not any("\ufdd0" <= ch <= "\ufdd3" for ch in s))
)
_roles = st.sampled_from(["user", "assistant", "system"])


@st.composite
def _chats(draw):
    n = draw(st.integers(1, 5))
    msgs = [{"role": draw(_roles), "content": draw(_text)} for _ in range(n)]
    return msgs


def _expected(name, chat):
    t = get_template(name)
    out = [dict(m) for m in chat]
    if t.strips_content:
        out = [dict(m, content=m["content"].strip()) for m in out]
    if t.default_system is not None and out[0]["role"] != "system":
        out = [{"role": "system", "content": t.default_system}] + out
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "chatml", "llama3", "qwen2.5"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chat=_chats())
def test_round_trip(name, chat):
    if name == "qwen2.5":
        chat = [m for i, m in enumerate(chat) if m["role"] != "system" or i == 0] or chat[:1]
    if name == "llama3":
        # Llama 3 trims content, so the round trip holds for the trimmed chat
        chat = [dict(m, content=m["content"].strip()) for m in chat]
    h = History.from_chats(chat)
    text = get_template(name).render(h.to_chats()).text
    assert History.from_text(text, name).to_chats() == _expected(name, chat)


@pytest.mark.parametrize("content", ["[{", '{"name": "f"', '[{"name": "f", "parameters": {}}] and more'])
def test_text_that_looks_like_a_llama3_call_reads_back_as_text(content):
    chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": content}]
    text = get_template("llama3").render(chat).text
    assert History.from_text(text, "llama3").to_chats()[-1] == {"role": "assistant", "content": content}


@settings(max_examples=50, deadline=None)
@given(
    calls=st.lists(
        st.fixed_dictionaries(
            {
                "name": st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                "arguments": st.dictionaries(
                    st.from_regex(r"[a-z]{1,5}", fullmatch=True), st.integers() | _text, max_size=3
                ),
            }
        ),
        min_size=1,
        max_size=3,
    ),
    content=_text,
    result=_text,
)
def test_round_trip_qwen_tools(calls, content, result):
    result = result.strip("\n") or "r"
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": content, "tool_calls": calls},
        {"role": "tool", "content": result},
    ]
    text = get_template("qwen2.5").render(chat).text
    parsed = History.from_text(text, "qwen2.5").to_chats()
    openai = [
        {"id": f"call_{k}", "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for k, c in enumerate(calls)
    ]
    assert parsed == [*chat[:2], {**chat[2], "tool_calls": openai}, chat[3]]
    assert get_template("qwen2.5").render(parsed).text == text
    assert json.loads(History.from_chats(chat).tool_calls[2]) == calls


def test_chat_template_is_frozen():
    t = get_template("chatml")
    assert isinstance(t, ChatTemplate)
    with pytest.raises(AttributeError):
        t.name = "x"
