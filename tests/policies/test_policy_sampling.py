"""The sampling distribution written once: generation, scoring and get_dist agree with each other and with an
independent computation (plain forward, the settings applied by hand below) under every sampling setting."""

import math

import pytest
import torch
from helpers import history_td, reference_log_probs
from tensordict import TensorDict

from chatenv import Tokens
from wrappers.policies import TransformersWrapper

END = 2  # <|im_end|>: SmolLM2's end-of-turn, EOS and pad id


def rows(container, part):
    return [x.tolist() for x in container.unpadded(part)]


def processed_reference(
    model,
    ids,
    split,
    *,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    repetition_penalty=1.0,
    min_new_tokens=0,
    stop_ids=(END,),
    start=1,
):
    """log p(x_t | x_<t) under the sampling settings, position by position from one plain forward (NaN before
    ``start``, and at 0).

    Written independently of the library: each position's logits are penalized for the tokens of its prefix,
    end ids are banned for the first ``min_new_tokens`` response tokens, then temperature, top-k, top-p (keep
    the most likely tokens until their mass reaches top_p) and min-p are applied.
    """
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    out = [math.nan] * max(start, 1)
    for t in range(max(start, 1), len(ids)):
        row = logits[t - 1].clone()
        if repetition_penalty != 1.0:
            prefix = torch.tensor(sorted(set(ids[:t])))
            v = row[prefix]
            row[prefix] = torch.where(v < 0, v * repetition_penalty, v / repetition_penalty)
        if 0 <= t - split < min_new_tokens:
            row[list(stop_ids)] = -math.inf
        row = row / temperature
        if top_k:
            row[row < row.topk(top_k).values[-1]] = -math.inf
        if top_p < 1.0:
            probs, order = row.softmax(-1).sort(descending=True)
            above = probs.cumsum(-1) - probs  # mass of the tokens more likely than each
            row[order[above >= top_p]] = -math.inf
        if min_p > 0.0:
            probs = row.softmax(-1)
            row[probs < min_p * probs.max()] = -math.inf
        out.append(row.log_softmax(-1)[ids[t]].item())
    return torch.tensor(out)


SETTINGS = [
    {"temperature": 0.7},
    {"top_k": 20},
    {"top_p": 0.8},
    {"min_p": 0.1},
    {"repetition_penalty": 1.5},
    {"min_new_tokens": 4},
    {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.3, "min_new_tokens": 3},
]


def _marked(kwargs):
    """top_p cases take seconds each (the others a fraction of one): `make test-fast` leaves them out."""
    return pytest.param(kwargs, marks=pytest.mark.slow) if "top_p" in kwargs else kwargs


@pytest.mark.parametrize("kwargs", [_marked(k) for k in SETTINGS], ids=lambda k: "+".join(k))
def test_generation_scoring_and_dist_agree_under_every_setting(kwargs, tiny_model, tokenizer):
    # three prompts of different lengths: shorter ones are left-padded inside generate
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 12, "seed": 4, **kwargs}
    )
    out = policy(history_td())
    scorer = policy.get_new_version(generate=False, input_mode="tokens")
    scored = scorer(out.copy())
    dist = scorer.get_dist(out.copy(), mask="response")
    from_dist = dist.log_prob(out["tokens"].full)
    for b, (p, r) in enumerate(zip(rows(out["tokens"], "prompt"), rows(out["tokens"], "response"))):
        ref = processed_reference(tiny_model, p + r, len(p), **kwargs)[len(p) :]
        generated = out["log_probs"].unpadded("response")[b]
        assert torch.isfinite(generated).all()
        assert (generated - ref).abs().max() < 1e-4, b
        assert (scored["log_probs"].unpadded("response")[b] - ref).abs().max() < 1e-4, b
        width = out["tokens"].prompt.shape[-1]
        assert (from_dist[b, width : width + len(r)] - ref).abs().max() < 1e-4, b
    if "min_new_tokens" in kwargs:
        assert (out["tokens"].response_length >= kwargs["min_new_tokens"]).all()


def test_repetition_penalty_ignores_left_padding(tiny_model, tokenizer):
    """generate's own penalty would count a padded row's pad ids (the end id here) as tokens it has seen."""
    prompts = [[1, 9, 5], [1, 9, 5, 7, 8, 11, 13, 17]]  # no end id inside: only padding would put one there
    kwargs = {"max_new_tokens": 10, "repetition_penalty": 3.0, "seed": 1}
    policy = TransformersWrapper(tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=kwargs)
    td = TensorDict(
        tokens=Tokens.from_sequences([torch.tensor(p) for p in prompts], padded=True, pad_value=END), batch_size=[2]
    )
    out = policy(td)
    for b, p in enumerate(prompts):
        r = rows(out["tokens"], "response")[b]
        ref = processed_reference(tiny_model, p + r, len(p), repetition_penalty=3.0)[len(p) :]
        assert (out["log_probs"].unpadded("response")[b] - ref).abs().max() < 1e-4, b


def test_greedy_reports_the_models_own_log_probs(tiny_model, tokenizer):
    kwargs = {"max_new_tokens": 8, "temperature": 0, "min_new_tokens": 5, "repetition_penalty": 1.4}
    policy = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs)
    out = policy(history_td())
    scored = policy.log_prob(out.copy())
    for b, (p, r) in enumerate(zip(rows(out["tokens"], "prompt"), rows(out["tokens"], "response"))):
        assert len(r) >= 5 and END not in r[:5]
        raw = reference_log_probs(tiny_model, p + r)[len(p) :]
        assert (out["log_probs"].unpadded("response")[b] - raw).abs().max() < 1e-4
        assert (scored["log_probs"].unpadded("response")[b] - raw).abs().max() < 1e-4
        # each choice is the argmax of the logits penalized for the prefix, the end id banned for 5 tokens
        with torch.no_grad():
            logits = tiny_model(torch.tensor([p + r])).logits[0].float()
        for j, token in enumerate(r):
            row = logits[len(p) + j - 1].clone()
            prefix = torch.tensor(sorted(set(p + r[:j])))
            row[prefix] = torch.where(row[prefix] < 0, row[prefix] * 1.4, row[prefix] / 1.4)
            if j < 5:
                row[END] = -math.inf
            assert row.argmax().item() == token, (b, j)


def test_score_sequences_on_raw_ids(tiny_model, tokenizer):
    seqs = [[1, 4093, 198, 22, 2], torch.tensor([5, 6, 7])]
    scorer = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate=False, input_mode="tokens")
    got = scorer.score_sequences(seqs)
    for s, lp in zip(seqs, got):
        ids = torch.as_tensor(s).tolist()
        assert lp.shape == (len(ids),) and lp.dtype == torch.float32 and torch.isnan(lp[0])
        assert (lp[1:] - reference_log_probs(tiny_model, ids)[1:]).abs().max() < 1e-4
    assert scorer.score_sequences([]) == []
    # the same numbers as scoring a tensordict of those ids
    td = TensorDict(tokens=Tokens.from_sequences([torch.tensor(seqs[0])], padded=True, pad_value=2), batch_size=[1])
    assert torch.allclose(scorer(td)["log_probs"].full[0], got[0], equal_nan=True)
    # prompt lengths set where min_new_tokens starts counting
    banned = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, generate=False, generate_kwargs={"min_new_tokens": 2, "temperature": 0.9}
    )
    ids = [1, 4093, 198, 22, 2]
    lp = banned.score_sequences([ids], prompt_lengths=[4])[0]
    assert lp[4] == -math.inf  # the end id as the first response token is impossible
    assert (lp - processed_reference(tiny_model, ids, 4, temperature=0.9, min_new_tokens=2)).abs()[1:4].max() < 1e-4
    with pytest.raises(ValueError, match="outside the vocabulary"):
        scorer.score_sequences([[5, 10**6]])
    with pytest.raises(ValueError, match="empty"):
        scorer.score_sequences([[]])
    with pytest.raises(ValueError, match="prompt_lengths"):
        scorer.score_sequences([[5, 6]], prompt_lengths=[3])


def test_tiny_temperatures_are_refused(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="temperature=0 for greedy"):
        TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs={"temperature": 1e-5})
    # the smallest allowed temperature still gives finite log-probs
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, generate_kwargs={"temperature": 1e-4, "max_new_tokens": 4, "seed": 0}
    )
    out = policy(history_td())
    for lp in out["log_probs"].unpadded("response"):
        assert len(lp) and torch.isfinite(lp).all()
