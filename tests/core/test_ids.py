"""chatenv.ids: the one reader of token id sequences, and every entry point that reads ids through it."""

import math

import numpy as np
import pytest
import torch
from helpers import stable_id

from chatenv import ScoredAction
from chatenv.actions import action_ids, attach_ref_log_probs
from chatenv.ids import check_id_dtype, check_vocab, token_id_array, token_ids
from chatenv.modes import get_mode
from wrappers.policies import TransformersWrapper
from wrappers.token_policy import TokenStepPolicy

NESTED = torch.nested.as_nested_tensor([torch.tensor([1, 2]), torch.tensor([3])], layout=torch.jagged)

ACCEPTED = [
    ([1, 2, 3], [1, 2, 3]),
    ((4,), [4]),
    ([], []),
    (np.array([1, 2], dtype=np.int32), [1, 2]),
    (np.array([7], dtype=np.uint8), [7]),
    (np.array([1, 2], dtype=object), [1, 2]),
    (torch.tensor([5, 6]), [5, 6]),
    (torch.tensor([5], dtype=torch.int16), [5]),
    ([np.int64(3), torch.tensor(4), np.array(5)], [3, 4, 5]),
]


@pytest.mark.parametrize(("value", "expected"), ACCEPTED, ids=stable_id)
def test_accepted(value, expected):
    ids = token_ids(value, "x")
    assert ids == expected and all(type(i) is int for i in ids)
    arr = token_id_array(value, "x")
    assert arr.dtype == np.int64 and arr.ndim == 1 and arr.tolist() == expected


REFUSED = [
    ("hello", TypeError, r"^x must be token ids, got a str \('hello'\); tokenize text first$"),
    (b"hi", TypeError, r"^x must be token ids, got a bytes \(b'hi'\); tokenize text first$"),
    ({"role": "user", "content": "hi"}, TypeError, r"^x must be token ids, got message dicts \(a chat\)"),
    ([{"role": "user", "content": "hi"}], TypeError, r"^x must be token ids, got message dicts \(a chat\)"),
    ([1, 2.5], TypeError, r"^x must be integer token ids, got 2.5 \(float\) at position 1; ids are never rounded or"),
    ([1, math.nan], TypeError, r"got nan \(float\) at position 1; ids are never rounded or truncated$"),
    ([1, True], TypeError, r"^x must be integer token ids, got the bool True at position 1$"),
    ([np.bool_(False)], TypeError, r"got the bool np.False_ at position 0$"),
    ([1, torch.tensor(2.0)], TypeError, r"^x must be integer token ids, got 2.0 \(float\) at position 1"),
    ([1, np.float32(2.0)], TypeError, r"got np.float32\(2.0\) \(float32\) at position 1"),
    ([1, None], TypeError, r"^x must be integer token ids, got None \(NoneType\) at position 1$"),
    ([1, "2"], TypeError, r"^x must be integer token ids, got '2' \(str\) at position 1$"),
    ([1, [2, 3]], TypeError, r"^x must be a 1-D sequence of token ids, got a list at position 1 \(a nested or ragged"),
    ([torch.tensor([1, 2])], TypeError, r"got a Tensor of dtype torch.int64 and shape \(2,\) at position 0 \(a nest"),
    (np.array([1, [2]], dtype=object), TypeError, r"got a list at position 1 \(a nested or ragged list\)$"),
    (
        np.array([1.0, math.nan]),
        TypeError,
        r"^x must be integer token ids, got float64 holding NaN; ids are never rounded or truncated, pass an integer "
        r"\(int64\) tensor or array$",
    ),
    (torch.tensor([1.5]), TypeError, r"^x must be integer token ids, got torch.float32; ids are never rounded"),
    (
        np.array([True]),
        TypeError,
        r"^x must be integer token ids, got bool; pass an integer \(int64\) tensor or array$",
    ),
    (torch.tensor([True]), TypeError, r"^x must be integer token ids, got torch.bool; pass an integer"),
    (np.array([[1, 2]]), TypeError, r"^x must be a 1-D sequence of token ids, got shape \(1, 2\)$"),
    (torch.tensor(5), TypeError, r"^x must be a 1-D sequence of token ids, got shape \(\)$"),
    (NESTED, TypeError, r"^x must be a 1-D sequence of token ids, got a nested tensor$"),
    (5, TypeError, r"^x must be a sequence of integer token ids, got int$"),
    (None, TypeError, r"^x must be a sequence of integer token ids, got NoneType$"),
    ([2**70], ValueError, r"^token id 1180591620717411303424 in x does not fit int64$"),
    (np.array([2**63], dtype=np.uint64), ValueError, r"^token id 9223372036854775808 in x does not fit int64$"),
]


@pytest.mark.parametrize(("value", "error", "match"), REFUSED, ids=stable_id)
def test_refused(value, error, match):
    with pytest.raises(error, match=match):
        token_ids(value, "x")


def test_vocabulary_bound():
    assert token_ids([0, 9], "x", vocab_size=10) == [0, 9]
    with pytest.raises(ValueError, match=r"^token id 10 in x is outside the vocabulary \[0, 10\) \(at position 1\)$"):
        token_ids([3, 10, 11], "x", vocab_size=10)
    with pytest.raises(ValueError, match=r"^token id -1 in row 2 is outside the vocabulary \[0, 10\) of the model "):
        token_id_array(torch.tensor([-1]), "row 2", vocab_size=10, owner="the model")
    check_vocab([], 10, "x")
    with pytest.raises(ValueError, match=r"token id 12 in y is outside"):
        check_vocab(np.array([12]), 10, "y")


def test_check_id_dtype_takes_any_shape():
    check_id_dtype(np.zeros((2, 3), dtype=np.int64), "batch")
    check_id_dtype(NESTED, "batch")
    floats = torch.nested.as_nested_tensor([torch.tensor([1.0, math.nan]), torch.tensor([3.0])], layout=torch.jagged)
    with pytest.raises(TypeError, match=r"^batch must be integer token ids, got torch.float32 holding NaN; ids are"):
        check_id_dtype(floats, "batch")
    with pytest.raises(TypeError, match=r"got complex64; pass an integer"):
        check_id_dtype(np.zeros(2, dtype=np.complex64), "batch")


# ------------------------------------------------------------------------------------------ one reader everywhere


class Zeros:
    """A reference scorer that would score anything (it is never reached with bad ids)."""

    def log_probs(self, sequences):
        return [torch.zeros(len(s)) for s in sequences]


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ([5, 2.5], r"must be integer token ids, got 2.5 \(float\) at position 1; ids are never rounded or truncated"),
        ([5, True], r"must be integer token ids, got the bool True at position 1"),
        ([5, [6]], r"must be a 1-D sequence of token ids, got a list at position 1 \(a nested or ragged list\)"),
        (np.array([[5, 6]]), r"must be a 1-D sequence of token ids, got shape \(1, 2\)"),
    ],
    ids=["float", "bool", "nested", "2-D"],
)
def test_every_entry_point_reads_ids_alike(bad, problem, tiny_model, tokenizer):
    policy = TransformersWrapper(tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"seed": 0})
    tokens = get_mode("tokens")
    calls = {
        "the action": lambda: action_ids(bad, 49152),
        "ScoredAction.ids": lambda: attach_ref_log_probs(Zeros(), [ScoredAction(bad, prompt_ids=[1, 2])]),
        "tokens mode: observation 0": lambda: tokens.policy_input(
            [bad], input_key=("tokens", "prompt"), pad_token_id=2
        ),
        "observation 1": lambda: tokens.split_batch([[1, 2], bad]),
        "sequence 0": lambda: policy.score_sequences([bad]),
        "observation 0": lambda: TokenStepPolicy(tiny_model, tokenizer).act([bad]),
        "token view 0": lambda: tokens.policy_input(
            [[1, 2]], input_key=("tokens", "prompt"), pad_token_id=2, token_views=[(bad, [False, False])]
        ),
    }
    for what, call in calls.items():
        with pytest.raises(TypeError, match=f"{what} {problem}"):
            call()
