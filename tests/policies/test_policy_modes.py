"""What policies read, decided by the core's input modes: observations split per mode (naming the mode that reads
an observation of another kind), text read strictly, the mode names in one place."""

import numpy as np
import pytest
import torch
from helpers import stable_id
from tensordict import NonTensorData, NonTensorStack

from chatenv import History
from chatenv.modes import MODES, get_mode, read_strings
from wrappers.policies import PolicyConfig

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("mode", "observations", "single", "batch"),
    [
        ("tokens", [1, 2, 3], True, [[1, 2, 3]]),
        ("tokens", np.array([1, 2]), True, [[1, 2]]),
        ("tokens", torch.tensor([[1, 2], [3, 4]]), False, [[1, 2], [3, 4]]),
        ("tokens", [[1, 2], np.array([3])], False, [[1, 2], [3]]),
        ("tokens", [], False, []),
        ("text", "prompt", True, ["prompt"]),
        ("text", ["a", "b"], False, ["a", "b"]),
        ("text", NonTensorStack.from_list(["a", "b"]), False, ["a", "b"]),
        ("history", CHAT, True, [CHAT]),
        ("history", [CHAT, CHAT], False, [CHAT, CHAT]),
        ("history", History.from_chats([CHAT]), False, [CHAT]),
    ],
    ids=stable_id,
)
def test_split_batch(mode, observations, single, batch):
    one, rows = get_mode(mode).split_batch(observations)
    assert one is single
    if mode == "tokens":
        assert all(isinstance(r, torch.Tensor) and r.dtype == torch.long for r in rows)
        rows = [r.tolist() for r in rows]
    assert rows == batch


@pytest.mark.parametrize(
    ("mode", "observations", "match"),
    [
        ("tokens", "What is 2+2?", r"got a str \('What is 2\+2\?'\); text prompts are read by input_mode='text'"),
        ("tokens", ["a", "b"], r"^observation 0 must be token ids, got a str \('a'\); text prompts are read by inp"),
        ("tokens", CHAT, r"^tokens mode observations must be token ids, got message dicts \(a chat\); chats \(list"),
        ("tokens", [CHAT], r"^observation 0 must be token ids, got message dicts \(a chat\); .*input_mode='history'"),
        ("tokens", np.zeros((1, 2, 3), dtype=np.int64), r"one 1-D sequence of ids or a \(B, T\) batch of them, got sh"),
        ("tokens", np.array([1.0]), r"^tokens mode observations must be integer token ids, got float64; ids are never"),
        ("tokens", object(), r"^tokens mode: expected token ids or a list of them, got object$"),
        (
            "text",
            [1, 2],
            r"^text mode: observation 0 must be a str, got int; token ids are read by input_mode='tokens'",
        ),
        ("text", [CHAT], r"^text mode: observation 0 must be a str, got list; chats \(lists of message dicts\) are"),
        ("text", CHAT, r"^text mode: expected prompt text, got message dicts \(a chat\); chats"),
        ("text", [None], r"^text mode: observation 0 must be a str, got NoneType$"),
        ("text", 5, r"^text mode: expected a prompt \(str\) or a list of them, got int$"),
        ("history", "Hi", r"^history mode: expected a chat \(a list of message dicts\), got a str; text prompts are"),
        ("history", [1, 2], r"^history mode: .*got token ids; token ids are read by input_mode='tokens'$"),
        ("history", torch.tensor([1, 2]), r"got token ids; token ids are read by input_mode='tokens'$"),
        ("history", 5, r"^history mode: expected a chat \(a list of message dicts\) or a list of chats, got int$"),
    ],
    ids=stable_id,
)
def test_split_batch_names_the_mode_that_reads_the_input(mode, observations, match):
    with pytest.raises(TypeError, match=match):
        get_mode(mode).split_batch(observations)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        (NonTensorData("a"), ["a"]),
        (NonTensorData(["a", "b"]), ["a", "b"]),
        (NonTensorStack.from_list(["a", "b"]), ["a", "b"]),
    ],
    ids=stable_id,
)
def test_read_strings(value, expected):
    assert read_strings(value, "x") == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (NonTensorStack.from_list(["a", None]), r"^x: expected text \(a str per row\), got NoneType None at row 1$"),
        (["a", 3], r"^x: expected text \(a str per row\), got int 3 at row 1$"),
        (torch.zeros(2), r"^x: expected text \(a str or a list of str\), got Tensor$"),
        (b"a", r"^x: expected text \(a str or a list of str\), got bytes$"),
    ],
    ids=stable_id,
)
def test_read_strings_refuses(value, match):
    with pytest.raises(TypeError, match=match):
        read_strings(value, "x")


def test_input_modes_are_the_cores():
    assert tuple(MODES) == ("history", "text", "tokens")
    for name in MODES:
        assert PolicyConfig(input_mode=name).input_mode == name
    with pytest.raises(ValueError, match=r"input_mode must be one of \('history', 'text', 'tokens'\), got 'chat'"):
        PolicyConfig(input_mode="chat")
    with pytest.raises(ValueError, match=r"input_mode must be one of .*, got \['tokens'\]"):
        PolicyConfig(input_mode=["tokens"])
