"""RefLogProbs / KLPenalty: steps are transactions, the reference is found by attribute, text replies are scored."""

import math
import time

import numpy as np
import pytest
import torch
from conftest import make_tiny_llama
from helpers import reference_log_probs

from chatenv import ChatEnv, ScoredAction, TokenEnv
from chatenv.protocols import REF_MODEL_ATTR
from chatenv.tasks import ArithmeticTask
from wrappers.kl import AdaptiveKLController, KLPenalty, ReferenceModel, RefLogProbs


@pytest.fixture(scope="module")
def ref(ref_tiny, tokenizer):
    return ReferenceModel(ref_tiny, tokenizer)


@pytest.fixture(scope="module")
def broken_ref(tokenizer):
    """A real model whose weights went NaN (as after a diverged update): every log-prob it gives is NaN."""
    model = make_tiny_llama(seed=2)
    with torch.no_grad():
        model.lm_head.weight[7] = math.nan
    return ReferenceModel(model, tokenizer)


def reply(tokenizer, text="<answer>7</answer>"):
    return tokenizer.encode(text) + [2]


def policy_log_probs(model, obs, ids):
    """The policy's log-probs of ``ids`` after ``obs`` from an independent forward (what a generator reports)."""
    return reference_log_probs(model, list(obs) + list(ids))[len(obs) :].numpy()


def kl_env(ref, coef_or_ctl):
    ctl = coef_or_ctl if isinstance(coef_or_ctl, AdaptiveKLController) else None
    coef = None if ctl is not None else coef_or_ctl
    return KLPenalty(RefLogProbs(ChatEnv("arithmetic", input_mode="tokens"), ref), ctl if ctl is not None else coef)


BAD_ACTIONS = {
    "policy NaN": (lambda ids, lp: ScoredAction(ids, np.where(np.arange(len(ids)) == 1, np.nan, lp)), "policy's"),
    "policy inf": (lambda ids, lp: ScoredAction(ids, np.full(len(ids), -np.inf)), "policy's log-probs"),
    "policy length": (lambda ids, lp: ScoredAction(ids, lp[:-1]), r"has \d+ values for \d+ generated tokens"),
    "precomputed ref NaN": (
        lambda ids, lp: ScoredAction(ids, lp, ref_log_probs=np.full(len(ids), np.nan)),
        r"precomputed reference log-probs \(ScoredAction.ref_log_probs\) is not finite at token 0",
    ),
    "precomputed ref length": (
        lambda ids, lp: ScoredAction(ids, lp, ref_log_probs=np.zeros(len(ids) + 1)),
        "precomputed reference log-probs",
    ),
    "id outside vocabulary": (lambda ids, lp: ScoredAction([*ids[:-1], 10**6], lp), "outside the vocabulary"),
    "no log-probs": (lambda ids, lp: np.asarray(ids), "generation log-probs"),
}


@pytest.mark.parametrize("case", sorted(BAD_ACTIONS))
def test_failed_step_leaves_env_and_controller_unchanged(case, tiny_model, ref, tokenizer):
    make_bad, message = BAD_ACTIONS[case]
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=0.01, horizon=10)
    env = kl_env(ref, ctl)
    obs, _ = env.reset(seed=0)
    ids = reply(tokenizer)
    lp = policy_log_probs(tiny_model, obs, ids)
    with pytest.raises(ValueError, match=message):
        env.step(make_bad(ids, lp))
    assert np.array_equal(env.unwrapped.token_ids, obs)
    assert ctl.coef == 0.2
    # the next valid step is exactly a fresh env's with the same seed
    after = env.step(ScoredAction(ids, lp))
    fresh_ctl = AdaptiveKLController(init_kl_coef=0.2, target=0.01, horizon=10)
    fresh = kl_env(ref, fresh_ctl)
    fresh_obs, _ = fresh.reset(seed=0)
    assert np.array_equal(fresh_obs, obs)
    expected = fresh.step(ScoredAction(ids, lp))
    assert np.array_equal(after[0], expected[0]) and after[1:4] == expected[1:4]
    assert after[4] == expected[4]
    assert ctl.coef == fresh_ctl.coef != 0.2


def test_broken_reference_fails_before_the_env_moves(broken_ref, ref, tiny_model, tokenizer):
    env = kl_env(broken_ref, 0.1)
    obs, _ = env.reset(seed=3)
    ids = reply(tokenizer)
    lp = policy_log_probs(tiny_model, obs, ids)
    with pytest.raises(ValueError, match=r"the reference model LlamaForCausalLM gave a non-finite log-prob \(nan\)"):
        env.step(ScoredAction(ids, lp))
    assert np.array_equal(env.unwrapped.token_ids, obs)
    with pytest.raises(ValueError, match="weights or activations are NaN or inf"):
        env.get_wrapper_attr("reference_log_probs")(ScoredAction(ids, lp))
    # RefLogProbs alone is a transaction too
    alone = RefLogProbs(ChatEnv("arithmetic", input_mode="tokens"), broken_ref)
    obs, _ = alone.reset(seed=3)
    with pytest.raises(ValueError, match="non-finite log-prob"):
        alone.step(np.asarray(ids))
    assert np.array_equal(alone.unwrapped.token_ids, obs)
    # with a working reference the same step goes through and matches a separate forward
    good = RefLogProbs(ChatEnv("arithmetic", input_mode="tokens"), ref)
    obs, _ = good.reset(seed=3)
    _, _, _, _, info = good.step(np.asarray(ids))
    q = reference_log_probs(ref.model, obs.tolist() + ids)[len(obs) :]
    assert np.allclose(info["ref_log_probs"], q.numpy(), atol=1e-4) and "log_probs" not in info


def test_token_env_step_is_a_transaction(tiny_model, ref, tokenizer):
    def make():
        return KLPenalty(TokenEnv("arithmetic", max_new_tokens=8), 0.1, ref_model=ref)

    env = make()
    obs, _ = env.reset(seed=0)
    token = reply(tokenizer)[0]
    lp = policy_log_probs(tiny_model, obs, [token])
    with pytest.raises(ValueError, match="policy's log-probs"):
        env.step(ScoredAction(np.array([token]), np.array([np.nan])))
    with pytest.raises(ValueError, match="has 2 values for 1 generated tokens"):
        env.step(ScoredAction(np.array([token]), np.array([-1.0, -1.0])))
    assert np.array_equal(env.unwrapped.token_ids, obs)
    fresh = make()
    fresh.reset(seed=0)
    a, b = env.step(ScoredAction(np.array([token]), lp)), fresh.step(ScoredAction(np.array([token]), lp))
    assert np.array_equal(a[0], b[0]) and a[1:] == b[1:]
    q = reference_log_probs(ref.model, obs.tolist() + [token])[-1].item()
    assert a[4]["kl"] == pytest.approx([float(lp[0]) - q], abs=1e-4)


def test_reference_found_with_get_wrapper_attr(ref):
    assert REF_MODEL_ATTR == "ref_model"
    env = KLPenalty(RefLogProbs(ChatEnv("arithmetic", input_mode="tokens"), ref), 0.1)
    assert env.get_wrapper_attr(REF_MODEL_ATTR) is ref
    assert (
        KLPenalty(ChatEnv("arithmetic", input_mode="tokens"), 0.1, ref_model=ref).get_wrapper_attr(REF_MODEL_ATTR)
        is ref
    )
    bare = KLPenalty(RefLogProbs(ChatEnv("arithmetic", input_mode="tokens")), 0.1)
    assert bare.get_wrapper_attr(REF_MODEL_ATTR) is None  # values come precomputed with the actions


@pytest.mark.parametrize("mode", ["history", "text"])
@pytest.mark.parametrize(
    "action", ["I think <answer>12</answer>", {"role": "assistant", "content": "<answer>5</answer>"}]
)
def test_text_and_message_replies_are_scored_on_the_envs_tokens(mode, action, ref):
    env = RefLogProbs(ChatEnv("arithmetic", input_mode=mode), ref)
    env.reset(seed=1)
    start = len(env.unwrapped.token_ids)
    _, _, _, _, info = env.step(action)
    n = info["response_tokens"]
    seq = env.unwrapped.token_ids[: start + n].tolist()
    q = reference_log_probs(ref.model, seq)[start:]
    assert len(info["ref_log_probs"]) == n > 3 and np.allclose(info["ref_log_probs"], q.numpy(), atol=1e-4)


def test_tokens_mode_refuses_text(ref):
    env = RefLogProbs(ChatEnv("arithmetic", input_mode="tokens"), ref)
    obs, _ = env.reset(seed=1)
    with pytest.raises(TypeError, match="tokens mode takes the generated token ids"):
        env.step("some text")
    assert np.array_equal(env.unwrapped.token_ids, obs)


def test_policy_output_rows_are_actions(tiny_model, ref, tokenizer):
    from wrappers.policies import TransformersWrapper

    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 6, "seed": 7}
    )
    env = KLPenalty(ChatEnv("arithmetic", input_mode="tokens"), 0.3, estimator="k2", ref_model=ref)
    obs, _ = env.reset(seed=2)
    ids, out = policy.act(obs)
    _, reward, _, _, info = env.step(out)
    p = reference_log_probs(tiny_model, obs.tolist() + ids.tolist())[len(obs) :]
    q = reference_log_probs(ref.model, obs.tolist() + ids.tolist())[len(obs) :]
    kl = 0.5 * (p - q) ** 2
    assert np.allclose(info["kl"], kl.numpy(), atol=1e-4)
    assert reward == pytest.approx(info["task_reward"] - 0.3 * float(kl.sum()), abs=1e-4)
    assert info["token_rewards"][-1] == pytest.approx(info["task_reward"] - 0.3 * float(kl[-1]), abs=1e-4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"kl": -1.0}, "kl must be a finite number >= 0, got -1.0"),
        ({"kl": math.nan}, "kl must be a finite number >= 0, got nan"),
        ({"kl": 0.1, "estimator": "k4"}, "estimator must be one of"),
    ],
)
def test_kl_penalty_refuses_bad_settings(kwargs, message, ref):
    with pytest.raises(ValueError, match=message):
        KLPenalty(ChatEnv("arithmetic", input_mode="tokens"), ref_model=ref, **kwargs)


def test_reference_model_checks_its_temperature(ref_tiny, tokenizer):
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
            ReferenceModel(ref_tiny, tokenizer, temperature=bad)
    with pytest.raises(TypeError, match="log_probs"):
        RefLogProbs(ChatEnv("arithmetic", input_mode="tokens"), ref_model=ref_tiny)


class SlowArithmetic(ArithmeticTask):
    """Arithmetic whose answers take a while (as a slow reward would): env steps on threads overlap."""

    def respond(self, messages, state):
        time.sleep(0.05)
        return super().respond(messages, state)


def _adaptive_factor(kl_sum, target, horizon):
    """One step's multiplicative update of the adaptive controller (Ziegler et al.), computed here."""
    return max(1.0 + min(max(kl_sum / target - 1.0, -0.2), 0.2) / horizon, 0.0)


def test_controller_shared_by_envs_on_threads_is_updated_once_per_step_in_turn(tiny_model, ref, tokenizer):
    import chatenv
    from wrappers.policies import TransformersWrapper

    init, target, horizon = 0.2, 15.0, 10.0
    ctl = AdaptiveKLController(init_kl_coef=init, target=target, horizon=horizon)
    envs = [
        KLPenalty(ChatEnv(SlowArithmetic(), input_mode="tokens", max_turns=2), ctl, estimator="k2", ref_model=ref)
        for _ in range(4)
    ]
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 8, "seed": 0}
    )
    td = chatenv.rollout(envs, policy, episodes=4, seed=0)  # 4 envs stepped on worker threads, 2 rounds
    assert len(td) == 8 and sorted(td["env_index"].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
    kl = td["kl"].full.double()  # (N, L): NaN outside the turn's generated tokens
    kl_sums = torch.where(torch.isnan(kl), torch.zeros_like(kl), kl).sum(-1)  # (N,)
    assert (kl_sums > 1e-2).all()
    factors = [_adaptive_factor(float(s), target, horizon) for s in kl_sums]
    assert len({round(f, 9) for f in factors}) > 1  # updates that differ: the order of the steps could matter
    # the final coefficient: every step's update applied once (the update is multiplicative: order-independent)
    assert ctl.coef == pytest.approx(init * math.prod(factors), rel=1e-6)
    # the coefficient each step used (reward = task reward - coef * sum kl): the steps form one chain, each using
    # the coefficient the steps before it left, as if the envs had been stepped one after another
    task = td["next", "task_reward"][:, 0].double()
    used = ((task - td["next", "reward"][:, 0].double()) / kl_sums).tolist()
    current, left = init, list(range(len(used)))
    while left:
        i = min(left, key=lambda j: abs(used[j] - current))
        assert used[i] == pytest.approx(current, rel=1e-5), f"step {i} used {used[i]}, the chain is at {current}"
        left.remove(i)
        current *= factors[i]


def test_token_env_reference_is_incremental_and_equals_full_forwards(ref_tiny, tokenizer):
    ref = ReferenceModel(ref_tiny, tokenizer, temperature=0.7)
    lengths = []  # tokens each forward of the reference model runs over
    hook = ref_tiny.model.embed_tokens.register_forward_hook(lambda m, i, o: lengths.append(i[0].shape[-1]))
    try:
        env = RefLogProbs(TokenEnv("arithmetic", max_new_tokens=32), ref)
        obs, _ = env.reset(seed=4)
        tokens = tokenizer.encode("I think the answer is <answer>42</answer>, since 6 times 7 is 42.")
        per_step = []  # the forwards of each step
        for t, token in enumerate(tokens):
            context = env.unwrapped.token_ids.tolist()
            start = len(lengths)
            _, _, terminated, truncated, info = env.step(np.array([token]))
            per_step.append(lengths[start:])
            assert not (terminated or truncated)
            if t % 5 == 0 or t == len(tokens) - 1:  # against a fresh full forward of the whole sequence
                full = reference_log_probs(ref_tiny, context + [token], temperature=0.7)[-1].item()
                assert info["ref_log_probs"][0] == pytest.approx(full, abs=1e-5)
    finally:
        hook.remove()
    # one forward over the opening and the first token, then one token per step: O(T) work per reply, not O(T^2)
    assert per_step == [[len(obs) + 1]] + [[1]] * (len(tokens) - 1)


def test_incremental_scoring_equals_a_full_forward_whatever_is_asked(ref_tiny, tokenizer):
    cached = ReferenceModel(ref_tiny, tokenizer, kv_cache_size=2)
    fresh = ReferenceModel(ref_tiny, tokenizer, kv_cache_size=0)  # every call a full forward
    base = tokenizer.encode("What is 6 times 7? Think step by step.")
    other = tokenizer.encode("Name three colours of the rainbow, please.")
    asks = [
        base,
        base + [330],  # extends the last one
        base + [330, 2567, 314],  # by several tokens
        base[:5],  # a prefix of a kept sequence
        base + [17],  # diverges from the kept ones: a full forward
        other,
        other + [28],
        base + [330, 2567, 314, 9],  # the least recently used entry was dropped (size 2): scored again
    ]
    for seq in asks:
        got, want = cached.log_probs([seq])[0], fresh.log_probs([seq])[0]
        independent = reference_log_probs(ref_tiny, seq)
        assert math.isnan(got[0]) and torch.allclose(got[1:], want[1:], atol=1e-5)
        assert torch.allclose(got[1:], independent[1:], atol=1e-5)
    batch = cached.log_probs([base, other])  # batches take the batched forward
    assert torch.allclose(batch[1][1:], fresh.log_probs([other])[0][1:], atol=1e-5)
    cached.clear_cache()
    assert torch.allclose(cached.log_probs([base])[0][1:], fresh.log_probs([base])[0][1:], atol=1e-5)
