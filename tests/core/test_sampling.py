"""chatenv.sampling: the one generation-settings type, its synonyms, bounds and refusals (tested here once)."""

import math

import numpy as np
import pytest
import torch

from chatenv.sampling import (
    MIN_TEMPERATURE,
    GenerationSettings,
    SettingError,
    SettingTypeError,
    SettingValueError,
    normalize_generate_kwargs,
)


def test_synonyms_map_to_one_canonical_name_each():
    s = normalize_generate_kwargs({"max_tokens": 5, "n": 3, "stop_strings": "END", "top_k": -1, "min_tokens": 2})
    assert (s.max_new_tokens, s.num_samples, s.stop, s.top_k, s.min_new_tokens) == (5, 3, ("END",), 0, 2)
    assert s.explicit == {"max_new_tokens", "num_samples", "stop", "top_k", "min_new_tokens"}
    assert normalize_generate_kwargs({"num_return_sequences": 2}).num_samples == 2
    assert normalize_generate_kwargs({"do_sample": False}).greedy
    assert normalize_generate_kwargs({"max_tokens": 5, "max_new_tokens": 5}).max_new_tokens == 5  # same value twice
    assert normalize_generate_kwargs(None) == GenerationSettings()


def test_accepted_values_at_the_bounds():
    s = normalize_generate_kwargs(
        {
            "temperature": MIN_TEMPERATURE,
            "top_p": 1,
            "min_p": 0,
            "repetition_penalty": 1e-3,
            "presence_penalty": -2,
            "frequency_penalty": 2,
            "max_new_tokens": 2.0,  # a whole float is that int
            "stop_token_ids": [torch.tensor(5), np.int64(6)],
            "seed": None,
            "top_k": None,
        }
    )
    assert (s.temperature, s.max_new_tokens, s.stop_token_ids, s.seed, s.top_k) == (1e-4, 2, (5, 6), None, 0)
    assert isinstance(s.max_new_tokens, int) and normalize_generate_kwargs({"temperature": 0}).greedy


@pytest.mark.parametrize(
    ("kwargs", "error", "key", "fix"),
    [
        ({"max_new_tokens": 0}, SettingValueError, "max_new_tokens", "must be >= 1, got 0"),
        ({"max_new_tokens": -3}, SettingValueError, "max_new_tokens", "must be >= 1, got -3"),
        ({"max_tokens": 2.5}, SettingTypeError, "max_tokens", "must be an int >= 1, got 2.5"),
        ({"n": 0}, SettingValueError, "n", "must be >= 1"),
        ({"n": True}, SettingTypeError, "n", "must be an int >= 1, got True"),
        ({"temperature": 1e-40}, SettingValueError, "temperature", "is too small to sample with (1e-40"),
        ({"temperature": math.inf}, SettingValueError, "temperature", "must be a finite number in [0.0, inf], got inf"),
        ({"top_p": math.nan}, SettingValueError, "top_p", "must be a finite number in (0.0, 1.0], got nan"),
        ({"top_k": 2.5}, SettingTypeError, "top_k", "must be an int >= 0, got 2.5"),
        ({"stop": ["END", 3]}, SettingTypeError, "stop", "must be a non-empty str or a list of them"),
        ({"stop_token_ids": [-1]}, SettingValueError, "stop_token_ids", "must be >= 0, got -1"),
        ({"stop_token_ids": [torch.tensor(2.5)]}, SettingTypeError, "stop_token_ids", "must be an int >= 0"),
        ({"seed": 1.5}, SettingTypeError, "seed", "must be an int >= 0, got 1.5"),
        ({"temperature": 1e-5}, SettingValueError, "temperature", "use temperature=0 for greedy decoding, or a"),
        ({"temperature": -1}, SettingValueError, "temperature", "must be in [0.0, inf], got -1.0"),
        ({"temperature": math.nan}, SettingValueError, "temperature", "must be a finite number in [0.0, inf]"),
        ({"temperature": "hot"}, SettingTypeError, "temperature", "must be a number in [0.0, inf], got 'hot'"),
        ({"top_p": 0}, SettingValueError, "top_p", "must be in (0.0, 1.0], got 0.0"),
        ({"min_p": 1.5}, SettingValueError, "min_p", "must be in [0.0, 1.0], got 1.5"),
        ({"repetition_penalty": 0}, SettingValueError, "repetition_penalty", "must be in (0.0, inf]"),
        ({"presence_penalty": 3}, SettingValueError, "presence_penalty", "must be in [-2.0, 2.0], got 3.0"),
        ({"top_k": -3}, SettingValueError, "top_k", "must be >= 0 (0 or -1: no top-k filter), got -3"),
        ({"stop": [""]}, SettingTypeError, "stop", "an empty stop string would match before any token"),
        ({"stop_strings": 5}, SettingTypeError, "stop_strings", "must be a non-empty str or a list of them, got 5"),
        ({"stop_token_ids": "5"}, SettingTypeError, "stop_token_ids", "must be a list of token ids"),
        ({"ignore_eos": 1}, SettingTypeError, "ignore_eos", "must be a bool (True or False), got 1"),
        ({"seed": -1}, SettingValueError, "seed", "must be >= 0, got -1"),
        ({"min_tokens": 3, "max_tokens": 2}, SettingValueError, "min_tokens", "(3) exceeds max_tokens=2"),
    ],
)
def test_refusals_name_the_setting_and_the_fix(kwargs, error, key, fix):
    with pytest.raises(error) as e:
        normalize_generate_kwargs(kwargs)
    assert isinstance(e.value, SettingError)
    assert str(e.value) == f"generate_kwargs[{key!r}] {e.value.problem}" and fix in e.value.problem
    # each edge words the same refusal with its own name for the setting
    assert e.value.describe("--flag") == f"--flag {e.value.problem}"
    renamed = e.value.renamed("max_new_tokens")
    assert type(renamed) is type(e.value) and str(renamed) == f"max_new_tokens {e.value.problem}"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"temprature": 0.5}, TypeError, "unknown generation setting 'temprature'; did you mean 'temperature'?"),
        ({"max_new_token": 8}, TypeError, "did you mean 'max_new_tokens'?"),
        ({"frobnicate": 8}, TypeError, "known settings: do_sample, frequency_penalty, grammar, ignore_eos, max_new_"),
        ({"n": 2, "num_return_sequences": 3}, ValueError, "'num_samples' twice with different values: n=2 and num_"),
        ({"max_tokens": 5, "max_new_tokens": 6}, ValueError, "sets 'max_new_tokens' twice with different values"),
        ({"do_sample": False, "temperature": 0.7}, ValueError, "do_sample=False (greedy) conflicts"),
        ({"do_sample": True, "temperature": 0}, ValueError, "do_sample=True conflicts with temperature=0"),
        ({"do_sample": 1}, TypeError, "generate_kwargs['do_sample'] must be a bool"),
    ],
)
def test_refusals_of_names_and_conflicts(kwargs, error, message):
    with pytest.raises(error) as e:
        normalize_generate_kwargs(kwargs)
    assert message in str(e.value) and e.value.describe("x") == str(e.value)


def test_budget_set_elsewhere_leaves_min_new_tokens_unbounded_by_the_default():
    with pytest.raises(ValueError, match="exceeds max_new_tokens=256"):
        normalize_generate_kwargs({"min_new_tokens": 300})
    s = normalize_generate_kwargs({"min_new_tokens": 300}, budget_elsewhere=True)
    assert (s.min_new_tokens, s.max_new_tokens, s.explicit) == (300, 300, {"min_new_tokens"})
    with pytest.raises(ValueError, match="exceeds max_new_tokens=10"):
        normalize_generate_kwargs({"min_new_tokens": 300, "max_new_tokens": 10}, budget_elsewhere=True)


def test_checked_settings_pass_as_they_are_and_copies_are_checked():
    s = normalize_generate_kwargs({"temperature": 0.7, "stop_token_ids": [5]})
    assert normalize_generate_kwargs(s) is s
    assert s.as_kwargs() == {"temperature": 0.7, "stop_token_ids": (5,)}
    assert s.with_overrides(top_k=4).as_kwargs() == {"temperature": 0.7, "stop_token_ids": (5,), "top_k": 4}
    with pytest.raises(SettingValueError, match="top_p"):
        s.with_overrides(top_p=2)
    bare = s.without("stop_token_ids").without("temperature")
    assert bare == GenerationSettings() and not bare.explicit
    assert (
        s.reshapes_distribution and not normalize_generate_kwargs({"temperature": 0, "top_k": 3}).reshapes_distribution
    )
