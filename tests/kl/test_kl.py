"""RefLogProbs / KLPenalty on the turn-level env, against separate forward passes of both models."""

import numpy as np
import pytest
import torch
from helpers import reference_log_probs

from chatenv import ChatEnv, ScoredAction
from wrappers.kl import AdaptiveKLController, KLPenalty, ReferenceModel, RefLogProbs, kl_estimate
from wrappers.policies import TransformersWrapper


def play(env, policy, turns=3):
    obs, _ = env.reset(seed=0)
    steps = []
    for _ in range(turns):
        ids, out = policy.act(obs)
        lp = out["log_probs"].unpadded("response")[0].numpy()
        prompt = obs.tolist()
        obs, reward, terminated, truncated, info = env.step(ScoredAction(ids, lp))
        steps.append((prompt, ids.tolist(), reward, info))
        if terminated or truncated:
            break
    return steps


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_per_token_against_separate_forwards(estimator, tiny_model, ref_tiny, tokenizer):
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 8, "seed": 2}
    )
    coef = 0.05
    env = KLPenalty(
        ChatEnv("arithmetic", input_mode="tokens"),
        coef,
        estimator=estimator,
        ref_model=ReferenceModel(ref_tiny, tokenizer),
    )
    steps = play(env, policy)
    assert steps
    for prompt, ids, reward, info in steps:
        seq = prompt + ids
        p = reference_log_probs(tiny_model, seq)[len(prompt) :]
        q = reference_log_probs(ref_tiny, seq)[len(prompt) :]
        assert np.allclose(info["ref_log_probs"], q.numpy(), atol=1e-4)
        expected = {"k1": p - q, "k2": 0.5 * (p - q) ** 2, "k3": torch.exp(q - p) - 1 - (q - p)}[estimator]
        assert np.allclose(info["kl"], expected.numpy(), atol=2e-4)
        assert reward == pytest.approx(info["task_reward"] - coef * float(expected.sum()), abs=1e-3)
        tr = info["token_rewards"]
        assert np.allclose(tr[:-1], -coef * expected.numpy()[:-1], atol=1e-4)
        assert tr[-1] == pytest.approx(-coef * float(expected[-1]) + info["task_reward"], abs=1e-4)


def test_same_model_gives_zero_kl_and_controller_updates(tiny_model, tokenizer):
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 6, "seed": 0}
    )
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10)
    env = KLPenalty(
        RefLogProbs(ChatEnv("arithmetic", input_mode="tokens"), ReferenceModel(tiny_model, tokenizer)), kl=ctl
    )
    steps = play(env, policy, turns=2)
    for _, _, reward, info in steps:
        assert np.abs(info["kl"]).max() < 1e-4 and reward == pytest.approx(info["task_reward"], abs=1e-3)
    # KL ~0 is below target: the coefficient shrinks by the clipped error each step
    assert ctl.coef == pytest.approx(0.2 * (1 - 0.2 / 10) ** len(steps))


def test_kl_penalty_errors(tiny_model, tokenizer):
    with pytest.raises(ValueError, match="RefLogProbs"):
        KLPenalty(ChatEnv("arithmetic", input_mode="tokens"), 0.1)
    env = KLPenalty(ChatEnv("arithmetic", input_mode="tokens"), 0.1, ref_model=ReferenceModel(tiny_model, tokenizer))
    obs, _ = env.reset(seed=0)
    with pytest.raises(ValueError, match="generation log-probs"):
        env.step(np.array([5, 2]))
    with pytest.raises(ValueError, match="estimator"):
        KLPenalty(
            ChatEnv("arithmetic", input_mode="tokens"),
            0.1,
            estimator="k4",
            ref_model=ReferenceModel(tiny_model, tokenizer),
        )
    with pytest.raises(TypeError, match="takes kl=... now, not controller="):
        KLPenalty(
            ChatEnv("arithmetic"), controller=AdaptiveKLController(), ref_model=ReferenceModel(tiny_model, tokenizer)
        )
    assert torch.allclose(kl_estimate(torch.tensor([0.0]), torch.tensor([0.0]), "k3"), torch.tensor([0.0]))


class CountingReference(ReferenceModel):
    """The real reference model, counting its forward calls."""

    calls = 0

    def log_probs(self, sequences):
        self.calls += 1
        return super().log_probs(sequences)


def test_rollout_one_reference_forward_per_round(tiny_model, ref_tiny, tokenizer):
    from chatenv import rollout

    ref = CountingReference(ref_tiny, tokenizer)
    envs = [KLPenalty(ChatEnv("arithmetic", input_mode="tokens"), 0.1, ref_model=ref) for _ in range(3)]
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 6, "seed": 4}
    )
    td = rollout(envs, policy, episodes=3, seed=0)
    rounds = int(td["turn"].max()) + 1
    assert ref.calls == rounds  # batched: one forward per round, not one per env and step
    n = td.batch_size[0]
    tokens = td["tokens"]
    for k in range(n):
        prompt, resp = tokens.unpadded("prompt")[k].tolist(), tokens.unpadded("response")[k].tolist()
        p = reference_log_probs(tiny_model, prompt + resp)[len(prompt) :]
        q = reference_log_probs(ref_tiny, prompt + resp)[len(prompt) :]
        assert torch.allclose(td["ref_log_probs"].unpadded("response")[k], q, atol=1e-4)
        assert torch.allclose(td["kl"].unpadded("response")[k], p - q, atol=2e-4)
        expected = td["next", "task_reward"][k, 0] - 0.1 * (p - q).sum()
        assert td["next", "reward"][k, 0].item() == pytest.approx(expected.item(), abs=1e-3)
    assert torch.isnan(td["kl"].unpadded("prompt")[0]).all()


@pytest.mark.slow
@pytest.mark.parametrize("pad", [True, False])
def test_batch_transforms_on_rollout_data(pad, tiny_model, ref_tiny, tokenizer):
    from chatenv import rollout
    from wrappers.kl import KLRewardTransform

    policy = TransformersWrapper(
        tiny_model,
        tokenizer=tokenizer,
        input_mode="tokens",
        pad_output=pad,
        generate_kwargs={"max_new_tokens": 6, "seed": 5},
    )
    envs = [ChatEnv("arithmetic", input_mode="tokens") for _ in range(2)]
    td = rollout(envs, policy, episodes=2, seed=0)
    task = td["next", "reward"].clone()
    KLRewardTransform(ReferenceModel(ref_tiny, tokenizer), kl=0.1, estimator="k3")(td)
    tokens = td["tokens"]
    rewards = td["next", "reward"]
    for k, seq in enumerate(tokens.full_sequences()):
        seq = seq.tolist()
        n_prompt = int(tokens.prompt_length[k])
        p = reference_log_probs(tiny_model, seq)
        q = reference_log_probs(ref_tiny, seq)
        kl_rows = td["kl_penalty"].full_sequences() if pad else list(td["kl_penalty"].full.unbind())
        kl = kl_rows[k]
        expected = torch.exp(q - p) - 1 - (q - p)
        # this turn's generated tokens carry the KL; the prompt (earlier turns included) is not penalised again
        assert torch.allclose(kl[n_prompt:], expected[n_prompt:], atol=2e-4)
        assert (kl[:n_prompt] == 0).all()
        if pad:
            assert rewards.shape == (*tokens.full.shape, 1)
            r = rewards[k, :, 0][tokens.attention_mask()[k]]
        else:
            r = rewards.unbind()[k][:, 0]
        expected_r = -0.1 * torch.where(torch.arange(len(seq)) >= n_prompt, expected, torch.zeros_like(expected))
        expected_r[len(seq) - 1] += task[k, 0]
        assert torch.allclose(r, expected_r, atol=1e-4)
        assert td["next", "task_reward"][k, 0] == task[k, 0]


@pytest.mark.parametrize("mode", ["history", "text", "tokens"])
def test_kl_penalty_in_every_input_mode(mode, tiny_model, ref_tiny, tokenizer):
    from chatenv import rollout

    ref = ReferenceModel(ref_tiny, tokenizer)
    envs = [KLPenalty(ChatEnv("arithmetic", input_mode=mode), 0.2, ref_model=ref) for _ in range(2)]
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode=mode, generate_kwargs={"max_new_tokens": 5, "seed": 1}
    )
    td = rollout(envs, policy, episodes=2, seed=0)
    kl_sum = torch.nan_to_num(td["kl"].full, nan=0.0).sum(-1)
    assert torch.allclose(td["next", "reward"][:, 0], td["next", "task_reward"][:, 0] - 0.2 * kl_sum, atol=1e-3)
    assert (kl_sum != 0).all()


def test_kl_computation_options_and_errors(tiny_model, ref_tiny, tokenizer):
    from chatenv import rollout
    from wrappers.kl import KLComputation, RetrieveLogProb

    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 5, "seed": 1}
    )
    td = rollout(ChatEnv("arithmetic", input_mode="tokens"), policy, episodes=1, seed=0)
    RetrieveLogProb(ReferenceModel(ref_tiny, tokenizer))(td)
    # assistant_only=False still counts only positions with generation log-probs (this turn's tokens)
    out = KLComputation(0.1, assistant_only=False, add_to_reward=False)(td.clone())
    assert torch.equal(out["kl_penalty"].full != 0, ~torch.isnan(td["log_probs"].full) & (out["kl_penalty"].full != 0))
    assert ("next", "task_reward") not in out.keys(include_nested=True)
    del td["next", "reward"]
    with pytest.raises(KeyError, match="task reward"):
        KLComputation(0.1)(td)
    with pytest.raises(ValueError, match="estimator"):
        KLComputation(0.1, estimator="k9")


class CountingPolicy(TransformersWrapper):
    """The real policy, counting its (batched) calls."""

    calls = 0

    def forward(self, tensordict):
        self.calls += 1
        return super().forward(tensordict)


def _kl_env():
    from chatenv import ChatEnv as _ChatEnv
    from wrappers.kl import KLPenalty as _KLPenalty
    from wrappers.kl import RefLogProbs as _RefLogProbs

    # the reference log-probs come with the actions (computed by the rollout in the main process)
    return _KLPenalty(_RefLogProbs(_ChatEnv("arithmetic", input_mode="tokens")), 0.1)


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_vector_envs_get_one_batched_reference_forward(mode, tiny_model, ref_tiny, tokenizer):
    import gymnasium as gym

    from chatenv import rollout

    venv = gym.vector.SyncVectorEnv([_kl_env] * 2) if mode == "sync" else gym.vector.AsyncVectorEnv([_kl_env] * 2)
    ref = CountingReference(ref_tiny, tokenizer)
    policy = CountingPolicy(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 5, "seed": 3}
    )
    td = rollout(venv, policy, episodes=3, seed=0, ref_model=ref)
    venv.close()
    assert ref.calls == policy.calls  # one batched reference forward per policy call (round)
    assert td["next", "done"].sum() == 3
    for k, seq in enumerate(td["tokens"].full_sequences()):
        n = int(td["tokens"].prompt_length[k])
        q = reference_log_probs(ref_tiny, seq.tolist())[n:]
        assert torch.allclose(td["ref_log_probs"].unpadded("response")[k], q, atol=1e-4)
    # without a model anywhere, a step cannot get its reference log-probs: a clear error, env unchanged
    env = _kl_env()
    obs, _ = env.reset(seed=0)
    with pytest.raises(ValueError, match="no reference model"):
        env.step(ScoredAction(np.array([5, 2]), np.zeros(2, np.float32)))
    assert np.array_equal(env.unwrapped.token_ids, obs)


def test_reference_at_the_policy_temperature_gives_zero_self_kl(tiny_model, tokenizer):
    policy = TransformersWrapper(
        tiny_model,
        tokenizer=tokenizer,
        input_mode="tokens",
        generate_kwargs={"max_new_tokens": 6, "temperature": 0.7, "seed": 0},
    )
    matched = KLPenalty(
        ChatEnv("arithmetic", input_mode="tokens"),
        0.1,
        ref_model=ReferenceModel(tiny_model, tokenizer, temperature=0.7),
    )
    steps = play(matched, policy, turns=1)
    assert np.abs(steps[0][3]["kl"]).max() < 1e-4
    raw_ref = KLPenalty(
        ChatEnv("arithmetic", input_mode="tokens"), 0.1, ref_model=ReferenceModel(tiny_model, tokenizer)
    )
    steps = play(raw_ref, policy, turns=1)
    assert np.abs(steps[0][3]["kl"]).max() > 1e-3  # tempered policy vs untempered reference: not the same distribution


def test_vector_env_infos_with_replies_of_different_lengths(tokenizer):
    import gymnasium as gym

    venv = gym.vector.SyncVectorEnv([_kl_env] * 2)
    venv.reset(seed=0)
    short, long = (
        tokenizer.encode("<answer>1</answer>") + [2],
        tokenizer.encode("I think it is <answer>2</answer>") + [2],
    )
    actions = tuple(
        ScoredAction(np.array(ids), np.full(len(ids), -1.0), np.full(len(ids), -1.5)) for ids in (short, long)
    )
    _, reward, _, _, info = venv.step(actions)
    assert [len(k) for k in info["kl"]] == [len(short), len(long)]
    assert np.allclose(reward, info["task_reward"] - 0.1 * np.array([0.5 * len(short), 0.5 * len(long)]))
    venv.close()
