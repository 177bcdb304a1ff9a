"""Bad input to the policy wrappers and TokenStepPolicy: a clear error of the right type, and nothing changed.

Each case names the exact exception and the words of its message (the value, what was expected, the fix). For
errors raised during a call, the same policy then serves a valid call, and its results equal those of a policy
that never saw the bad call (the per-call seed sequence and the KV cache do not move on a refused call).
vLLM's cases live in ``test_vllm.py`` (they need the session's engine).
"""

import math

import numpy as np
import pytest
import torch
from helpers import CHATS, history_td
from tensordict import NonTensorStack, TensorDict

from chatenv import ChatHistory, History, Tokens
from chatenv.sampling import SettingTypeError, SettingValueError
from wrappers.policies import TransformersWrapper
from wrappers.token_policy import TokenStepPolicy

PROMPT = [1, 4093, 198, 22, 2, 198, 1, 520, 9531, 198]
GEN = {"max_new_tokens": 4, "seed": 3}


def small_vocab_llama(vocab_size=1000):
    """A tiny random Llama like conftest's, with a vocabulary smaller than SmolLM2's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def make(tiny_model, tokenizer, **kwargs):
    kwargs.setdefault("generate_kwargs", GEN)
    return TransformersWrapper(tiny_model, tokenizer=tokenizer, **kwargs)


@pytest.fixture(scope="module")
def tokens_policy(tiny_model, tokenizer):
    return make(tiny_model, tokenizer, input_mode="tokens")


@pytest.fixture(scope="module")
def history_policy(tiny_model, tokenizer):
    return make(tiny_model, tokenizer)


@pytest.fixture(scope="module")
def text_policy(tiny_model, tokenizer):
    return make(tiny_model, tokenizer, input_mode="text")


@pytest.fixture(scope="module")
def scorer(tokens_policy):
    return tokens_policy.get_new_version(generate=False)


def tokens_td(*rows, response=None):
    prompt = [torch.tensor(r) for r in rows]
    resp = None if response is None else [torch.tensor(r) for r in response]
    return TensorDict(tokens=Tokens.from_sequences(prompt, resp, padded=True, pad_value=2), batch_size=[len(rows)])


def works(policy):
    """A valid call succeeds after a refused one."""
    if policy.input_mode == "tokens":
        if policy.generate:
            actions, _ = policy.act(PROMPT)
            assert actions.dtype == np.int64 and len(actions) >= 1
        else:
            out = policy(tokens_td(PROMPT[:6], response=[PROMPT[6:]]))
            assert torch.isfinite(out["log_probs"].response).all()
    elif policy.input_mode == "history":
        out = policy(history_td())
        assert out["tokens"].response.shape[0] == len(CHATS)
    else:
        reply, out = policy.act("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        # a finished reply is its text; one cut by max_new_tokens an incomplete message
        cut = {"role": "assistant", "content": out["text"].response[0], "is_complete": False}
        assert isinstance(reply, str) or reply == cut


# ------------------------------------------------------------------------------------------ empty batches


def test_empty_tensordict_to_a_generator(history_policy):
    empty = history_td()[:0]
    with pytest.raises(ValueError, match=r"empty batch: the input tensordict has batch shape \(0,\); give at least"):
        history_policy(empty)
    works(history_policy)


def test_empty_tensordict_to_a_scorer(scorer):
    with pytest.raises(ValueError, match=r"empty batch.*\(0,\)"):
        scorer(tokens_td(PROMPT[:6], response=[PROMPT[6:]])[:0])
    with pytest.raises(ValueError, match=r"empty batch.*\(0,\)"):
        scorer.get_dist(tokens_td(PROMPT[:6], response=[PROMPT[6:]])[:0])
    works(scorer)


@pytest.mark.parametrize("empty", [[], (), np.zeros((0, 3), dtype=np.int64)], ids=["list", "tuple", "array"])
def test_act_with_no_observations(tokens_policy, empty):
    with pytest.raises(ValueError, match=r"act\(\) got no observations; give one observation or a non-empty list"):
        tokens_policy.act(empty)
    works(tokens_policy)


def test_act_with_an_empty_observation(tokens_policy):
    with pytest.raises(ValueError, match="row 1: empty input; a prompt needs at least one token"):
        tokens_policy.act([PROMPT, []])
    works(tokens_policy)


# ------------------------------------------------------------------------------------------ vocabularies


def test_model_vocabulary_smaller_than_the_tokenizers(tokenizer):
    with pytest.raises(ValueError, match=r"vocabulary has 1000 ids \(config.vocab_size\) but the tokenizer has 49152"):
        TransformersWrapper(small_vocab_llama(1000), tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"resize_token_embeddings\(len\(tokenizer\)\)"):
        TokenStepPolicy(small_vocab_llama(1000), tokenizer)


def test_tokenizer_with_added_tokens_the_model_lacks(tiny_model, llama3_tokenizer):
    with pytest.raises(ValueError, match="vocabulary has 49152 ids .* tokenizer has 49156 tokens"):
        TransformersWrapper(tiny_model, tokenizer=llama3_tokenizer)


@pytest.mark.parametrize("ids", [[49152], [2, 10**6]], ids=["first-past-the-end", "far"])
def test_stop_token_ids_outside_the_vocabulary(tiny_model, tokenizer, ids, history_policy):
    bad = ids[-1]
    with pytest.raises(ValueError, match=rf"stop_token_ids'\] holds {bad}, outside the vocabulary \[0, 49152\)"):
        make(tiny_model, tokenizer, generate_kwargs={"stop_token_ids": ids})
    # a new version is checked as well, and the policy it came from is untouched
    with pytest.raises(ValueError, match=rf"holds {bad}, outside the vocabulary"):
        history_policy.get_new_version(generate_kwargs={"stop_token_ids": ids})
    assert history_policy.settings.stop_token_ids == ()
    works(history_policy)


# ------------------------------------------------------------------------------------------ act() observations


@pytest.mark.parametrize(
    ("observation", "error", "match"),
    [
        ([1.5, 2.0], TypeError, r"observation 0 must be integer token ids, got 1.5 \(float\) at position 0; ids are"),
        ([[1, 2], [3.0, 4]], TypeError, r"observation 1 must be integer token ids, got 3.0 \(float\) at position 0"),
        (torch.tensor([1.0, 2.0]), TypeError, r"must be integer token ids, got torch.float32; ids are never rounded"),
        (np.array([5.0, math.nan]), TypeError, r"must be integer token ids, got float64 holding NaN"),
        ([True, False], TypeError, r"observation 0 must be integer token ids, got the bool True at position 0"),
        ([{"role": "user", "content": "Hi"}], TypeError, r"got message dicts \(a chat\).*input_mode='history'"),
        ([[{"role": "user", "content": "Hi"}]], TypeError, r"observation 0 must .*message dicts.*input_mode='history'"),
        ("What is 2+2?", TypeError, r"got a str \('What is 2\+2\?'\); text prompts are read by input_mode='text'"),
        (["Hi", "there"], TypeError, r"observation 0 must be token ids, got a str \('Hi'\).*input_mode='text'"),
        ([[1, 2], [3, [4, 5]]], TypeError, r"observation 1 must be a 1-D .*got a list at position 1 \(a nested or rag"),
        (
            [np.array([[1, 2], [3, 4]])],
            TypeError,
            r"observation 0 must be a 1-D sequence of token ids, got shape \(2, 2\)",
        ),
        (np.zeros((1, 2, 3), dtype=np.int64), TypeError, r"one 1-D sequence of ids or a \(B, T\) batch.*\(1, 2, 3\)"),
        ([1, -2, 3], ValueError, r"token id -2 in row 0 is outside the vocabulary \[0, 49152\) \(at position 1\)"),
        ([[5, 6], [1, 49152]], ValueError, r"token id 49152 in row 1 is outside the vocabulary \[0, 49152\)"),
        (object(), TypeError, r"tokens mode: expected token ids or a list of them, got object"),
    ],
    ids=[
        "float-list",
        "float-in-batch",
        "float-tensor",
        "nan-array",
        "bools",
        "message-dicts",
        "chats",
        "str",
        "strs",
        "ragged-nested",
        "2d-observation",
        "3d-array",
        "negative-id",
        "out-of-vocab",
        "object",
    ],
)
def test_act_refuses_what_tokens_mode_cannot_read(tokens_policy, observation, error, match):
    with pytest.raises(error, match=match):
        tokens_policy.act(observation)
    works(tokens_policy)


def test_act_in_text_and_history_modes_names_the_mode_that_reads_the_input(text_policy, history_policy):
    with pytest.raises(TypeError, match=r"text mode: observation 0 must be a str, got int; .*input_mode='tokens'"):
        text_policy.act([1, 2, 3])
    with pytest.raises(TypeError, match=r"text mode: expected prompt text, got message dicts.*input_mode='history'"):
        text_policy.act([{"role": "user", "content": "Hi"}])
    works(text_policy)
    with pytest.raises(TypeError, match=r"history mode: .*got a str; text prompts are read by input_mode='text'"):
        history_policy.act("Hi")
    with pytest.raises(TypeError, match=r"history mode: .*got token ids; token ids are read by input_mode='tokens'"):
        history_policy.act(np.array(PROMPT))
    works(history_policy)


def test_act_on_a_scorer(scorer):
    with pytest.raises(ValueError, match=r"act\(\) generates actions; this policy scores \(generate=False\)"):
        scorer.act(PROMPT)


def test_score_sequences_refuses_float_ids(scorer):
    with pytest.raises(TypeError, match=r"sequence 0 must be integer token ids, got 1.5 \(float\) at position 1"):
        scorer.score_sequences([[5, 1.5, 7]])
    with pytest.raises(TypeError, match="sequence 1 must be integer token ids, got torch.float32"):
        scorer.score_sequences([[5, 6], torch.tensor([5.0, 6.0])])
    assert torch.isfinite(scorer.score_sequences([PROMPT])[0][1:]).all()


# ------------------------------------------------------------------------------------------ generation settings


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # the settings' own checks are the core's (tests/core/test_sampling.py): the constructor runs them
        ({"temperature": -0.5}, SettingValueError, r"temperature'\] must be in \[0.0, inf\], got -0.5"),
        ({"temprature": 0.5}, SettingTypeError, r"unknown generation setting 'temprature'; did you mean"),
        ({"min_new_tokens": 9, "max_new_tokens": 4}, ValueError, r"min_new_tokens'\] \(9\) exceeds max_new_tokens=4"),
        # what the backend cannot do
        ({"presence_penalty": 0.5}, ValueError, r"presence_penalty is not supported by the transformers backend"),
    ],
    ids=["range", "name", "conflict", "backend"],
)
def test_generation_settings_are_checked_at_construction(tiny_model, tokenizer, kwargs, error, match):
    with pytest.raises(error, match=match):
        make(tiny_model, tokenizer, generate_kwargs=kwargs)


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"num_samples": True}, TypeError, r"num_samples must be a positive int, got True \(bool\)"),
        ({"num_samples": 0}, ValueError, r"num_samples must be a positive int, got 0"),
        ({"num_samples": 2, "generate_kwargs": {"n": 3}}, ValueError, r"num_samples=2 conflicts with .*=3"),
        ({"pad_output": "no"}, TypeError, r"pad_output must be True or False, got 'no' \(str\)"),
        ({"generate": 0}, TypeError, r"generate must be True or False, got 0 \(int\)"),
        ({"input_mode": "chat"}, ValueError, r"input_mode must be one of \('history', 'text', 'tokens'\), got 'chat'"),
        ({"inplace": "yes"}, ValueError, r"inplace must be True, False or 'empty', got 'yes'"),
        ({"score_batch_size": 0}, ValueError, r"score_batch_size must be a positive int, got 0"),
        ({"generate": False, "return_log_probs": False}, ValueError, r"return_log_probs=False leaves nothing"),
    ],
    ids=["bool-num-samples", "zero-samples", "n-conflict", "str-flag", "int-flag", "mode", "inplace", "batch", "lp"],
)
def test_policy_options_are_checked_at_construction(tiny_model, tokenizer, options, error, match):
    with pytest.raises(error, match=match):
        make(tiny_model, tokenizer, **options)


# ------------------------------------------------------------------------------------------ tensordict inputs


def test_missing_input_key_names_the_keys_present_and_the_mode(history_policy, tokens_policy):
    td = tokens_td(PROMPT)
    with pytest.raises(KeyError, match=r"input key \('history', 'prompt'\) not found.*keys present: .*'tokens'"):
        history_policy(td)
    with pytest.raises(KeyError, match=r"looks like input_mode='tokens'"):
        history_policy(td)
    with pytest.raises(KeyError, match=r"keys present: \['other'\]\. Pass input_key=\.\.\."):
        tokens_policy(TensorDict(other=torch.zeros(1), batch_size=[1]))
    assert set(td.keys()) == {"tokens"}, "a refused in-place call wrote nothing"
    works(history_policy)


def test_history_of_the_wrong_shape(history_policy):
    chats = History.from_chats([[{"role": "user", "content": "x"}], [{"role": "user", "content": "y"}]])
    flat = TensorDict(history=ChatHistory(prompt=chats[:, 0], batch_size=[2]), batch_size=[2])
    with pytest.raises(ValueError, match=r"history mode: expected a History of shape \(B, messages\), got \(2,\)"):
        history_policy(flat)
    deep = TensorDict(history=ChatHistory(prompt=chats.unsqueeze(1), batch_size=[2]), batch_size=[2])
    with pytest.raises(ValueError, match=r"got \(2, 1, 1\)"):
        history_policy(deep)
    with pytest.raises(TypeError, match=r"expected a History at \('history', 'prompt'\), got Tensor"):
        history_policy(TensorDict(history={"prompt": torch.zeros(2, 3)}, batch_size=[2]))
    works(history_policy)


def test_batch_of_more_than_one_dimension(history_policy):
    with pytest.raises(ValueError, match=r"batch shape \(\) or \(B,\), got \(1, 3\); reshape\(-1\) it first"):
        history_policy(history_td().unsqueeze(0))


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        (NonTensorStack.from_list([1, 2]), r"expected text \(a str per row\), got int 1 at row 0"),
        (NonTensorStack.from_list(["Hi", None]), r"got NoneType None at row 1"),
        (torch.zeros(2, 3), r"expected text \(a str or a list of str\), got Tensor"),
    ],
    ids=["ints", "none", "tensor"],
)
def test_text_mode_with_values_that_are_not_text(text_policy, prompt, match):
    with pytest.raises(TypeError, match=match):
        text_policy(TensorDict(text={"prompt": prompt}, batch_size=[2]))
    works(text_policy)


def test_padded_ids_without_a_mask_when_pad_is_a_real_token(tokens_policy):
    td = TensorDict(tokens={"prompt": torch.tensor([[2, 5, 6], [7, 8, 9]])}, batch_size=[2])
    with pytest.raises(ValueError, match=r"without an attention mask is ambiguous \(the pad id 2 is a real token"):
        tokens_policy(td)
    assert set(td.keys(True, True)) == {("tokens", "prompt")}
    works(tokens_policy)


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (
            torch.ones(2, 2, dtype=torch.bool),
            r"attention mask at 'attention_mask' has shape \(2, 2\), the ids \(2, 3\)",
        ),
        (torch.tensor([[0.5, 1, 1], [1, 1, 1]]), r"must hold 0/1 \(or bool\) values, got 0.5"),
    ],
    ids=["shape", "values"],
)
def test_attention_mask_that_does_not_fit(tokens_policy, mask, match):
    td = TensorDict(tokens={"prompt": torch.tensor([[2, 5, 6], [7, 8, 9]])}, attention_mask=mask, batch_size=[2])
    with pytest.raises(ValueError, match=match):
        tokens_policy(td)
    works(tokens_policy)


@pytest.mark.parametrize(
    "ids",
    [
        torch.tensor([[1.0, 5, 6], [7, 8, 9]]),
        torch.nested.as_nested_tensor([torch.tensor([1.5, 2.0]), torch.tensor([3.0])], layout=torch.jagged),
    ],
    ids=["padded", "nested"],
)
def test_float_id_tensor(tokens_policy, ids):
    td = TensorDict(tokens={"prompt": ids}, batch_size=[2])
    with pytest.raises(TypeError, match=r"\('tokens', 'prompt'\) must be integer token ids, got torch.float32"):
        tokens_policy(td)
    works(tokens_policy)


def test_float_ids_in_a_tokens_container(scorer):
    td = TensorDict(tokens=Tokens.from_sequences([torch.tensor([1.5, 2.0, 3.0])], padded=True), batch_size=[1])
    with pytest.raises(TypeError, match=r"\('tokens', 'full'\) \(prompt\) must be integer token ids, got torch"):
        scorer(td)
    works(scorer)


def test_context_overflow_names_the_numbers(tiny_model, tokenizer, scorer):
    policy = make(tiny_model, tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 100, "seed": 0})
    long = [5] * 1000
    with pytest.raises(
        ValueError, match=r"row 0: 1000 input tokens \+ max_new_tokens=100 exceed the model's context length 1024"
    ):
        policy.act(long)
    with pytest.raises(ValueError, match=r"lower max_new_tokens"):
        policy.act([PROMPT, long])
    with pytest.raises(ValueError, match=r"row 0: 1025 input tokens exceed the model's context length 1024"):
        scorer(tokens_td([5] * 1000, response=[[6] * 25]))
    works(policy)
    works(scorer)


# ------------------------------------------------------------------------------------------ versions and attributes


def test_get_new_version_with_an_unknown_option(history_policy):
    with pytest.raises(TypeError, match=r"unknown policy option 'pad_ouptut' .*; did you mean 'pad_output'\?"):
        history_policy.get_new_version(pad_ouptut=False)
    with pytest.raises(TypeError, match=r"'score_batch_sise'.*did you mean 'score_batch_size'\?"):
        history_policy.get_new_version(score_batch_sise=2)
    with pytest.raises(TypeError, match=r"unknown generation setting 'tempreature'; did you mean 'temperature'"):
        history_policy.get_new_version(generate_kwargs={"tempreature": 0.5})
    works(history_policy)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("pad_output", False, r"pad_output is read-only; .*policy.get_new_version\(pad_output=\.\.\.\)"),
        ("input_key", "x", r"input_key is read-only; .*get_new_version\(input_key=\.\.\.\)"),
        ("temperature", 0.5, r"temperature is not a settable .*get_new_version\(generate_kwargs=\{'temperature'"),
        ("generate_kwargs", {}, r"generate_kwargs is not a settable.*get_new_version\(generate_kwargs=\{\.\.\.\}\)"),
        ("config", None, r"config is not a settable attribute .*get_new_version\(option=\.\.\.\)"),
    ],
    ids=["pad_output", "input_key", "temperature", "generate_kwargs", "config"],
)
def test_setting_an_option_attribute(history_policy, name, value, match):
    before = history_policy.config
    with pytest.raises(AttributeError, match=match):
        setattr(history_policy, name, value)
    assert history_policy.config is before
    works(history_policy)


# ------------------------------------------------------------------------------------------ nothing half-changed


class FailsOnce(TransformersWrapper):
    """The real backend, failing once after it sampled (as a lost worker or an interrupted call would)."""

    failed = False

    def _generate_ids(self, prompts, settings):
        samples = super()._generate_ids(prompts, settings)
        if not self.failed:
            self.failed = True
            raise RuntimeError("the backend failed after sampling")
        return samples


def test_a_refused_or_failed_call_does_not_advance_the_seed_sequence(tiny_model, tokenizer):
    kwargs = {"input_mode": "tokens", "generate_kwargs": {"max_new_tokens": 6, "seed": 7}}
    clean = make(tiny_model, tokenizer, **kwargs)
    expected = [clean.act([PROMPT, PROMPT[:5]])[0] for _ in range(3)]
    policy = FailsOnce(tiny_model, tokenizer=tokenizer, **kwargs)
    got = []
    for bad in ([PROMPT, [49152]], [1.5], []):
        with pytest.raises((TypeError, ValueError)):
            policy.act(bad)
        if not policy.failed:
            with pytest.raises(RuntimeError, match="after sampling"):
                policy.act([PROMPT, PROMPT[:5]])
        got.append(policy.act([PROMPT, PROMPT[:5]])[0])
    for e, g in zip(expected, got):
        assert all(np.array_equal(a, b) for a, b in zip(e, g))
    assert not all(np.array_equal(a, b) for a, b in zip(expected[0], expected[1])), "calls draw fresh samples"


# ------------------------------------------------------------------------------------------ TokenStepPolicy


@pytest.fixture
def stepper(tiny_model, tokenizer):
    return TokenStepPolicy(tiny_model, tokenizer, temperature=0.9, seed=4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop": "END"}, r"cannot honour stop strings \(stop=\('END',\)\)"),
        ({"ignore_eos": True}, r"cannot honour ignore_eos \(ignore_eos=True\)"),
        ({"n": 2}, r"draws one token per observation, got num_samples=2"),
        ({"stop_token_ids": [7]}, r"cannot honour extra stop ids \(stop_token_ids=\(7,\)\)"),
    ],
    ids=["stop", "ignore_eos", "num_samples", "stop_token_ids"],
)
def test_token_step_policy_refuses_settings_it_cannot_honour(tiny_model, tokenizer, kwargs, match):
    wrapper = make(tiny_model, tokenizer, generate_kwargs=kwargs)
    with pytest.raises(ValueError, match=match):
        TokenStepPolicy.from_wrapper(wrapper)


@pytest.mark.parametrize(
    ("observations", "error", "match"),
    [
        ([], ValueError, r"TokenStepPolicy.act got an empty batch; give at least one observation"),
        ([np.array(PROMPT), np.array([], dtype=np.int64)], ValueError, r"observation 1 is empty"),
        (
            [np.array([1, 49152])],
            ValueError,
            r"token id 49152 in observation 0 is outside the vocabulary .* of the model",
        ),
        (
            [np.array([5, -1])],
            ValueError,
            r"token id -1 in observation 0 is outside the vocabulary \[0, 49152\) of the",
        ),
        ([np.array([1.5, 2.0])], TypeError, r"observation 0 must be integer token ids, got float64; ids are never"),
        ([[1, 2.5]], TypeError, r"got 2.5 \(float\) at position 1; ids are never rounded"),
        (
            [np.array([[1, 2], [3, 4]])],
            TypeError,
            r"observation 0 must be a 1-D sequence of token ids, got shape \(2, 2\)$",
        ),
        (PROMPT, TypeError, r"got one flat list of ids; pass one observation as act\(\[obs\]\)"),
        (np.array(PROMPT), TypeError, r"got shape \(10,\); pass one observation as act\(\[obs\]\)"),
        (["Hi"], TypeError, r"observation 0 must be token ids, got a str \('Hi'\); tokenize text first$"),
        ([np.array([5] * 1024)], ValueError, r"observation 0 has 1024 tokens; the model's context holds 1024"),
    ],
    ids=["empty-batch", "empty", "oov", "negative", "float", "float-list", "2d", "flat", "1d", "str", "overflow"],
)
def test_token_step_policy_refuses_bad_observations(stepper, tiny_model, tokenizer, observations, error, match):
    twin = TokenStepPolicy(tiny_model, tokenizer, temperature=0.9, seed=4)
    obs = [np.array(PROMPT), np.array(PROMPT[:4])]
    first = stepper.act(obs)
    assert np.array_equal(first[0], twin.act(obs)[0])
    with pytest.raises(error, match=match):
        stepper.act(observations)
    # the cache, the replies in progress and the generator are as before: the next step equals the twin's
    grown = [np.append(o, a) for o, a in zip(obs, first[0])]
    got, expected = stepper.act(grown), twin.act(grown)
    assert np.array_equal(got[0], expected[0]) and np.allclose(got[1], expected[1])


def test_token_step_policy_construction_checks(tiny_model, tokenizer):
    with pytest.raises(ValueError, match=r"token id 49152 in end_ids is outside the vocabulary \[0, 49152\) of the"):
        TokenStepPolicy(tiny_model, tokenizer, min_new_tokens=1, end_ids=[2, 49152])
    with pytest.raises(TypeError, match=r"end_ids must be integer token ids, got 2.5 \(float\) at position 0"):
        TokenStepPolicy(tiny_model, tokenizer, end_ids=[2.5])
    with pytest.raises(ValueError, match=r"top_k'\] must be >= 0 \(0 or -1: no top-k filter\), got -3"):
        TokenStepPolicy(tiny_model, tokenizer, top_k=-3)
    with pytest.raises(ValueError, match=r"temperature'\] must be a finite number"):
        TokenStepPolicy(tiny_model, tokenizer, temperature=math.nan)
