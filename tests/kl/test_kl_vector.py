"""VectorRefLogProbs: one reference forward per vector step for all sub-envs, with real Gymnasium vector envs."""

import gymnasium as gym
import numpy as np
import pytest
from helpers import reference_log_probs

from chatenv import ChatEnv, ScoredAction
from chatenv.protocols import REF_MODEL_ATTR
from wrappers.kl import KLPenalty, ReferenceModel, RefLogProbs, VectorRefLogProbs
from wrappers.policies import TransformersWrapper


class CountingReference(ReferenceModel):
    """The real reference model; it only counts its forward calls and the sequences it scored."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.scored = 0

    def log_probs(self, sequences):
        self.calls += 1
        self.scored += len(sequences)
        return super().log_probs(sequences)


def model_free_kl_env():
    # no model in the sub-env: the reference log-probs arrive with the actions
    return KLPenalty(RefLogProbs(ChatEnv("arithmetic", input_mode="tokens", max_turns=3)), 0.1)


@pytest.fixture(scope="module")
def policy(tiny_model, tokenizer):
    return TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 6, "seed": 11}
    )


def make_vector(mode, n=3):
    fns = [model_free_kl_env] * n
    return gym.vector.SyncVectorEnv(fns) if mode == "sync" else gym.vector.AsyncVectorEnv(fns)


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_one_reference_forward_per_vector_step(mode, tiny_model, ref_tiny, tokenizer, policy):
    ref = CountingReference(ref_tiny, tokenizer)
    separate = ReferenceModel(ref_tiny, tokenizer)
    venv = VectorRefLogProbs(make_vector(mode), ref)
    assert venv.ref_model is ref and getattr(venv, REF_MODEL_ATTR) is ref
    obs, _ = venv.reset(seed=0)
    done = np.zeros(3, dtype=bool)
    checked = 0
    for step in range(3):
        prompts = [np.asarray(o) for o in obs]
        ids, out = policy.act(prompts)
        lps = [lp.numpy() for lp in out["log_probs"].unpadded("response")]
        # prompt_ids given on even steps; read from the sub-envs' token_ids on odd ones
        actions = [ScoredAction(a, lp, prompt_ids=p if step % 2 == 0 else None) for a, lp, p in zip(ids, lps, prompts)]
        calls = ref.calls
        obs, reward, terminated, truncated, info = venv.step(tuple(actions))
        assert ref.calls == calls + 1  # one batched forward for all sub-envs
        for i, (p, a) in enumerate(zip(prompts, ids)):
            assert actions[i].ref_log_probs is None  # the caller's actions are not changed
            if done[i]:  # this step was the sub-env's autoreset: the action was not used
                continue
            checked += 1
            seq = p.tolist() + a.tolist()
            q_separate = separate.log_probs([seq])[0][len(p) :]
            assert np.allclose(info["ref_log_probs"][i], q_separate.numpy(), atol=1e-5)
            p_lp = reference_log_probs(tiny_model, seq)[len(p) :]
            q = reference_log_probs(ref_tiny, seq)[len(p) :]
            assert np.allclose(info["ref_log_probs"][i], q.numpy(), atol=1e-4)
            assert np.allclose(info["kl"][i], (p_lp - q).numpy(), atol=2e-4)
            assert reward[i] == pytest.approx(info["task_reward"][i] - 0.1 * float((p_lp - q).sum()), abs=1e-3)
        done = terminated | truncated
    assert checked >= 7
    venv.close()


def test_placeholders_rows_and_precomputed_values(tiny_model, ref_tiny, tokenizer, policy):
    ref = CountingReference(ref_tiny, tokenizer)
    venv = VectorRefLogProbs(make_vector("sync"), ref)
    obs, _ = venv.reset(seed=1)
    prompts = [np.asarray(o) for o in obs]
    ids0, row0 = policy.act(prompts[0])
    ids1, out1 = policy.act(prompts[1])
    lp1 = out1["log_probs"].unpadded("response")[0].numpy()
    given = np.full(len(ids1), -2.0, dtype=np.float32)
    filler = ScoredAction(np.array([2]), placeholder=True)
    # sub-env 0: a policy output row; sub-env 1: values already computed; sub-env 2: a placeholder
    _, _, _, _, info = venv.step((row0, ScoredAction(ids1, lp1, ref_log_probs=given), filler))
    assert ref.calls == 1 and ref.scored == 1  # only the row needed scoring
    q0 = reference_log_probs(ref_tiny, prompts[0].tolist() + ids0.tolist())[len(prompts[0]) :]
    assert np.allclose(info["ref_log_probs"][0], q0.numpy(), atol=1e-4)
    assert np.allclose(info["ref_log_probs"][1], given)
    assert not info["_kl"][2]  # the placeholder step computed nothing
    # placeholders only: no forward at all
    venv.step((filler, filler, filler))
    assert ref.calls == 1
    venv.close()


def test_a_bad_action_fails_before_any_sub_env_steps(tiny_model, ref_tiny, tokenizer, policy):
    ref = CountingReference(ref_tiny, tokenizer)
    venv = VectorRefLogProbs(make_vector("sync"), ref)
    obs, _ = venv.reset(seed=2)
    prompts = [np.asarray(o) for o in obs]
    ids, out = policy.act(prompts)
    lps = [lp.numpy() for lp in out["log_probs"].unpadded("response")]
    bad = lps[2].copy()
    bad[0] = np.nan
    actions = [ScoredAction(a, lp, prompt_ids=p) for a, lp, p in zip(ids, lps[:2] + [bad], prompts)]
    with pytest.raises(ValueError, match=r"sub-env 2: the policy's log-probs \(ScoredAction.log_probs\) is not finite"):
        venv.step(tuple(actions))
    for before, now in zip(prompts, venv.unwrapped.get_attr("token_ids")):
        assert np.array_equal(before, now)
    with pytest.raises(ValueError, match="expected 3 actions"):
        venv.step(tuple(actions[:2]))
    with pytest.raises(TypeError, match="log_probs"):
        VectorRefLogProbs(make_vector("sync"), ref_tiny)
    venv.close()


class CountingPolicy(TransformersWrapper):
    """The real policy, counting its (batched) calls."""

    calls = 0

    def forward(self, tensordict):
        self.calls += 1
        return super().forward(tensordict)


def test_rollout_through_the_vector_wrapper(tiny_model, ref_tiny, tokenizer):
    from chatenv import rollout

    ref = CountingReference(ref_tiny, tokenizer)
    policy = CountingPolicy(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 5, "seed": 3}
    )
    venv = VectorRefLogProbs(make_vector("sync", n=2), ref)
    td = rollout(venv, policy, episodes=3, seed=0)
    venv.close()
    # one reference forward per policy round (placeholder-only steps score nothing), each reply scored once
    assert ref.calls == policy.calls and ref.scored == td.batch_size[0]
    assert td["next", "done"].sum() == 3
    tokens = td["tokens"]
    for k in range(td.batch_size[0]):
        prompt, resp = tokens.unpadded("prompt")[k].tolist(), tokens.unpadded("response")[k].tolist()
        p = reference_log_probs(tiny_model, prompt + resp)[len(prompt) :]
        q = reference_log_probs(ref_tiny, prompt + resp)[len(prompt) :]
        assert np.allclose(td["ref_log_probs"].unpadded("response")[k].numpy(), q.numpy(), atol=1e-4)
        expected = td["next", "task_reward"][k, 0] - 0.1 * (p - q).sum()
        assert td["next", "reward"][k, 0].item() == pytest.approx(expected.item(), abs=1e-3)
