"""Top log-probs (``generate_kwargs["top_logprobs"]``): the policy's own k most likely tokens at every generated step.

Both backends are checked against an independent forward pass of the same weights (the full sequence at once, no
KV cache, no logits processors): the reported alternatives are the top-k of the distribution the sampled tokens'
log-probs are reported for.
"""

import math

import pytest
import torch
from helpers import CHATS, history_td

from chatenv.sampling import SettingValueError, normalize_generate_kwargs
from wrappers.policies import TransformersWrapper

torch.set_num_threads(1)
K = 4


def _reference(model, prompt, reply, temperature):
    """``(R, V)`` log-probs of each reply position from one forward pass over prompt + reply."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1)


def _rows(out):
    tokens = out["tokens"]
    return [(p.tolist(), r.tolist()) for p, r in zip(tokens.unpadded("prompt"), tokens.unpadded("response"))]


def _check_against_reference(out, model, temperature, atol):
    top = out["top_log_probs"]
    width = top["ids"].shape[1]
    for b, (prompt, reply) in enumerate(_rows(out)):
        ref = _reference(model, prompt, reply, temperature)
        values, ids = ref.topk(K, dim=-1)
        assert torch.equal(top["ids"][b, : len(reply)], ids)
        torch.testing.assert_close(top["log_probs"][b, : len(reply)], values, atol=atol, rtol=0)
        sampled = ref.gather(-1, torch.tensor(reply)[:, None]).squeeze(-1)
        torch.testing.assert_close(out["log_probs"].unpadded("response")[b], sampled, atol=atol, rtol=0)
        # past the reply: padding, never a value
        assert (top["ids"][b, len(reply) :] == -1).all() and top["log_probs"][b, len(reply) :].isnan().all()
    assert width == max(len(r) for _, r in _rows(out))


def test_transformers_top_logprobs_are_the_sampled_distributions_top_k(tiny_model, tokenizer):
    policy = TransformersWrapper(
        tiny_model,
        tokenizer=tokenizer,
        generate_kwargs={"max_new_tokens": 6, "temperature": 0.7, "top_logprobs": K, "seed": 3},
    )
    out = policy(history_td(CHATS[:2]))
    assert out["top_log_probs"]["ids"].shape[:1] == (2,) and out["top_log_probs"]["ids"].shape[-1] == K
    _check_against_reference(out, tiny_model, 0.7, 1e-4)


def test_top_logprobs_with_num_samples_and_greedy(tiny_model, tokenizer):
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, num_samples=2, generate_kwargs={"max_new_tokens": 4, "top_logprobs": 2}
    )
    out = policy(history_td(CHATS[:1]))
    assert out["top_log_probs"].batch_size == torch.Size([1, 2])
    greedy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 4, "top_logprobs": 2, "temperature": 0}
    )
    out = greedy(history_td(CHATS[:1]))
    # greedy: the model's own distribution; the chosen token is always the first alternative
    ((prompt, reply),) = _rows(out)
    assert out["top_log_probs"]["ids"][0, : len(reply), 0].tolist() == reply
    ref = _reference(tiny_model, prompt, reply, 1.0)
    torch.testing.assert_close(
        out["top_log_probs"]["log_probs"][0, : len(reply)], ref.topk(2).values, atol=1e-4, rtol=0
    )


def test_top_logprobs_setting_is_checked():
    assert normalize_generate_kwargs({"top_logprobs": 5}).top_logprobs == 5
    with pytest.raises(SettingValueError, match=r"top_logprobs.*\[0, 20\]"):
        normalize_generate_kwargs({"top_logprobs": 21})


@pytest.mark.slow
def test_vllm_top_logprobs_match_the_forward_pass(vllm_engine, tiny_model):
    from wrappers.policies import VLLMWrapper

    policy = VLLMWrapper(vllm_engine, generate_kwargs={"max_new_tokens": 6, "top_logprobs": K, "seed": 5})
    out = policy(history_td(CHATS[:2]))
    _check_against_reference(out, tiny_model, 1.0, 2e-3)
    assert not math.isnan(float(out["top_log_probs"]["log_probs"][0, 0, 0]))


def test_scoring_refuses_a_grammar(tiny_model, tokenizer):
    policy = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs={"grammar": 'root ::= "a"'})
    with pytest.raises(ValueError, match="scoring does not apply a grammar"):
        policy.get_new_version(generate=False)
