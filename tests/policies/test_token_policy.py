"""TokenStepPolicy: every sampling setting carried over from a wrapper and honoured, checked against the
wrapper's scoring and an independent forward; settings it cannot honour are refused."""

import numpy as np
import pytest
import torch
from test_policy_sampling import END, SETTINGS, processed_reference

from chatenv import TokenEnv, apply_chat_template
from wrappers.policies import TransformersWrapper
from wrappers.token_policy import TokenStepPolicy

PROMPTS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you today?"}],
]


def prompt_ids(tokenizer):
    return [apply_chat_template(tokenizer, c, add_generation_prompt=True)["input_ids"].tolist() for c in PROMPTS]


def step(policy, obs, n):
    """Act n times, appending each action; the observations and the log-prob of each action."""
    lps = [[] for _ in obs]
    obs = [list(o) for o in obs]
    for _ in range(n):
        actions, log_probs = policy.act([np.array(o) for o in obs])
        for b, (a, lp) in enumerate(zip(actions, log_probs)):
            obs[b].append(int(a))
            lps[b].append(float(lp))
    return obs, [torch.tensor(x) for x in lps]


@pytest.mark.parametrize("kwargs", SETTINGS, ids=lambda k: "+".join(k))
def test_from_wrapper_log_probs_equal_the_wrappers_scoring(kwargs, tiny_model, tokenizer):
    wrapper = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"seed": 0, **kwargs}
    )
    policy = TokenStepPolicy.from_wrapper(wrapper)
    for name, value in kwargs.items():
        assert getattr(policy, name) == value, name
    assert policy.model is tiny_model and set(policy.end_ids) == set(wrapper.stop_ids)
    prompts = prompt_ids(tokenizer)
    seqs, lps = step(policy, prompts, 8)
    scored = wrapper.get_new_version(generate=False).score_sequences(seqs, prompt_lengths=[len(p) for p in prompts])
    for b, p in enumerate(prompts):
        n = len(p)
        assert torch.isfinite(lps[b]).all()
        assert (scored[b][n:] - lps[b]).abs().max() < 1e-4, b
        assert (processed_reference(tiny_model, seqs[b], n, **kwargs)[n:] - lps[b]).abs().max() < 1e-4, b
    if "min_new_tokens" in kwargs:
        assert all(END not in s[len(p) : len(p) + kwargs["min_new_tokens"]] for s, p in zip(seqs, prompts))


def test_raw_log_probs_and_reset(tiny_model, tokenizer):
    kwargs = {"temperature": 0.6, "top_k": 10, "repetition_penalty": 1.3, "seed": 3}
    policy = TokenStepPolicy.from_wrapper(
        TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs, raw_log_probs=True)
    )
    assert policy.raw_log_probs
    prompts = prompt_ids(tokenizer)
    seqs, lps = step(policy, prompts, 5)
    for b, p in enumerate(prompts):
        raw = processed_reference(tiny_model, seqs[b], len(p))[len(p) :]
        assert (raw - lps[b]).abs().max() < 1e-4
    # a fresh episode rebuilds the cache; the same seed draws the same tokens again
    again = TokenStepPolicy.from_wrapper(
        TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs, raw_log_probs=True)
    )
    assert step(again, prompts, 5)[0] == seqs


def test_min_new_tokens_counts_each_reply(tiny_model, tokenizer):
    """The ban covers the first tokens of every reply: counting restarts when the env appends a new turn."""
    policy = TokenStepPolicy(tiny_model, tokenizer, temperature=0.9, min_new_tokens=2, seed=5)
    assert policy.end_ids == (END,)
    prompt = prompt_ids(tokenizer)[0]
    first, lp1 = step(policy, [prompt], 3)
    turn = tokenizer.encode("<|im_end|>\n<|im_start|>user\nAgain?<|im_end|>\n<|im_start|>assistant\n")
    second, lp2 = step(policy, [first[0] + turn], 3)
    kw = {"temperature": 0.9, "min_new_tokens": 2}
    ref1 = processed_reference(tiny_model, first[0], len(prompt), **kw)[len(prompt) :]
    start = len(first[0]) + len(turn)
    ref2 = processed_reference(tiny_model, second[0], start, **kw)[start:]
    assert (ref1 - lp1[0]).abs().max() < 1e-4 and (ref2 - lp2[0]).abs().max() < 1e-4


def find_end_prompt(model):
    """Token ids after which the model's most likely next token is the end id."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(400):
        ids = [1, *torch.randint(100, 5000, (6,), generator=gen).tolist()]
        with torch.no_grad():
            if model(torch.tensor([ids])).logits[0, -1].argmax().item() == END:
                return ids
    raise AssertionError("no prompt found whose greedy next token is the end id")


def test_min_new_tokens_forbids_end_ids(tiny_model, tokenizer):
    ids = find_end_prompt(tiny_model)
    greedy = TokenStepPolicy(tiny_model, tokenizer, temperature=0)
    assert greedy.act([np.array(ids)])[0][0] == END
    banned = TokenStepPolicy(tiny_model, tokenizer, temperature=0, min_new_tokens=1)
    action, lp = banned.act([np.array(ids)])
    with torch.no_grad():
        logits = tiny_model(torch.tensor([ids])).logits[0, -1].float()
    logits_wo_end = logits.clone()
    logits_wo_end[END] = -float("inf")
    assert action[0] == logits_wo_end.argmax().item() != END
    # greedy reports the model's own log-prob of the chosen token
    assert abs(float(lp[0]) - logits.log_softmax(-1)[action[0]].item()) < 1e-4
    # sampling: the end id is never drawn while banned, and its reported probability is 0
    sampler = TokenStepPolicy(tiny_model, tokenizer, min_new_tokens=1, end_ids=[END], seed=0)
    actions, lps = sampler.act([np.array(ids)] * 64)
    assert END not in actions.tolist() and np.isfinite(lps).all()


def test_settings_it_cannot_honour_are_refused(tiny_model, tokenizer):
    for kwargs, match in [
        ({"stop": "END"}, "stop strings"),
        ({"stop_token_ids": [5]}, "extra stop ids"),
        ({"ignore_eos": True}, "ignore_eos"),
        ({"n": 2}, "num_samples"),
    ]:
        wrapper = TransformersWrapper(tiny_model, tokenizer=tokenizer, generate_kwargs=kwargs)
        with pytest.raises(ValueError, match=match):
            TokenStepPolicy.from_wrapper(wrapper)
    with pytest.raises(TypeError, match="TransformersWrapper"):
        TokenStepPolicy.from_wrapper(object())
    with pytest.raises(ValueError, match="top_p"):
        TokenStepPolicy(tiny_model, tokenizer, top_p=0)
    with pytest.raises(ValueError, match="temperature=0 for greedy"):
        TokenStepPolicy(tiny_model, tokenizer, temperature=1e-6)


@pytest.mark.slow
def test_steps_a_token_env_with_every_setting(tiny_model, tokenizer):
    """Through real TokenEnv steps (replies end, feedback turns, resets) log-probs match an independent forward."""
    kwargs = {"temperature": 0.8, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 1.2, "min_new_tokens": 2}
    policy = TokenStepPolicy(tiny_model, tokenizer, seed=1, **kwargs)
    env = TokenEnv("arithmetic", tokenizer=tokenizer, max_new_tokens=6)
    obs, _ = env.reset(seed=0)
    reply_start, checked, episodes = len(obs), 0, 0
    for _ in range(30):
        action, lp = policy.act([obs])
        seq = obs.tolist() + [int(action[0])]
        ref = processed_reference(tiny_model, seq, reply_start, start=len(seq) - 1, **kwargs)[-1].item()
        assert abs(ref - float(lp[0])) < 1e-4
        checked += 1
        nxt, _, terminated, truncated, _ = env.step(int(action[0]))
        if terminated or truncated:
            episodes += 1
            nxt, _ = env.reset(seed=episodes)
            reply_start = len(nxt)
        elif len(nxt) > len(seq):
            reply_start = len(nxt)  # the task answered: a new reply starts after its header
        obs = nxt
    assert checked == 30 and episodes >= 1


# ------------------------------------------------------------------------------------------ the KV cache


class FailsToSample(TokenStepPolicy):
    """The real policy, whose sampling fails once after the forward pass (an interrupt, a NaN distribution)."""

    fail = False

    def _sample(self, logits, rows, counts):
        if self.fail:
            self.fail = False
            raise RuntimeError("sampling failed")
        return super()._sample(logits, rows, counts)


class CountsFed:
    """Records, per forward pass, how many real tokens each row fed (the live part of the new chunk)."""

    def __init__(self, model):
        self.fed = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        if "input_ids" not in kwargs:  # the independent reference forward of check_against_forward
            return
        width = kwargs["input_ids"].shape[1]
        self.fed.append(kwargs["attention_mask"][:, -width:].sum(-1).tolist())


def check_against_forward(model, seqs, lps, starts, kwargs):
    """Each row's log-prob of its last token equals an independent forward over the row (one reply per row)."""
    for seq, lp, start in zip(seqs, lps, starts):
        ref = processed_reference(model, seq, start, start=len(seq) - 1, **kwargs)[-1].item()
        assert abs(ref - float(lp)) < 1e-4


def test_a_failed_call_leaves_the_cache_as_it_was(tiny_model, tokenizer):
    kwargs = {"temperature": 0.9, "repetition_penalty": 1.2, "min_new_tokens": 2}
    policy = FailsToSample(tiny_model, tokenizer, seed=7, **kwargs)
    fresh = TokenStepPolicy(tiny_model, tokenizer, seed=7, **kwargs)
    obs = prompt_ids(tokenizer)
    starts = [len(o) for o in obs]
    for _ in range(2):
        actions, _ = policy.act([np.array(o) for o in obs])
        assert np.array_equal(actions, fresh.act([np.array(o) for o in obs])[0])
        obs = [o + [int(a)] for o, a in zip(obs, actions)]
    policy.fail = True
    with pytest.raises(RuntimeError, match="sampling failed"):
        policy.act([np.array(o) for o in obs])
    # the failed forward's ids are not fed twice: the same step again equals a policy that never failed
    got, expected = policy.act([np.array(o) for o in obs]), fresh.act([np.array(o) for o in obs])
    assert np.array_equal(got[0], expected[0]) and np.allclose(got[1], expected[1], atol=1e-5)
    seqs = [o + [int(a)] for o, a in zip(obs, got[0])]
    check_against_forward(tiny_model, seqs, got[1], starts, kwargs)
    # and the next step (the cache rebuilt once) goes on as before
    got, expected = policy.act([np.array(s) for s in seqs]), fresh.act([np.array(s) for s in seqs])
    assert np.array_equal(got[0], expected[0]) and np.allclose(got[1], expected[1], atol=1e-5)
    check_against_forward(tiny_model, [s + [int(a)] for s, a in zip(seqs, got[0])], got[1], starts, kwargs)


def test_one_row_resetting_rebuilds_only_that_row(tiny_model, tokenizer):
    kwargs = {"temperature": 0.8, "top_k": 50, "min_new_tokens": 2}
    policy = TokenStepPolicy(tiny_model, tokenizer, seed=3, **kwargs)
    obs = prompt_ids(tokenizer)
    starts = [len(o) for o in obs]
    counter = CountsFed(tiny_model)
    try:
        for _ in range(3):
            actions, lps = policy.act([np.array(o) for o in obs])
            obs = [o + [int(a)] for o, a in zip(obs, actions)]
            check_against_forward(tiny_model, obs, lps, starts, kwargs)
        # row 1's env resets to a longer prompt; row 0 goes on with its reply
        chat = [{"role": "user", "content": "Count from one to twenty in words, please."}]
        other = apply_chat_template(tokenizer, chat, add_generation_prompt=True)["input_ids"].tolist()
        assert len(other) > len(obs[1])
        obs[1], starts[1] = other, len(other)
        for _ in range(3):
            actions, lps = policy.act([np.array(o) for o in obs])
            obs = [o + [int(a)] for o, a in zip(obs, actions)]
            check_against_forward(tiny_model, obs, lps, starts, kwargs)
    finally:
        counter.handle.remove()
    # the first call fed both prompts; then one token per row, except the reset row's whole new prompt
    first = [len(p) for p in prompt_ids(tokenizer)]
    assert counter.fed == [first, [1, 1], [1, 1], [1, len(other)], [1, 1], [1, 1]]


def test_many_resets_keep_the_cache_small_and_exact(tiny_model, tokenizer):
    """Rows reset at different times: dead cache entries are compacted away, log-probs stay exact."""
    kwargs = {"temperature": 0.9}
    policy = TokenStepPolicy(tiny_model, tokenizer, seed=5, **kwargs)
    prompts = prompt_ids(tokenizer)
    obs, starts = [list(p) for p in prompts], [len(p) for p in prompts]
    for t in range(24):
        b = t % 2
        if t % 4 in (1, 2):  # row b starts over (its prompt again) while the other row goes on
            obs[b], starts[b] = list(prompts[b]), len(prompts[b])
        actions, lps = policy.act([np.array(o) for o in obs])
        obs = [o + [int(a)] for o, a in zip(obs, actions)]
        check_against_forward(tiny_model, obs, lps, starts, kwargs)
        assert policy._mask.shape[1] <= 2 * max(len(o) for o in obs) + max(starts)
