import pytest
import torch
from tensordict import TensorDict, set_list_to_stack

from chatenv import History, MessagesSpace

A = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
B = [{"role": "system", "content": "S"}, {"role": "user", "content": "Yo"}, {"role": "assistant", "content": "Hey"}]


def test_single_chat_and_batch_shapes():
    assert History.from_chats(A).shape == (2,)
    h = History.from_chats([A, B])
    assert h.shape == (2, 3)
    assert h.role[0] == ["user", "assistant", ""]  # explicit empty role pads the ragged batch
    assert h.to_chats() == [A, B]
    assert History.from_chats(A[0]).shape == ()
    assert History.from_chats(A[0]).to_chats() == A[0]


@pytest.mark.parametrize("flag", [True, False])
def test_no_global_tensordict_flag_needed(flag):
    with set_list_to_stack(flag):
        h = History.from_chats([A, B])
        assert h.to_chats() == [A, B]
        assert h[1, 1:].to_chats() == B[1:]
        assert h.append(History.from_chats([A[0], B[0]])).to_chats() == [A + [A[0]], B + [B[0]]]


def test_indexing_and_slicing():
    h = History.from_chats([A, B])
    assert h[1].to_chats() == B
    assert h[:, :1].to_chats() == [[A[0]], [B[0]]]
    assert h[1, -1].content == "Hey"


def test_append_and_extend_keep_chats_contiguous():
    h = History.from_chats([A, B])
    out = h.append(History.from_chats([{"role": "user", "content": "1"}, {"role": "user", "content": "2"}]))
    assert out.to_chats() == [A + [{"role": "user", "content": "1"}], B + [{"role": "user", "content": "2"}]]
    assert out.shape == (2, 4)
    assert out.role[0] == ["user", "assistant", "user", ""]
    ext = History.from_chats(A).extend(History.from_chats(B))
    assert ext.to_chats() == A + B
    assert h.to_chats() == [A, B]  # not in place by default


def test_append_in_place():
    h = History.from_chats(A)
    h.append(History.from_chats(B[0]), inplace=True)
    assert h.to_chats() == A + [B[0]]
    assert h.shape == (3,)


def test_wrong_batch_dims_on_append_and_extend():
    h = History.from_chats([A, B])
    before = h.to_chats()
    with pytest.raises(ValueError, match=r"expected a History of shape \(2,\), got \(3,\)"):
        h.append(History.from_chats(B))
    with pytest.raises(ValueError, match=r"extend needs a History of shape \(2, 'k'\), got \(3,\)"):
        h.extend(History.from_chats(B))
    with pytest.raises(ValueError, match="cannot append to a History of shape"):
        History.from_chats(A[0]).append(History.from_chats(A[0]))
    assert h.to_chats() == before


@pytest.mark.parametrize(
    "bad,exc,match",
    [
        ([{"role": "user", "content": 3}], TypeError, "'content' must be a str, got int"),
        ([{"role": "user", "content": None}], TypeError, "'content' must be a str, got NoneType"),
        ([{"content": "x"}], ValueError, "message has no 'role'"),
        ([{"role": "", "content": "x"}], ValueError, "'role' must be a non-empty str"),
        ([{"role": "user"}], ValueError, "message has no 'content'"),
        ([{"role": "user", "content": "x", "speaker": "bob"}], ValueError, r"unsupported message keys \['speaker'\]"),
        ([{"role": "tool", "content": "x", "name": 3}], TypeError, "'name' must be a str"),
        (["hello"], TypeError, "expected a list of message dicts"),
        ("hello", TypeError, "expected a list of message dicts or a list of chats, got str"),
        ([{"role": "user", "content": "x", "tool_calls": "not json"}], ValueError, "must be a JSON list"),
    ],
)
def test_bad_messages(bad, exc, match):
    with pytest.raises(exc, match=match):
        History.from_chats(bad)


def test_tool_calls_and_incomplete_flag_round_trip():
    msgs = [
        {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "partial", "is_complete": False},
    ]
    h = History.from_chats(msgs)
    assert h.to_chats() == msgs
    assert h.is_complete.tolist() == [True, True, False]


def test_history_inside_a_tensordict():
    h = History.from_chats([A, B])
    td = TensorDict(history=h, reward=torch.zeros(2), batch_size=(2,))
    assert td[1]["history"].to_chats() == B
    assert td.clone()["history"].to_chats() == [A, B]


def test_default_spec():
    space = History.default_spec(max_messages=3, roles=("user", "assistant"))
    assert isinstance(space, MessagesSpace)
    assert space.contains(A)
    assert not space.contains(B)  # system not allowed
    assert not space.contains(A + A)  # too many
    space.seed(0)
    assert space.contains(space.sample())
