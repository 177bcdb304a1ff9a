"""TransformersWrapper: generation and scoring against independent forward passes written here."""

import numpy as np
import pytest
import torch
from helpers import CHATS, history_td, reference_log_probs
from tensordict import NonTensorStack, TensorDict

from chatenv import Text, Tokens, apply_chat_template
from wrappers.policies import TransformersWrapper


def rows(container, part):
    return [x.tolist() for x in container.unpadded(part)]


@pytest.fixture(scope="module")
def policy(tiny_model, tokenizer):
    return TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 24, "seed": 3})


# ------------------------------------------------------------------------------------------ settings


def test_backend_rejects_what_it_cannot_do(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="presence_penalty"):
        TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs={"presence_penalty": 0.5})
    with pytest.raises(ValueError, match="input_mode"):
        TransformersWrapper(tiny_model, tokenizer=tokenizer, input_mode="chat")
    with pytest.raises(ValueError, match="inplace=True"):
        TransformersWrapper(tiny_model, tokenizer=tokenizer, num_samples=2, inplace=True)
    with pytest.raises(ValueError, match="conflicts"):
        TransformersWrapper(tiny_model, tokenizer=tokenizer, num_samples=2, generate_kwargs={"n": 3})


# ------------------------------------------------------------------------------------------ exactness


def test_generation_log_probs_equal_independent_forward(policy, tiny_model):
    out = policy(history_td())
    tokens, lps, masks = out["tokens"], out["log_probs"], out["masks"]
    assert lps.full.shape == tokens.full.shape == masks.all_assistant_mask.shape
    ended = 0
    for b, (p, r, lp) in enumerate(zip(rows(tokens, "prompt"), rows(tokens, "response"), lps.unpadded("response"))):
        ref = reference_log_probs(tiny_model, p + r)[len(p) :]
        assert len(r) > 0 and torch.isfinite(lp).all()
        # every generated token, the first one and the end-of-turn token included
        assert (lp - ref).abs().max() < 1e-4, b
        ended += r[-1] == 2
        # prompt positions were not scored during generation: NaN, never 0
        assert torch.isnan(lps.unpadded("prompt")[b]).all()
    assert ended >= 1, "no row ended with <|im_end|> (pad == eos): pick another seed"


def test_sampled_distribution_and_raw_option(tiny_model, tokenizer):
    kwargs = {"max_new_tokens": 12, "temperature": 0.7, "top_k": 50, "seed": 0}
    sampled = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs)(history_td())
    raw = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs, raw_log_probs=True)(history_td())
    assert torch.equal(sampled["tokens"].full, raw["tokens"].full)
    for p, r, lp_s, lp_r in zip(
        rows(sampled["tokens"], "prompt"),
        rows(sampled["tokens"], "response"),
        sampled["log_probs"].unpadded("response"),
        raw["log_probs"].unpadded("response"),
    ):
        n = len(p)
        assert (lp_s - reference_log_probs(tiny_model, p + r, 0.7, 50)[n:]).abs().max() < 1e-4
        assert (lp_r - reference_log_probs(tiny_model, p + r)[n:]).abs().max() < 1e-4
    # the scoring copy of a generator scores the distribution it sampled from
    scorer = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs).get_new_version(
        generate=False, input_mode="tokens"
    )
    scored = scorer(sampled.copy())
    m = sampled["masks"].all_assistant_mask & ~torch.isnan(sampled["log_probs"].full)
    assert (scored["log_probs"].full[m] - sampled["log_probs"].full[m]).abs().max() < 1e-4


def test_min_new_tokens_and_scoring_agree(tiny_model, tokenizer):
    kwargs = {"max_new_tokens": 10, "min_new_tokens": 6, "seed": 1}
    gen = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs)
    out = gen(history_td())
    assert (out["tokens"].response_length >= 6).all()
    scored = gen.get_new_version(generate=False, input_mode="tokens")(out.copy())
    m = out["masks"].all_assistant_mask & ~torch.isnan(out["log_probs"].full)
    assert (scored["log_probs"].full[m] - out["log_probs"].full[m]).abs().max() < 1e-4


def test_padded_and_nested_hold_the_same_values(tiny_model, tokenizer):
    kwargs = {"max_new_tokens": 16, "seed": 7}
    padded = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs)(history_td())
    nested = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs, pad_output=False)(
        history_td()
    )
    assert nested["tokens"].full.is_nested and padded["tokens"].padded
    for name in ("tokens", "log_probs"):
        a = [x for x in padded[name].full_sequences()]
        b = list(nested[name].full.unbind())
        assert all(torch.allclose(x, y, equal_nan=True) for x, y in zip(a, b))
    a = padded["masks"].all_assistant_mask[padded["masks"].all_attention_mask]
    b = torch.cat(list(nested["masks"].all_assistant_mask.unbind()))
    assert torch.equal(a, b)


def test_batched_equals_one_by_one(tiny_model, tokenizer):
    greedy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 12, "temperature": 0}
    )
    batched = greedy(history_td())
    for b, chat in enumerate(CHATS):
        single = greedy(history_td([chat]))
        assert rows(single["tokens"], "response")[0] == rows(batched["tokens"], "response")[b]
        diff = single["log_probs"].unpadded("response")[0] - batched["log_probs"].unpadded("response")[b]
        assert diff.abs().max() < 1e-4


# ------------------------------------------------------------------------------------------ modes


def test_history_mode_parses_response_and_masks(policy, tokenizer):
    out = policy(history_td())
    hist = out["history"]
    for b in range(len(CHATS)):
        reply = hist.response[b].to_chats()[0] if hist.response.batch_dims == 2 else hist.response.to_chats()[b][0]
        ids = rows(out["tokens"], "response")[b]
        assert reply["role"] == "assistant"
        assert "<|im_end|>" not in reply["content"] and "<|im_start|>" not in reply["content"]
        complete = ids[-1] == 2
        assert reply.get("is_complete", True) == complete
        if complete:
            assert tokenizer.decode(ids[:-1]) == reply["content"]
        assert hist.full.to_chats()[b] == [m for m in hist.prompt.to_chats()[b] if m] + [reply]
        # text: prompt + response == full
        text = out["text"]
        assert text.full[b] == text.prompt[b] + text.response[b]
    # assistant mask: the earlier assistant turn ("Blue.<|im_end|>") and the response, nothing else
    b = 2
    full = out["tokens"].full_sequences()[b]
    mask = out["masks"].unpadded()[b]
    n_resp = int(out["tokens"].response_length[b])
    assert tokenizer.decode(full[:-n_resp][mask[:-n_resp]]) == "Blue.<|im_end|>"
    assert mask[-n_resp:].all()
    if rows(out["tokens"], "response")[b][-1] == 2:
        # the rendered chat continues with the template's newline after <|im_end|>, which the model never wrote
        expected = apply_chat_template(tokenizer, hist.full.to_chats()[b])
        assert tokenizer.decode(expected["input_ids"][len(full) :]) == "\n"
        assert torch.equal(expected["input_ids"][: len(full)], full)
        assert torch.equal(expected["all_assistant_mask"][: len(full)], mask)


def test_tokens_mode_keeps_ids_verbatim(tiny_model, tokenizer):
    # a prompt spelled with non-canonical tokens (one per character): re-encoding would merge them
    head = tokenizer.encode("<|im_start|>user\n")
    odd = [tokenizer.convert_tokens_to_ids(c) for c in "Hello"]
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n")
    prompt = head + odd + tail
    assert tokenizer.encode(tokenizer.decode(prompt)) != prompt
    kwargs = {"max_new_tokens": 10, "seed": 5}
    policy = TransformersWrapper(tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=kwargs)
    td = TensorDict(tokens=Tokens.from_sequences([torch.tensor(prompt)], padded=True, pad_value=2), batch_size=[1])
    out = policy(td)
    assert out["tokens"].full_sequences()[0].tolist()[: len(prompt)] == prompt
    # the response ids are exactly what model.generate sampled with the same seed
    with torch.random.fork_rng():
        torch.manual_seed(5)
        ref = tiny_model.generate(
            torch.tensor([prompt]),
            max_new_tokens=10,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            eos_token_id=[2],
            pad_token_id=2,
        )[0, len(prompt) :].tolist()
    ref = ref[: ref.index(2) + 1] if 2 in ref else ref
    assert rows(out["tokens"], "response")[0] == ref
    assert "text" not in out.keys() and "history" not in out.keys()


def test_text_mode(tiny_model, tokenizer):
    texts = [apply_chat_template(tokenizer, c, add_generation_prompt=True, tokenize=False) for c in CHATS]
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="text", generate_kwargs={"max_new_tokens": 8}
    )
    td = TensorDict(text=Text(prompt=NonTensorStack.from_list(texts), batch_size=[3]), batch_size=[3])
    out = policy(td)
    for b in range(3):
        assert out["text"].prompt[b] == texts[b]
        assert out["text"].full[b] == texts[b] + out["text"].response[b]
        assert tokenizer.decode(rows(out["tokens"], "response")[b]) == out["text"].response[b]
    # the earlier assistant turn inside the prompt text is found by parsing the text
    mask = out["masks"].unpadded()[2]
    full = out["tokens"].full_sequences()[2]
    n = int(out["tokens"].prompt_length[2])
    assert tokenizer.decode(full[:n][mask[:n]]) == "Blue.<|im_end|>"


def test_num_samples_shapes_and_values(tiny_model, tokenizer):
    for pad in (True, False):
        policy = TransformersWrapper(
            tiny_model,
            tokenizer=tokenizer,
            num_samples=3,
            pad_output=pad,
            generate_kwargs={"max_new_tokens": 8, "seed": 2},
        )
        out = policy(history_td())
        assert out.batch_size == (3, 3)
        assert out["history"].response.batch_size[:2] == (3, 3)
        for b in range(3):
            tok_b = out["tokens"][b]
            responses = [tuple(r.tolist()) for r in tok_b.unpadded("response")]
            assert len(set(responses)) > 1, "samples of one prompt should differ"
            for k, (p, r) in enumerate(zip(tok_b.unpadded("prompt"), tok_b.unpadded("response"))):
                ids = p.tolist() + r.tolist()
                lp = out["log_probs"][b].unpadded("response")[k]
                assert (lp - reference_log_probs(tiny_model, ids)[len(p) :]).abs().max() < 1e-4


def test_greedy_num_samples_gives_each_sample_the_greedy_reply(tiny_model, tokenizer):
    # generate's greedy search refuses num_return_sequences > 1: the samples are rows of their own (as vLLM gives n)
    settings = {"max_new_tokens": 6, "temperature": 0, "repetition_penalty": 1.3}
    many = TransformersWrapper(tiny_model, tokenizer=tokenizer, num_samples=2, generate_kwargs=settings)
    one = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=settings)
    out, ref = many(history_td()), one(history_td())
    assert out.batch_size == (3, 2)
    for b in range(3):
        expected = ref["tokens"].unpadded("response")[b].tolist()
        assert [r.tolist() for r in out["tokens"][b].unpadded("response")] == [expected, expected]


# ------------------------------------------------------------------------------------------ versions, dist, act


def test_get_new_version_changes_only_what_is_asked(tiny_model, tokenizer):
    gen = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, num_samples=2, generate_kwargs={"max_new_tokens": 7, "temperature": 0.8}
    )
    scorer = gen.get_new_version(generate=False)
    assert scorer.input_key == ("history", "full") and scorer.num_samples is None and not scorer.generate
    assert scorer.settings.temperature == 0.8 and scorer.settings.max_new_tokens == 7
    back = scorer.get_new_version(generate=True)
    assert back.input_key == ("history", "prompt")
    assert back.settings.max_new_tokens == 7 and back.settings.temperature == 0.8
    other = gen.get_new_version(input_mode="tokens")
    assert other.input_key == ("tokens", "prompt") and other.num_samples == 2
    custom = TransformersWrapper(tiny_model, tokenizer=tokenizer, input_key="obs", input_mode="text")
    assert custom.get_new_version(generate=False).input_key == "obs"
    assert gen.model is scorer.model


def test_log_prob_and_get_dist(policy, tiny_model):
    out = policy(history_td())
    scored = policy.log_prob(out.copy())
    m = out["masks"].all_assistant_mask & ~torch.isnan(out["log_probs"].full)
    assert (scored["log_probs"].full[m] - out["log_probs"].full[m]).abs().max() < 1e-4
    # scoring defines every position but the first of each sequence
    attn = scored["masks"].all_attention_mask
    nan = torch.isnan(scored["log_probs"].full)
    assert (nan & attn).sum() == len(CHATS) and nan[~attn].all()
    scorer = policy.get_new_version(generate=False, input_mode="tokens")
    dist = scorer.get_dist(out.copy(), mask="assistant")
    lp = dist.log_prob(out["tokens"].full)
    assert torch.equal(dist.mask, out["masks"].all_assistant_mask)
    assert (lp[m] - out["log_probs"].full[m]).abs().max() < 1e-4
    assert (lp[~dist.mask] == 0).all()
    ent = dist.entropy()
    assert (ent[dist.mask] > 0).all() and (ent[~dist.mask] == 0).all()
    resp = scorer.get_dist(out.copy(), mask="response").mask
    assert resp.sum() == out["tokens"].response_length.sum()


def test_act_for_env_observations(tiny_model, tokenizer):
    kwargs = {"max_new_tokens": 6, "seed": 0}
    hist = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs)
    action, td = hist.act(CHATS[0])
    assert action["role"] == "assistant" and isinstance(action["content"], str)
    actions, td = hist.act(CHATS)
    assert len(actions) == 3 and td.batch_size == (3,)
    text = TransformersWrapper(tiny_model, tokenizer=tokenizer, input_mode="text", generate_kwargs=kwargs)
    reply, td = text.act("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # six tokens may end the reply (its text) or cut it (an incomplete message: no end-of-turn was sampled)
    ids = rows(td["tokens"], "response")[0]
    if ids[-1] in text.chat_tokenizer.stop_ids:
        assert reply == tokenizer.decode(ids[:-1])
    else:
        assert reply == {"role": "assistant", "content": td["text"].response[0], "is_complete": False}
    toks = TransformersWrapper(tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs=kwargs)
    prompts = [np.array(tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")), [1, 9, 2, 1, 5]]
    ids, td = toks.act(prompts)
    assert all(a.dtype == np.int64 for a in ids)
    assert [a.tolist() for a in ids] == rows(td["tokens"], "response")
    many = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", num_samples=2, generate_kwargs=kwargs
    )
    ids, td = many.act(prompts)
    assert len(ids) == 2 and len(ids[0]) == 2 and td.batch_size == (2, 2)


# ------------------------------------------------------------------------------------------ bad input


def test_bad_inputs_raise_clearly(policy, tiny_model, tokenizer):
    with pytest.raises(KeyError, match="input key"):
        policy(TensorDict(batch_size=[1]))
    toks = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 4}
    )
    with pytest.raises(ValueError, match="empty input"):
        toks(TensorDict(tokens=Tokens.from_sequences([torch.tensor([], dtype=torch.long)]), batch_size=[1]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        toks(TensorDict(tokens=Tokens.from_sequences([torch.tensor([5, 10**6])]), batch_size=[1]))
    with pytest.raises(ValueError, match="ambiguous"):
        toks(TensorDict({("tokens", "prompt"): torch.tensor([[2, 2, 5, 6]])}, batch_size=[1]))
    ok = toks(
        TensorDict(
            {("tokens", "prompt"): torch.tensor([[2, 2, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1, 1]])},
            batch_size=[1],
        )
    )
    assert rows(ok["tokens"], "prompt")[0] == [2, 5, 6]
    with pytest.raises(ValueError, match="context length"):
        toks(TensorDict(tokens=Tokens.from_sequences([torch.full((1030,), 5)]), batch_size=[1]))
    with pytest.raises(TypeError, match="History"):
        policy(TensorDict({("history", "prompt"): torch.zeros(1, 3)}, batch_size=[1]))


@pytest.mark.slow
def test_smollm2_greedy_answer_and_eos(smollm2):
    """The real model: the reply ends with <|im_end|> (pad == eos) and its log-prob is kept and exact."""
    smollm2, tokenizer = smollm2
    policy = TransformersWrapper(smollm2, tokenizer=tokenizer, generate_kwargs={"max_new_tokens": 24, "temperature": 0})
    out = policy(history_td([[{"role": "user", "content": "What is 2+2? Answer with a number."}]]))
    ids = rows(out["tokens"], "response")[0]
    assert ids[-1] == tokenizer.eos_token_id == tokenizer.pad_token_id
    reply = out["history"].response.to_chats()[0][0]
    assert "4" in reply["content"] and reply.get("is_complete", True)
    prompt = rows(out["tokens"], "prompt")[0]
    ref = reference_log_probs(smollm2, prompt + ids)[len(prompt) :]
    assert (out["log_probs"].unpadded("response")[0] - ref).abs().max() < 1e-4
    assert out["masks"].all_assistant_mask[0, -1]


def test_stop_strings_end_the_response(tiny_model, tokenizer):
    policy = TransformersWrapper(
        tiny_model,
        tokenizer=tokenizer,
        generate_kwargs={"max_new_tokens": 24, "seed": 0, "stop": " ", "ignore_eos": True},
    )
    out = policy(history_td())
    stopped = 0
    for ids in rows(out["tokens"], "response"):
        text = tokenizer.decode(ids)
        if len(ids) < 24:
            # the response ends with the token that completed the stop string, not before, not after
            assert " " in text and " " not in tokenizer.decode(ids[:-1])
            stopped += 1
    assert stopped >= 1
