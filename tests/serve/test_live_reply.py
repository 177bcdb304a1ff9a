"""LiveReply (what a streaming response sends while the reply is generated) on the real SmolLM2 tokenizer.

Property: fed a reply's ids token by token or in chunks, every piece LiveReply hands out joins into a prefix of the
content the non-streaming response returns (``make_choice`` + ``api_message``), and ``finish`` gives exactly the
rest. Replies are built from text (unicode split across byte tokens, whitespace runs), stop strings, tool-call
blocks in the template's format (well-formed and not), special tokens and end-of-turn ids; then cut where the policy
would stop (its first stop id, the token that completes a stop string, or its budget).
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatenv.serve.chat.request import parse_request
from chatenv.serve.engine import Generated
from chatenv.serve.errors import APIError
from chatenv.serve.messages import api_message
from chatenv.serve.replies import make_choice
from chatenv.serve.streaming import LiveReply
from chatenv.templates.tool_calls import get_tool_format
from chatenv.tokenization import chat_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TEXTS = [
    "Hello",
    " world",
    ",",
    ".",
    " ",
    "  ",
    "\n",
    "\n\n",
    " \t\n ",
    "😀",
    "👍🏽",
    " 你好",
    "世界",
    "é",
    "naïve",
    "END",
    "EN",
    "bye",
    "<",
    "</",
    "<tool",
    "tool_call>",
    "<tool_call>",
    "{",
    '{"',
    '"name"',
    "[",
    "}",
    "<|python_tag|>",
    "\ufffd",
]
STOPS = ["END", "\n\n", "bye now", "😀", "</tool_call>", "你"]
HERMES_BLOCKS = [
    '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    '\n<tool_call>\n{"name": "get_weather", "arguments": {oops}\n</tool_call>',
    '\n<tool_call>\n{"name": "get_weather"',
    "</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
]
LLAMA_BLOCKS = [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    '<|python_tag|>{"name": "get_weather", "parameters": {}}',
    '{"name": oops}',
    '{"nam',
    '{"x": 1}',
    " [1, 2]",
]
#: name -> (tokenizer fixture, template, tools in the request)
CONFIGS = {
    "smollm2": ("tokenizer", "smollm2", False),
    "smollm2-tools": ("tokenizer", "smollm2-tools", True),
    "llama3": ("llama3_tokenizer", "llama3", False),
    "llama3-tools": ("llama3_tokenizer", "llama3", True),
}


@pytest.fixture(scope="module")
def cts(tokenizer, llama3_tokenizer):
    toks = {"tokenizer": tokenizer, "llama3_tokenizer": llama3_tokenizer}
    return {name: chat_tokenizer(toks[tok], template) for name, (tok, template, _) in CONFIGS.items()}


def request_for(tools, stops=(), tool_choice=None):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    if tools:
        body["tools"] = TOOLS
    if tool_choice:
        body["tool_choice"] = tool_choice
    if stops:
        body["stop"] = list(stops)
    return parse_request(body)


def final_content(ct, ids, request):
    """The reply and the content the non-streaming response returns for generated ``ids``."""
    choice = make_choice(ct, Generated(list(ids), [0.0] * len(ids)), request, "call_t_")
    return choice, api_message(choice.message)["content"] or ""


def stream(ct, request, ids, sizes=(1,)):
    """Feed ``ids`` in chunks of ``sizes`` (cycled); check every step; the pieces sent before finish, and the rest."""
    choice, content = final_content(ct, ids, request)
    live = LiveReply(ct, request)
    sent, k, step = "", 0, 0
    while k < len(ids):
        n = sizes[step % len(sizes)]
        piece = live.feed(ids[k : k + n])
        k, step = k + n, step + 1
        sent += piece
        assert content.startswith(sent), (sent, content, ct.decode(ids))
    rest = live.finish(choice, content)
    assert sent + rest == content
    return sent, rest, content


def as_generated(ct, ids, stops, budget):
    """``ids`` cut where a policy stops: its first stop id, the token completing a stop string, or its budget."""
    end, _ = ct.reply_end(ids)
    if end is not None:
        ids = ids[: end + 1]
    if stops:
        for j in range(len(ids)):
            if any(s in ct.decode(ids[: j + 1]) for s in stops):
                ids = ids[: j + 1]
                break
    return ids[:budget] if budget is not None else ids


def partial_chars(ct):
    """Ids of the first bytes of multi-byte characters (each decodes to U+FFFD until the rest comes)."""
    out = []
    for ch in "😀你👍é世":
        ids = ct.encode_content(ch)
        out += [ids[:k] for k in range(1, len(ids))]
    return out


@st.composite
def reply_ids(draw, ct, tools):
    """A reply: free pieces (text, partial characters, call blocks, specials, end ids) or a canonical reply."""
    fmt = ct.tool_format.name if ct.tool_format is not None else None
    blocks = LLAMA_BLOCKS if fmt == "llama3_json" else HERMES_BLOCKS
    if tools and draw(st.integers(0, 3)) == 0:  # a reply as the template writes it (content and calls)
        content = "".join(draw(st.lists(st.sampled_from(TEXTS[:20]), max_size=4)))
        calls = [
            {"function": {"name": "get_weather", "arguments": {"city": draw(st.sampled_from(["Paris", "Zürich"]))}}}
            for _ in range(draw(st.integers(1, 2)))
        ]
        message = {"role": "assistant", "content": "" if fmt == "llama3_json" else content, "tool_calls": calls}
        return ct.reply([{"role": "user", "content": "x"}], message).ids.tolist()
    special = ct.encode_markup("<|im_start|>" if fmt != "llama3_json" else "<|start_header_id|>")
    kinds = st.one_of(
        st.sampled_from(TEXTS).map(ct.encode_content),
        st.text(max_size=6).map(ct.encode_content),
        st.sampled_from(partial_chars(ct)),
        st.sampled_from(blocks).map(ct.encode_content),
        st.sampled_from(STOPS).map(ct.encode_content),
        st.just(special),
        st.sampled_from([[i] for i in ct.stop_ids]),
    )
    return [i for piece in draw(st.lists(kinds, max_size=12)) for i in piece]


@pytest.mark.parametrize("config", list(CONFIGS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_what_is_sent_is_a_prefix_of_the_content_and_finish_gives_the_rest(cts, config, data):
    ct, tools = cts[config], CONFIGS[config][2]
    ids = data.draw(reply_ids(ct, tools), label="ids")
    stops = data.draw(st.lists(st.sampled_from(STOPS), max_size=3, unique=True), label="stops")
    budget = data.draw(st.none() | st.integers(0, 60), label="budget")
    tool_choice = data.draw(st.sampled_from([None, "none"]), label="tool_choice") if tools else None
    request = request_for(tools, stops, tool_choice)
    ids = as_generated(ct, ids, stops, budget) if data.draw(st.booleans(), label="as generated") else ids
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4), label="chunk sizes")
    sent, _, content = stream(ct, request, ids, [1])
    assert stream(ct, request, ids, sizes)[0] == sent  # chunking changes nothing sent before the end
    if not request.parse_tools and not stops:
        # plain text: everything is sent as it comes but a character still split, and trailing whitespace
        assert sent == content.rstrip("\ufffd").rstrip()


# ------------------------------------------------------------------------------------------ examples


def test_text_goes_out_as_it_is_generated(cts):
    ct = cts["smollm2"]
    ids = ct.encode_content("Hi 😀 there,  你好\n\n") + list(ct.end_of_turn_ids)
    live = LiveReply(ct, request_for(False))
    pieces = [live.feed([i]) for i in ids]
    assert "".join(pieces) == "Hi 😀 there,  你好"
    for k in range(len(ids)):  # a character split across tokens waits for its last byte
        assert "\ufffd" not in "".join(pieces[:k])
    assert sum(bool(p) for p in pieces) >= 5  # sent as it came, not at the end
    choice, content = final_content(ct, ids, request_for(False))
    assert live.finish(choice, content) == "\n\n" and content == "Hi 😀 there,  你好\n\n"


def test_a_stop_string_is_held_until_it_cannot_start_and_cut_when_it_comes(cts):
    ct = cts["smollm2"]
    request = request_for(False, ["bye now"])
    live = LiveReply(ct, request)
    fed = []

    def feed(text):
        fed.extend(ct.encode_content(text))
        return live.feed(ct.encode_content(text))

    assert feed("See you, b") == "See you,"
    assert feed("y") == ""
    assert feed("e") == ""  # "bye" may still become "bye now"
    assert feed("s") == " byes"  # it did not
    assert feed(" bye now and more") == ""
    choice, content = final_content(ct, fed, request)
    assert content == "See you, byes " and live.finish(choice, content) == " " and choice.finish_reason == "stop"


def test_a_tool_call_streams_its_content_never_its_markup(cts):
    ct = cts["smollm2-tools"]
    request = request_for(True)
    message = {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    ids = ct.reply([{"role": "user", "content": "x"}], message).ids.tolist()
    live = LiveReply(ct, request)
    pieces = [live.feed([i]) for i in ids]
    choice, content = final_content(ct, ids, request)
    assert "".join(pieces) == "Checking." == content and choice.finish_reason == "tool_calls"
    assert live.finish(choice, content) == ""
    # the same text without tools is all content, sent as it comes (but its trailing whitespace)
    plain = request_for(True, tool_choice="none")
    sent, rest, content = stream(ct, plain, ids)
    assert content == ct.decode(ids[:-1]) and sent == content and rest == ""
    # a malformed call is content: held from its marker while generating, then sent whole
    bad = ct.encode_content('Sure.\n<tool_call>\n{"name": oops}\n</tool_call>') + list(ct.end_of_turn_ids)
    sent, rest, content = stream(ct, request, bad)
    assert sent == "Sure." and rest == '\n<tool_call>\n{"name": oops}\n</tool_call>'


def test_a_llama3_call_holds_the_reply_while_it_can_become_one(cts):
    ct = cts["llama3-tools"]
    request = request_for(True)
    call = ct.reply(
        [{"role": "user", "content": "x"}],
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather", "arguments": {}}}]},
    ).ids.tolist()
    sent, rest, content = stream(ct, request, call)
    assert sent == rest == content == ""
    assert final_content(ct, call, request)[0].finish_reason == "tool_calls"
    text = ct.encode_content('{"weather": "sunny"} is JSON') + list(ct.end_of_turn_ids)
    live = LiveReply(ct, request)
    pieces = [live.feed([i]) for i in text]
    assert "".join(pieces) == '{"weather": "sunny"} is JSON'
    assert pieces[0] == "" and sum(bool(p) for p in pieces) > 1  # held while '{"' may open a call, then sent


def test_finish_refuses_content_that_does_not_start_with_what_was_sent(cts):
    ct = cts["smollm2"]
    live = LiveReply(ct, request_for(False))
    assert live.feed(ct.encode_content("Hello there")) == "Hello there"
    choice, _ = final_content(ct, ct.encode_content("Hello there"), request_for(False))
    with pytest.raises(APIError, match="not the start of the reply's content"):
        live.finish(choice, "Goodbye")


# ------------------------------------------------------------------------------------------ call_start


@pytest.mark.parametrize(
    "text,start",
    [
        ("", None),
        ("Hello", None),
        ("a<b", None),
        ("Hi <", 3),
        ("Hi <tool_c", 3),
        ("Hi\n<tool_call>\n{", 3),
        ("x </", 2),
        ("x </tool_call> y <tool_call>", 2),
        ("<tool_call", 0),
        ("a <tool_call> b <", 2),
    ],
)
def test_hermes_call_start(text, start):
    assert get_tool_format("hermes").call_start(text) == start


@pytest.mark.parametrize(
    "text,start",
    [
        ("", 0),
        ("  \n", 0),
        ("<|py", 0),
        ("<|python_tag|>", 0),
        ("<|python_tag|> {", 0),
        ("{", 0),
        ('{"na', 0),
        ('{ "name": "f", "parameters": {', 0),
        ("[", 0),
        (" [ {", 0),
        ('{"x"', None),
        ("[1", None),
        ("Hello", None),
        ("<|python_tag|>hello", None),
        ("<x", None),
    ],
)
def test_llama3_json_call_start(text, start):
    assert get_tool_format("llama3_json").call_start(text) == start


FRAGMENTS = st.sampled_from(["<", "</", "tool", "_call", ">", "<tool_call>", "</tool_call>", "a", " ", "\n", "{"])
LLAMA_FRAGMENTS = st.sampled_from(
    ["<|python_tag|>", "<|py", "thon_tag|>", "{", "[", '"name"', '"na', "me", '"', ":", " ", "\n", "x", "1", "}"]
)


@settings(max_examples=300, deadline=None)
@given(head=st.lists(FRAGMENTS, max_size=6).map("".join), tail=st.lists(FRAGMENTS, max_size=6).map("".join))
def test_hermes_call_start_is_never_after_a_marker_any_continuation_has(head, tail):
    fmt = get_tool_format("hermes")
    start = fmt.call_start(head)
    whole = head + tail
    first = min((at for at in (whole.find(m) for m in fmt.markers) if at >= 0), default=None)
    if first is not None:  # the text before call_start (all of it when None) is content in this continuation
        assert (len(head) if start is None else start) <= first


@settings(max_examples=300, deadline=None)
@given(head=st.lists(LLAMA_FRAGMENTS, max_size=5).map("".join), tail=st.lists(LLAMA_FRAGMENTS, max_size=5).map("".join))
def test_llama3_json_call_start_is_zero_while_any_continuation_can_be_a_call(head, tail):
    fmt = get_tool_format("llama3_json")
    if fmt.parse_text(head + tail).items:  # read as a call (or a malformed one): none of it is content
        assert fmt.call_start(head) == 0


def test_canonical_calls_read_back(cts):
    """The blocks the property test uses as well-formed are calls of each format (so it exercises both paths)."""
    hermes = get_tool_format("hermes").parse_text("Ok." + HERMES_BLOCKS[0])
    assert hermes.canonical and hermes.calls[0].arguments == {"city": "Paris"}
    llama = get_tool_format("llama3_json").parse_text(LLAMA_BLOCKS[1])
    assert llama.canonical and json.dumps(llama.calls[0].arguments) == '{"city": "Oslo"}'
