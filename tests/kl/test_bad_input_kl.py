"""Bad input and faults in the KL / reference / Ray layer: each gives its exact error type and a message naming the
problem, and changes nothing (env state, controller coefficient, the tensordict).

Ray faults that need a cluster (a factory that raises or returns the wrong thing, remote errors, a dead actor) are
in tests/kl/test_ray_ref.py, which starts one cluster for all of them."""

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from transformers import LlamaConfig, LlamaForCausalLM

from chatenv import ChatEnv, LogProbs, ScoredAction, rollout
from wrappers.kl import (
    AdaptiveKLController,
    ConstantKLController,
    KLComputation,
    KLPenalty,
    RayRefModel,
    ReferenceModel,
    RefLogProbs,
    RetrieveLogProb,
    VectorRefLogProbs,
)
from wrappers.policies import TransformersWrapper
from wrappers.rollout_from_model import RolloutFromModel

PROMPT = [1, 4093, 198, 22, 2, 198, 1, 520, 9531, 198]


def small_vocab_llama(vocab_size=1000):
    """A real one-layer Llama with a vocabulary smaller than SmolLM2's tokenizer (49152 ids)."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    return LlamaForCausalLM(config).eval()


def tokens_env():
    return ChatEnv("arithmetic", input_mode="tokens")


class NotAScorer:
    pass


@pytest.fixture(scope="module")
def ref(ref_tiny, tokenizer):
    return ReferenceModel(ref_tiny, tokenizer)


@pytest.fixture(scope="module")
def nan_ref(tokenizer):
    """A real model whose weights went NaN (as after a diverged update)."""
    model = make_tiny_llama(seed=2)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.fill_(math.nan)
    return ReferenceModel(model, tokenizer)


# ------------------------------------------------------------------------------------------ ReferenceModel


def _embeddings_smaller_than_config():
    model = small_vocab_llama(1000)
    model.config.vocab_size = 49152  # the config claims the tokenizer's size; the embedding has 1000 rows
    return {"model": model}


SMALL_VOCAB = (
    r"the reference model LlamaForCausalLM knows 1000 token ids \(config.vocab_size 1000, input embedding rows 1000, "
    r"lm_head rows 1000\) but its tokenizer has 49152: ids 1000..49151 would have no log-prob; pass the tokenizer the "
    r"model was trained with, or resize its embeddings"
)
REFERENCE_CONSTRUCTION = {
    "config vocab too small": (lambda: {"model": small_vocab_llama(1000)}, ValueError, SMALL_VOCAB),
    "embeddings too small": (_embeddings_smaller_than_config, ValueError, r"\(config.vocab_size 49152, input embedd"),
    "temperature 0": (lambda: {"temperature": 0}, ValueError, "temperature must be a finite number > 0, got 0$"),
    "temperature -1": (lambda: {"temperature": -1.0}, ValueError, "finite number > 0, got -1.0"),
    "temperature nan": (lambda: {"temperature": math.nan}, ValueError, "finite number > 0, got nan"),
    "temperature inf": (lambda: {"temperature": math.inf}, ValueError, "finite number > 0, got inf"),
    "temperature tiny": (lambda: {"temperature": 1e-5}, ValueError, r"1e-05 is too small: .* a temperature >= 0.0001"),
    "temperature str": (lambda: {"temperature": "0.7"}, TypeError, "temperature must be a number, got str '0.7'"),
    "temperature bool": (lambda: {"temperature": True}, TypeError, "temperature must be a number, got bool"),
    "batch_size 0": (lambda: {"batch_size": 0}, ValueError, r"batch_size must be >= 1 \(or None"),
    "batch_size float": (lambda: {"batch_size": 2.5}, TypeError, "batch_size must be an int or None, got float"),
    "kv_cache_size -1": (lambda: {"kv_cache_size": -1}, ValueError, r"kv_cache_size must be >= 0 \(0: no incremental"),
    "kv_cache_size None": (lambda: {"kv_cache_size": None}, TypeError, "kv_cache_size must be an int, got NoneType"),
    "kv_cache_size bool": (lambda: {"kv_cache_size": True}, TypeError, "kv_cache_size must be an int, got bool"),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_CONSTRUCTION))
def test_reference_model_construction_refuses(case, ref_tiny, tokenizer):
    make, exc, match = REFERENCE_CONSTRUCTION[case]
    kwargs = {"model": ref_tiny, **make()}
    with pytest.raises(exc, match=match):
        ReferenceModel(kwargs.pop("model"), tokenizer, **kwargs)


REFERENCE_INPUTS = {
    "id above the vocabulary": (
        [[1, 60000]],
        ValueError,
        r"token id 60000 in sequence 0 is outside the vocabulary \[0, \d+\) of the reference model \(at position 1\)",
    ),
    "negative id": ([[1, 5], [1, -1]], ValueError, "token id -1 in sequence 1 is outside"),
    "empty sequence": ([[1, 2], []], ValueError, r"sequence 1 is empty: .* \(score the prompt and the reply together"),
    "float ids": ([[1.5, 2.0]], TypeError, r"sequence 0 must be integer token ids, got 1.5 \(float\) at position 0"),
    "float tensor": ([torch.tensor([1.0, 2.0])], TypeError, "got torch.float32"),
    "bool ids": ([np.array([True, False])], TypeError, "must be integer token ids, got bool"),
    "text": (["hello"], TypeError, r"sequence 0 must be token ids, got a str \('hello'\); tokenize text first"),
    "2-D sequence": ([[[1, 2]]], TypeError, "sequence 0 must be a 1-D sequence of token ids, got a list at position 0"),
    "ragged sequence": ([[1, [2, 3]]], TypeError, r"got a list at position 1 \(a nested or ragged list\)"),
    "not a list": (5, TypeError, "expected a list of token id sequences, got int"),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_INPUTS))
def test_reference_log_probs_refuses(case, ref):
    sequences, exc, match = REFERENCE_INPUTS[case]
    with pytest.raises(exc, match=match):
        ref.log_probs(sequences)
    assert ref.log_probs([]) == []  # no sequences: no rows (not an error)
    assert ref.log_probs([[7]])[0].isnan().all()  # one token: only the undefined position 0


def test_nan_weights_are_named(nan_ref):
    with pytest.raises(
        ValueError,
        match=r"the reference model LlamaForCausalLM gave a non-finite log-prob \(nan\) for sequence 0 at position 1 "
        r"of 3: its weights or activations are NaN or inf",
    ):
        nan_ref.log_probs([[1, 2, 3]])
    env = KLPenalty(tokens_env(), 0.1, ref_model=nan_ref)
    obs, _ = env.reset(seed=0)
    with pytest.raises(ValueError, match="the reference model LlamaForCausalLM gave a non-finite log-prob"):
        env.step(ScoredAction([16, 2], [-1.0, -1.0]))
    assert np.array_equal(env.unwrapped.token_ids, obs)  # refused before the env moved


# ------------------------------------------------------------------------------------------ KLPenalty settings

KL_PENALTY_SETTINGS = {
    "kl nan": ({"kl": math.nan}, ValueError, "kl must be a finite number >= 0, got nan"),
    "kl inf": ({"kl": math.inf}, ValueError, "kl must be a finite number >= 0, got inf"),
    "kl negative": ({"kl": -1}, ValueError, r"kl must be a finite number >= 0, got -1.0"),
    "kl str": ({"kl": "x"}, TypeError, "kl must be a number, got str"),
    "estimator typo": ({"kl": 0.1, "estimator": "kl1"}, ValueError, r"'k3', got 'kl1'; did you mean 'k1'\?"),
    "estimator case": ({"kl": 0.1, "estimator": "K2"}, ValueError, r"got 'K2'; did you mean 'k2'\?"),
    "estimator unknown": ({"kl": 0.1, "estimator": "forward"}, ValueError, r"got 'forward'$"),
    "neither": ({}, ValueError, r"KLPenalty needs kl=...: a constant coefficient \(e.g. kl=0.1\) or a controller"),
    "old coef": ({"coef": 0.1}, TypeError, r"KLPenalty takes kl=... now, not coef= \(one KL vocabulary"),
    "old controller": ({"controller": ConstantKLController()}, TypeError, r"KLPenalty takes kl=... now, not controlle"),
    "unknown keyword": ({"kl": 0.1, "cof": 0.1}, TypeError, r"KLPenalty got an unexpected keyword argument 'cof'"),
    "controller half made": (
        {"kl": type("Half", (), {"update": lambda self, kl: None})()},
        TypeError,
        r"kl must be a KL controller \(with .coef and .update\(kl_values\)\)",
    ),
    "ref_model cannot score": ({"kl": 0.1, "ref_model": NotAScorer()}, TypeError, r"method, got NotAScorer"),
    "no reference at all": ({"kl": 0.1, "ref_model": None}, ValueError, "needs reference log-probs: wrap the env"),
}


@pytest.mark.parametrize("case", sorted(KL_PENALTY_SETTINGS))
def test_kl_penalty_settings_refused(case, ref):
    kwargs, exc, match = KL_PENALTY_SETTINGS[case]
    with pytest.raises(exc, match=match):
        KLPenalty(tokens_env(), **{"ref_model": ref, **kwargs})


# ------------------------------------------------------------------------------------------ policy vs reference


class DroppingReference(ReferenceModel):
    """The real reference whose answer loses its last value (as a buggy remote scorer would)."""

    def log_probs(self, sequences):
        return [row[:-1] for row in super().log_probs(sequences)]


class SilentReference(ReferenceModel):
    """The real reference that answers no rows at all."""

    def log_probs(self, sequences):
        super().log_probs(sequences)
        return []


POLICY = r"the policy's log-probs \(ScoredAction.log_probs\)"
REF = r"the precomputed reference log-probs \(ScoredAction.ref_log_probs\)"
IDS, LP = [16, 2], [-1.0, -1.0]
STEP_CASES = {
    "policy too short": (ScoredAction(IDS, [-1.0]), ValueError, f"{POLICY} has 1 values for 2 generated tokens"),
    "reference too long": (ScoredAction(IDS, LP, [-1.0] * 3), ValueError, f"{REF} has 3 values for 2 generated"),
    "policy NaN": (ScoredAction(IDS, [-1.0, math.nan]), ValueError, rf"{POLICY} is not finite at token 1 of 2 \(nan\)"),
    "policy inf": (ScoredAction(IDS, [math.inf, -1.0]), ValueError, rf"{POLICY} is not finite at token 0 of 2 \(inf\)"),
    "reference -inf": (ScoredAction(IDS, LP, [-1.0, -math.inf]), ValueError, rf"{REF} is not finite at token 1 of 2"),
    "probabilities": (ScoredAction(IDS, [0.5, 0.25]), ValueError, rf"{POLICY} is positive at token 0 of 2 \(0.5\): l"),
    "policy not numbers": (ScoredAction(IDS, ["a", "b"]), TypeError, f"{POLICY} must be numbers, got list"),
    "policy 2-D": (ScoredAction(IDS * 2, np.full((2, 2), -1.0)), ValueError, rf"{POLICY} must be one value per gen"),
    "no policy log-probs": (np.array(IDS), ValueError, r"needs the policy's generation log-probs with the action"),
}


@pytest.mark.parametrize("case", sorted(STEP_CASES))
def test_bad_step_leaves_env_and_controller_unchanged(case, ref):
    action, exc, match = STEP_CASES[case]
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=0.01, horizon=10)
    env = KLPenalty(RefLogProbs(tokens_env(), ref), kl=ctl)
    obs, _ = env.reset(seed=0)
    with pytest.raises(exc, match=match):
        env.step(action)
    assert np.array_equal(env.unwrapped.token_ids, obs) and env.unwrapped.turn == 0
    assert ctl.coef == 0.2


@pytest.mark.parametrize(
    "scorer, match",
    [
        (DroppingReference, r"the reference model \(DroppingReference\) returned \d+ log-probs for sequence 0 of \d+"),
        (SilentReference, r"the reference model \(SilentReference\) returned 0 rows of log-probs for 1 sequences"),
    ],
)
def test_reference_answers_of_the_wrong_shape(scorer, match, ref_tiny, tokenizer):
    env = RefLogProbs(tokens_env(), scorer(ref_tiny, tokenizer))
    obs, _ = env.reset(seed=0)
    with pytest.raises(ValueError, match=match):
        env.step(np.array(IDS))
    assert np.array_equal(env.unwrapped.token_ids, obs)


# ------------------------------------------------------------------------------------------ controllers

CONTROLLER_SETTINGS = {
    "init_kl_coef negative": ({"init_kl_coef": -0.1}, ValueError, "init_kl_coef must be a finite number > 0, got -0.1"),
    "init_kl_coef nan": ({"init_kl_coef": math.nan}, ValueError, "init_kl_coef must be a finite number > 0, got nan"),
    "init_kl_coef zero": ({"init_kl_coef": 0.0}, ValueError, "init_kl_coef must be a finite number > 0, got 0.0"),
    "target zero": ({"target": 0}, ValueError, "target must be a finite number > 0, got 0"),
    "target negative": ({"target": -6.0}, ValueError, "target must be a finite number > 0, got -6.0"),
    "target nan": ({"target": math.nan}, ValueError, "target must be a finite number > 0, got nan"),
    "horizon zero": ({"horizon": 0}, ValueError, "horizon must be a finite number > 0, got 0"),
    "horizon negative": ({"horizon": -10}, ValueError, "horizon must be a finite number > 0, got -10"),
    "horizon str": ({"horizon": "10"}, TypeError, "horizon must be a number, got str"),
}


@pytest.mark.parametrize("case", sorted(CONTROLLER_SETTINGS))
def test_adaptive_controller_settings_refused(case):
    kwargs, exc, match = CONTROLLER_SETTINGS[case]
    with pytest.raises(exc, match=match):
        AdaptiveKLController(**kwargs)


def test_constant_controller_refuses_nan():
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0, got nan"):
        ConstantKLController(math.nan)


UPDATES = {
    "no values": (([],), ValueError, "expected at least one observed KL value, got none; skip the update"),
    "NaN value": (([1.0, math.nan],), ValueError, r"KL values must be finite, got nan \(NaN or inf\) at index 1"),
    "inf tensor": ((torch.tensor([math.inf]),), ValueError, "KL values must be finite, got inf"),
    "negative n_steps": (([1.0],), ValueError, "n_steps must be >= 0, got -1", {"n_steps": -1}),
    "float n_steps": (([1.0],), TypeError, "n_steps must be an int, got float", {"n_steps": 2.0}),
    "text value": ((["0.5"],), TypeError, "KL values must be numbers, got str '0.5' at index 0"),
    "nested value": (([[1.0, 2.0]],), TypeError, r"KL values must be numbers, got list \[1.0, 2.0\] at index 0"),
    "None": ((None,), TypeError, r"expected KL values \(a number, a list or a tensor\), got NoneType"),
}


@pytest.mark.parametrize("controller", ["adaptive", "constant"])
@pytest.mark.parametrize("case", sorted(UPDATES))
def test_refused_update_leaves_the_coefficient(case, controller):
    args, exc, match, *kwargs = UPDATES[case]
    ctl = AdaptiveKLController(0.2, target=1.0, horizon=10) if controller == "adaptive" else ConstantKLController(0.2)
    with pytest.raises(exc, match=match):
        ctl.update(*args, **(kwargs[0] if kwargs else {}))
    assert ctl.coef == 0.2
    assert ctl.update([2.0]) == (pytest.approx(0.2 * (1 + 0.2 / 10)) if controller == "adaptive" else 0.2)


# ------------------------------------------------------------------------------------------ transforms


@pytest.fixture(scope="module")
def rollout_td(tiny_model, ref, tokenizer):
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 5, "seed": 1}
    )
    td = rollout([tokens_env() for _ in range(2)], policy, episodes=2, seed=0)
    return RetrieveLogProb(ref)(td)


def _leaves(td):
    return {k: td.get(k).clone() for k in td.keys(include_nested=True, leaves_only=True)}


def _shorter_reference(td):
    lp = td["ref_log_probs"]
    responses = [r[:-1] if i == 1 else r for i, r in enumerate(lp.unpadded("response"))]
    td["ref_log_probs"] = LogProbs.from_sequences(lp.unpadded("prompt"), responses, padded=True, pad_value=math.nan)


def _nan_reference(td):
    last = int(td["masks"].all_assistant_mask[0].nonzero()[-1])  # row 0's last generated token: it counts
    td["ref_log_probs"].full[0, last] = math.nan


MISSING_REF = (
    r"KLComputation needs the reference log-probs \(RetrieveLogProb writes them\) \(LogProbs\) at 'ref_log_probs'; "
    r"the tensordict has keys \[.*'log_probs'.*'tokens'.*\]"
)
MISMATCH = (
    r"row 1: the generation log-probs at 'log_probs' have \d+ positions, the reference log-probs at 'ref_log_probs' "
    r"\d+ and the assistant mask \d+; all must cover the same tokens"
)
TRANSFORM_CASES = {
    "missing reference": (lambda td: td.exclude("ref_log_probs"), KeyError, MISSING_REF),
    "missing masks": (
        lambda td: td.exclude("masks"),
        KeyError,
        r"needs the assistant masks \(Masks\) at 'masks'; the ",
    ),
    "missing task reward": (lambda td: td.exclude(("next", "reward")), KeyError, r"needs \('next', 'reward'\) \(the"),
    "log-probs a tensor": (lambda td: td.set("log_probs", td["log_probs"].full), TypeError, "LogProbs, got Tensor"),
    "shorter reference": (_shorter_reference, ValueError, MISMATCH),
    "reference NaN": (_nan_reference, ValueError, r"row 0: the reference log-probs at 'ref_log_probs' are undefined"),
}


@pytest.mark.parametrize("case", sorted(TRANSFORM_CASES))
def test_kl_computation_refuses_and_leaves_the_tensordict(case, rollout_td):
    edit, exc, match = TRANSFORM_CASES[case]
    td = rollout_td.clone()
    edited = edit(td)
    td = td if edited is None else edited
    before = _leaves(td)
    with pytest.raises(exc, match=match):
        KLComputation(0.1)(td)
    after = _leaves(td)
    assert after.keys() == before.keys()
    for k, v in before.items():
        torch.testing.assert_close(after[k], v, rtol=0, atol=0, equal_nan=True)


class CoefOnly:
    """Has a coefficient but no update: not a controller."""

    coef = 0.1


def broken_controller():
    """An adaptive controller whose coefficient went NaN."""
    ctl = AdaptiveKLController(0.1)
    ctl.coef = math.nan
    return ctl


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"kl": -0.1}, ValueError, "kl must be a finite number >= 0, got -0.1"),
        ({"kl": math.nan}, ValueError, "kl must be a finite number >= 0, got nan"),
        ({"kl": 0.1, "estimator": "k0"}, ValueError, r"got 'k0'; did you mean"),
        ({"kl": broken_controller()}, ValueError, r"AdaptiveKLController.coef must be a finite number >= 0, got nan"),
        (
            {"kl": CoefOnly()},
            TypeError,
            r"kl must be a KL controller \(with .coef and .update\(kl_values\)\), got Coef",
        ),
    ],
    ids=["negative", "nan", "estimator", "controller nan", "controller without update"],
)
def test_kl_computation_settings_refused(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        KLComputation(**kwargs)


def test_retrieve_log_prob_refuses(rollout_td, ref):
    with pytest.raises(TypeError, match=r"ref_model must have a log_probs\(sequences\) method, got NotAScorer"):
        RetrieveLogProb(NotAScorer())
    td = rollout_td.exclude("tokens", "ref_log_probs")
    with pytest.raises(KeyError, match=r"RetrieveLogProb needs the tokens to score \(Tokens\) at 'tokens'; the tens"):
        RetrieveLogProb(ref)(td)
    assert "ref_log_probs" not in td.keys()


# ------------------------------------------------------------------------------------------ RolloutFromModel

ROLLOUT_SETTINGS = {
    "max_new_tokens 0": ({"max_new_tokens": 0}, ValueError, r"max_new_tokens must be >= 1 \(steps per reply\), got 0"),
    "max_new_tokens float": ({"max_new_tokens": 2.5}, TypeError, "max_new_tokens must be an int, got float 2.5"),
    "score_clip 0": ({"score_clip": 0}, ValueError, "score_clip must be a finite number > 0, got 0"),
    "score_clip nan": ({"score_clip": math.nan}, ValueError, "score_clip must be a finite number > 0, got nan"),
    "score_clip negative": ({"score_clip": -1.0}, ValueError, "score_clip must be a finite number > 0, got -1.0"),
    "score_clip str": ({"score_clip": "10"}, TypeError, "score_clip must be a number, got str '10'"),
    "reward_fn not callable": ({"reward_fn": 3}, TypeError, "reward_fn must be callable, got int"),
    "kl a str": ({"kl": "0.2"}, TypeError, r"kl must be a number, got str"),
    "kl nan": ({"kl": math.nan}, ValueError, "kl must be a finite number >= 0, got nan"),
    "old kl_coef": ({"kl_coef": 0.1}, TypeError, r"RolloutFromModel takes kl=... now, not kl_coef="),
    "old kl_controller": ({"kl_controller": ConstantKLController(0.2)}, TypeError, r"takes kl=... now, not kl_contr"),
    "kl controller nan coef": (
        {"kl": broken_controller()},
        ValueError,
        "AdaptiveKLController.coef must be a finite number >= 0, got nan",
    ),
    "raw_log_probs str": ({"raw_log_probs": "yes"}, TypeError, "raw_log_probs"),
}


@pytest.mark.parametrize("case", sorted(ROLLOUT_SETTINGS))
def test_rollout_from_model_settings_refused(case, tiny_model, ref, tokenizer):
    kwargs, exc, match = ROLLOUT_SETTINGS[case]
    with pytest.raises(exc, match=match):
        RolloutFromModel(tiny_model, ref, tokenizer=tokenizer, **{"reward_fn": len, **kwargs})


def test_rollout_from_model_vocabulary_mismatch(tiny_model, tokenizer):
    with pytest.raises(ValueError, match=r"the policy has 49152 token ids but the reference model 100: their log-p"):
        RolloutFromModel(tiny_model, small_vocab_llama(100), tokenizer=tokenizer, reward_fn=len)
    with pytest.raises(ValueError, match="the tokenizer has 49152 ids but the model only 1000"):
        RolloutFromModel(small_vocab_llama(1000), small_vocab_llama(1000), tokenizer=tokenizer, reward_fn=len)


def nan_score(text):
    return math.nan


ROLLOUT_FAILURES = {
    "empty batch": ([], len, ValueError, "rollout needs at least one prompt, got an empty batch"),
    "empty prompt": ([PROMPT, []], len, ValueError, "prompt 1 is empty"),
    "text prompt": (["What is 2+2?"], len, TypeError, r"prompt 0 must be token ids, got a str \('What is 2\+2\?'\)"),
    "float prompt": (
        [[1.0, 2.5]],
        len,
        TypeError,
        r"prompt 0 must be integer token ids, got 1.0 \(float\) at position 0",
    ),
    "id outside": (
        [[1, 10**6]],
        len,
        ValueError,
        r"token id 1000000 in prompt 0 is outside the vocabulary \[0, 49152\) of the policy \(at position 1\)",
    ),
    "score NaN": ([PROMPT], nan_score, ValueError, r"reward_fn \(nan_score\) returned a non-finite score nan for row"),
    "score inf": ([PROMPT], lambda t: math.inf, ValueError, r"reward_fn \(<lambda>\) returned a non-finite score inf"),
    "score text": ([PROMPT], lambda t: "good", TypeError, r"reward_fn \(<lambda>\) must return a number, got str"),
    "score None": ([PROMPT], lambda t: None, TypeError, r"must return a number, got NoneType None for row 0"),
}


@pytest.mark.parametrize("case", sorted(ROLLOUT_FAILURES))
def test_failed_rollout_feeds_nothing_to_the_controller(case, tiny_model, ref, tokenizer):
    prompts, reward_fn, exc, match = ROLLOUT_FAILURES[case]
    ctl = AdaptiveKLController(0.2, target=100.0, horizon=10)
    rfm = RolloutFromModel(tiny_model, ref, tokenizer=tokenizer, reward_fn=reward_fn, kl=ctl, max_new_tokens=3)
    with pytest.raises(exc, match=match):
        rfm.rollout(prompts)
    assert rfm.step_scheduler() == 0.2 and ctl.coef == 0.2


# ------------------------------------------------------------------------------------------ vector envs


def _with_ref():
    return KLPenalty(RefLogProbs(tokens_env()), 0.1)


@pytest.mark.parametrize(
    "makers, missing",
    [([tokens_env, tokens_env], r"\[0, 1\] of 2"), ([_with_ref, tokens_env, _with_ref], r"\[1\] of 3")],
    ids=["none", "one"],
)
def test_vector_ref_log_probs_needs_ref_log_probs_in_every_sub_env(makers, missing, ref):
    venv = gym.vector.SyncVectorEnv(makers)
    with pytest.raises(
        ValueError,
        match=rf"VectorRefLogProbs passes reference log-probs on to sub-envs wrapped with RefLogProbs, but sub-envs "
        rf"{missing} have none: build each as RefLogProbs\(env\) or KLPenalty\(RefLogProbs\(env\), kl\)",
    ):
        VectorRefLogProbs(venv, ref)
    with pytest.raises(TypeError, match=r"ref_model must have a log_probs\(sequences\) method, got NotAScorer"):
        VectorRefLogProbs(venv, NotAScorer())
    venv.close()


@pytest.mark.slow
def test_vector_ref_log_probs_check_works_across_processes(ref):
    venv = gym.vector.AsyncVectorEnv([tokens_env, tokens_env])
    try:
        with pytest.raises(ValueError, match=r"sub-envs \[0, 1\] of 2 have none"):
            VectorRefLogProbs(venv, ref)
        obs, _ = venv.reset(seed=0)  # the vector env is still usable
        assert len(obs) == 2
    finally:
        venv.close()


# ------------------------------------------------------------------------------------------ Ray (no cluster needed)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"timeout": 0}, ValueError, "timeout must be a finite number > 0, got 0"),
        ({"timeout": math.nan}, ValueError, "timeout must be a finite number > 0, got nan"),
        ({"num_cpus": -1}, ValueError, "num_cpus must be a finite number >= 0, got -1"),
        ({"num_gpus": "1"}, TypeError, "num_gpus must be a number, got str '1'"),
        ({"max_restarts": -2}, ValueError, r"max_restarts must be an int >= 0 \(or -1: without limit\), got -2"),
        ({"num_cpus": 1, "factory": 42}, TypeError, "factory must be a callable or a model path, got int"),
    ],
    ids=["timeout 0", "timeout nan", "num_cpus", "num_gpus", "max_restarts", "factory"],
)
def test_ray_ref_model_options_refused_before_ray_starts(kwargs, exc, match):
    factory = kwargs.pop("factory", "default")
    with pytest.raises(exc, match=match):
        RayRefModel(factory, **kwargs)


def test_old_kl_spellings_name_the_new_one(ref):
    from wrappers.grpo import GRPOConfig
    from wrappers.kl import KLComputation, KLRewardTransform

    for make, old, new in (
        (lambda: KLComputation(coef=0.1), "coef=", "kl="),
        (lambda: KLRewardTransform(ref, coef=0.1), "coef=", "kl="),
        (lambda: GRPOConfig(kl_coef=0.1), "kl_coef=", "kl="),
        (lambda: GRPOConfig(kl_estimator="k1"), "kl_estimator=", "estimator="),
    ):
        with pytest.raises(TypeError, match=rf"takes {new}\.\.\. now, not {old}"):
            make()
    assert GRPOConfig(kl=0.2, estimator="k1").kl == 0.2
    assert KLComputation(kl=0.3).kl == 0.3
