"""A chat-completions body mapped to the core's sampling settings: each field to its setting, refusals by field."""

import pytest

from chatenv.sampling import GenerationSettings
from chatenv.serve.chat.request import parse_request
from chatenv.serve.errors import APIError
from chatenv.serve.request import SAMPLING_FIELDS, sampling_settings

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("field", "value", "setting", "expected"),
    [
        ("temperature", 0, "temperature", 0.0),
        ("temperature", 2, "temperature", 2.0),
        ("top_p", 0.5, "top_p", 0.5),
        ("presence_penalty", -1.5, "presence_penalty", -1.5),
        ("frequency_penalty", 2, "frequency_penalty", 2.0),
        ("top_k", 5, "top_k", 5),
        ("top_k", -1, "top_k", 0),
        ("min_p", 0.1, "min_p", 0.1),
        ("repetition_penalty", 1.2, "repetition_penalty", 1.2),
        ("min_tokens", 3, "min_new_tokens", 3),
        ("max_tokens", 7, "max_new_tokens", 7),
        ("max_completion_tokens", 9, "max_new_tokens", 9),
        ("stop", "END", "stop", ("END",)),
        ("stop", ["a", "b", "c", "d"], "stop", ("a", "b", "c", "d")),
        ("seed", 11, "seed", 11),
        ("n", 16, "num_samples", 16),
    ],
)
def test_each_field_maps_to_its_setting(field, value, setting, expected):
    settings = sampling_settings({field: value})
    assert SAMPLING_FIELDS[field] == setting
    assert getattr(settings, setting) == expected and settings.explicit == {setting}


def test_the_request_reads_its_settings():
    body = {**BODY, "temperature": 0.5, "top_k": -1, "n": 2, "stop": "x", "seed": 3, "max_tokens": 9}
    req = parse_request({**body, "max_completion_tokens": 5, "presence_penalty": 0, "min_tokens": 2})
    assert (req.n, req.max_tokens, req.stop, req.seed) == (2, 5, ("x",), 3)  # max_completion_tokens wins
    # what the policy is asked for besides the endpoint's own fields; a penalty at 0 is not asked for
    assert req.generate_kwargs == {"temperature": 0.5, "top_k": 0, "min_new_tokens": 2}
    plain = parse_request({**BODY, "stop": None, "seed": None})
    assert plain.settings == GenerationSettings() and not plain.settings.explicit
    assert (plain.n, plain.max_tokens, plain.stop, plain.seed, plain.generate_kwargs) == (1, None, (), None, {})
    # the reply budget is the endpoint's when the request sets none: min_tokens is bounded by it later
    assert parse_request({**BODY, "min_tokens": 400}).generate_kwargs == {"min_new_tokens": 400}


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"temperature": -1}, "temperature", "'temperature' must be in [0.0, inf], got -1.0"),
        ({"temperature": 1e-5}, "temperature", "'temperature' is too small to sample with"),
        ({"temperature": 3.5}, "temperature", "'temperature' must be in [0, 2], got 3.5"),
        ({"top_p": 0}, "top_p", "'top_p' must be in (0.0, 1.0], got 0.0"),
        ({"top_k": -3}, "top_k", "'top_k' must be >= 0 (0 or -1: no top-k filter), got -3"),
        ({"repetition_penalty": 0}, "repetition_penalty", "'repetition_penalty' must be in (0.0, inf]"),
        ({"min_tokens": -1}, "min_tokens", "'min_tokens' must be >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "'min_tokens' (5) exceeds max_new_tokens=2"),
        ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be >= 1, got 0"),
        ({"max_completion_tokens": "8"}, "max_completion_tokens", "'max_completion_tokens' must be an int >= 1"),
        ({"stop": [""]}, "stop", "'stop' must be a non-empty str or a list of them"),
        ({"stop": 5}, "stop", "'stop' must be a non-empty str or a list of them, got 5"),
        ({"stop": ["a"] * 5}, "stop", "'stop' may hold at most 4 strings"),
        ({"seed": True}, "seed", "'seed' must be an int >= 0, got True"),
        ({"n": 0}, "n", "'n' must be >= 1, got 0"),
        ({"n": 17}, "n", "'n' must be in [1, 16], got 17"),
        ({"presence_penalty": 2.5}, "presence_penalty", "'presence_penalty' must be in [-2.0, 2.0], got 2.5"),
    ],
)
def test_refusals_name_the_field(extra, param, message):
    with pytest.raises(APIError) as e:
        parse_request({**BODY, **extra})
    assert (e.value.status, e.value.param, e.value.code) == (400, param, None)
    assert e.value.message.startswith(message), e.value.message


def test_unsupported_fields_are_refused():
    for extra, param in [({"logit_bias": {"5": 3}}, "logit_bias"), ({"frobnicate": 1}, "frobnicate")]:
        with pytest.raises(APIError) as e:
            parse_request({**BODY, **extra})
        assert (e.value.param, e.value.code) == (param, "unsupported_parameter")
    assert parse_request({**BODY, "logit_bias": {}, "store": False}).generate_kwargs == {}
