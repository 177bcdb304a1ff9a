import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chatenv import ChatHistory, History, LogProbs, Masks, Text, Tokens, pad_sequences, unpad_sequences

lengths = st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=5)


def _seqs(lens, which, eos=2):
    g = torch.Generator().manual_seed(sum(sum(x) for x in lens))
    # values include the pad id itself (pad == eos): conversions must not rely on it
    return [torch.randint(0, 4, (n[which],), generator=g) for n in lens]


@settings(max_examples=60, deadline=None)
@given(lens=lengths)
def test_tokens_padded_nested_round_trip(lens):
    prompt, response = _seqs(lens, 0), _seqs(lens, 1)
    padded = Tokens.from_sequences(prompt, response, pad_value=2)
    nested = Tokens.from_sequences(prompt, response, padded=False)
    assert padded.full.shape == (len(lens), padded.prompt.shape[1] + padded.response.shape[1])
    for b in range(len(lens)):
        want = torch.cat([prompt[b], response[b]]).tolist()
        assert padded.full_sequences()[b].tolist() == want
        assert nested.full.unbind()[b].tolist() == want
        # prompts pad left, responses pad right
        p = len(prompt[b])
        assert padded.prompt[b, padded.prompt.shape[1] - p :].tolist() == prompt[b].tolist()
        assert padded.response[b, : len(response[b])].tolist() == response[b].tolist()
    again = padded.to_nested().to_padded(pad_value=2)
    assert torch.equal(again.full, padded.full)
    back = nested.to_padded(pad_value=2).to_nested()
    assert [x.tolist() for x in back.full.unbind()] == [x.tolist() for x in nested.full.unbind()]


@settings(max_examples=40, deadline=None)
@given(lens=lengths)
def test_masks_and_log_probs_follow_tokens(lens):
    prompt, response = _seqs(lens, 0), _seqs(lens, 1)
    tokens = Tokens.from_sequences(prompt, response, pad_value=2)
    masks = Masks.from_tokens(tokens)
    assert masks.all_attention_mask.shape == tokens.full.shape
    assert masks.all_attention_mask.sum().item() == sum(p + r for p, r in lens)
    assert masks.all_assistant_mask.sum().item() == sum(r for _, r in lens)
    nested = masks.to_nested()
    assert torch.equal(
        nested.to_padded(prompt_width=tokens.prompt.shape[1]).all_assistant_mask, masks.all_assistant_mask
    )
    lp = LogProbs.from_sequences(
        [torch.full((p,), math.nan) for p, _ in lens], [-torch.arange(r, dtype=torch.float) - 1 for _, r in lens]
    )
    assert lp.full.shape == tokens.full.shape
    # padding is NaN, real log-probs are where the attention mask says
    assert (lp.full[masks.all_assistant_mask] < 0).all()
    assert torch.isnan(lp.full[~masks.all_attention_mask]).all()
    assert [x.tolist() for x in lp.to_nested().response.unbind()] == [
        (-torch.arange(r, dtype=torch.float) - 1).tolist() for _, r in lens
    ]


def test_pad_helpers():
    seqs = [torch.tensor([1, 2]), torch.tensor([3])]
    left, mask = pad_sequences(seqs, "left", 0)
    assert left.tolist() == [[1, 2], [0, 3]] and mask.tolist() == [[True, True], [False, True]]
    assert [s.tolist() for s in unpad_sequences(left, [2, 1], "left")] == [[1, 2], [3]]
    with pytest.raises(ValueError, match="side must be 'left' or 'right'"):
        pad_sequences(seqs, "middle")
    with pytest.raises(ValueError, match="length=1 is shorter than the longest sequence"):
        pad_sequences(seqs, length=1)


def test_from_sequences_errors():
    with pytest.raises(ValueError, match="give a prompt, a response, or both"):
        Tokens.from_sequences()
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        Tokens.from_sequences([torch.tensor([1])] * 2, [torch.tensor([1])])
    t = Tokens.from_sequences([torch.tensor([1])], [torch.tensor([1, 2])])
    with pytest.raises(ValueError, match="assistant mask has 1 entries, its full sequence 3"):
        Masks.from_tokens(t, [torch.tensor([True])])


def test_text_and_chat_history():
    h = History.from_chats([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]])
    ch = ChatHistory(prompt=h, batch_size=(2,))
    assert ch[1].prompt.to_chats() == [{"role": "user", "content": "b"}]
    t = Text(prompt=["p1", "p2"], response=["r1", "r2"], full=["p1r1", "p2r2"], batch_size=(2,))
    assert t[1].full == t[1].prompt + t[1].response
