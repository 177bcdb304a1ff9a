"""PolicyConfig: every option in one validated value; versions change only what is asked and lose nothing."""

import dataclasses

import pytest
from helpers import history_td

from wrappers.policies import PolicyConfig, TransformersWrapper

EVERYTHING = {
    "template": "chatml",
    "input_mode": "text",
    "input_key": ("obs", "text"),
    "attention_mask_key": "mask",
    "generate": True,
    "generate_kwargs": {
        "max_new_tokens": 9,
        "min_new_tokens": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 30,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "stop": ["END"],
        "stop_token_ids": [7],
        "seed": 3,
    },
    "raw_log_probs": True,
    "pad_output": False,
    "num_samples": 2,
    "inplace": "empty",
    "history_key": "h",
    "text_key": ["out", "text"],
    "tokens_key": "toks",
    "masks_key": "m",
    "log_probs_key": "lp",
}


def test_config_holds_and_checks_every_option():
    c = PolicyConfig.from_arguments(**EVERYTHING)
    assert c.text_key == ("out", "text") and c.input_key == ("obs", "text") == c.resolved_input_key
    assert c.settings.num_samples == 2 and c.settings.stop_token_ids == (7,) and c.resolved_inplace == "empty"
    assert c.out_keys == ["toks", "m", "lp", ("out", "text")]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.generate = False
    # replace() re-validates
    with pytest.raises(ValueError, match="inplace=True"):
        dataclasses.replace(c, inplace=True)
    with pytest.raises(ValueError, match="input_mode"):
        dataclasses.replace(c, input_mode="chat")
    with pytest.raises(ValueError, match="num_samples applies to generation"):
        dataclasses.replace(c, generate=False)
    with pytest.raises(ValueError, match="return_log_probs=False"):
        PolicyConfig.from_arguments(generate=False, return_log_probs=False)
    with pytest.raises(ValueError, match="positive int"):
        PolicyConfig.from_arguments(num_samples=0)
    with pytest.raises(ValueError, match="tokens_key"):
        PolicyConfig.from_arguments(tokens_key=None)
    # n in the generation settings is num_samples; both given must agree
    assert PolicyConfig.from_arguments(generate_kwargs={"n": 3}).num_samples == 3
    with pytest.raises(ValueError, match="conflicts"):
        PolicyConfig.from_arguments(num_samples=2, generate_kwargs={"n": 3})


def test_evolve_rederives_what_depends_on_the_change():
    c = PolicyConfig.from_arguments(num_samples=2, inplace="empty", generate_kwargs={"temperature": 0.8})
    scoring = c.evolve(generate=False)
    assert scoring.num_samples is None and scoring.settings.num_samples == 1 and scoring.inplace is None
    assert scoring.resolved_input_key == ("history", "full") and scoring.settings.temperature == 0.8
    back = scoring.evolve(generate=True, input_mode="tokens")
    assert back.resolved_input_key == ("tokens", "prompt")
    # generate_kwargs merge into the settings; n among them sets num_samples
    merged = c.evolve(generate_kwargs={"top_k": 5, "n": 4})
    assert (merged.settings.temperature, merged.settings.top_k, merged.num_samples) == (0.8, 5, 4)
    assert c.evolve(num_samples=3).settings.num_samples == 3
    # a scoring version of a generator without log-probs returns log-probs
    quiet = PolicyConfig.from_arguments(return_log_probs=False)
    assert quiet.evolve(generate=False).return_log_probs
    with pytest.raises(TypeError, match="did you mean 'pad_output'"):
        c.evolve(pad_outputs=True)
    with pytest.raises(ValueError, match="num_samples applies to generation"):
        c.evolve(generate=False, num_samples=2)


def test_versions_keep_every_option(tiny_model, tokenizer):
    policy = TransformersWrapper(tiny_model, tokenizer=tokenizer, score_batch_size=2, **EVERYTHING)
    for change in [{"pad_output": True}, {"masks_key": "mm"}, {"raw_log_probs": False}, {"generate_kwargs": {}}]:
        version = policy.get_new_version(**change)
        name, value = next(iter(change.items()))
        expected = policy.config if name == "generate_kwargs" else dataclasses.replace(policy.config, **change)
        assert version.config == expected, change
        assert version.model is policy.model and version.score_batch_size == 2
        assert version.chat_tokenizer is policy.chat_tokenizer and version.stop_ids == policy.stop_ids
    assert policy.get_new_version(score_batch_size=1).score_batch_size == 1
    with pytest.raises(TypeError, match="unknown policy option"):
        policy.get_new_version(engine_kwargs={})


def test_version_of_a_subclass_is_that_subclass(tiny_model, tokenizer):
    class Counting(TransformersWrapper):
        calls = 0

        def forward(self, tensordict):
            self.calls += 1
            return super().forward(tensordict)

    scorer = Counting(tiny_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 3}).get_new_version(
        generate=False
    )
    assert type(scorer) is Counting and scorer.calls == 0


def test_attributes_are_read_only_views_of_the_config(tiny_model, tokenizer):
    policy = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 4})
    assert (policy.input_mode, policy.input_key, policy.generate) == ("history", ("history", "prompt"), True)
    assert policy.inplace is True and policy.num_samples is None and policy.settings.max_new_tokens == 4
    assert policy.pad_token_id == 2 and policy.stop_ids == (2,)
    for name, value in [("input_mode", "text"), ("num_samples", 2), ("tokens_key", "x"), ("pad_token_id", 0)]:
        with pytest.raises(AttributeError):
            setattr(policy, name, value)
    with pytest.raises(AttributeError, match="get_new_version"):
        policy.generate = False
    out = policy(history_td())
    assert out["tokens"].response.shape[0] == 3


def test_the_settings_type_is_the_cores():
    import chatenv.sampling
    import wrappers.policies

    assert wrappers.policies.GenerationSettings is chatenv.sampling.GenerationSettings
    assert wrappers.policies.normalize_generate_kwargs is chatenv.sampling.normalize_generate_kwargs
    config = PolicyConfig.from_arguments(generate_kwargs=chatenv.sampling.normalize_generate_kwargs({"n": 2}))
    assert config.num_samples == 2 and config.settings.num_samples == 2
