"""TorchRL integration: compact env specs, GRPO batches from rollouts, and GRPOLoss training through our wrapper."""

import math
import statistics

import gymnasium as gym
import pytest
import torch
from conftest import make_tiny_llama
from helpers import reference_log_probs

import chatenv

torchrl = pytest.importorskip("torchrl")

from torchrl.data import Categorical, NonTensor, OneHot  # noqa: E402
from torchrl.objectives.llm import GRPOLoss, MCAdvantage  # noqa: E402

from chatenv.integrations.torchrl import grpo_actor, grpo_batch, gym_env, register  # noqa: E402
from chatenv.rollout.credit import group_advantages  # noqa: E402
from wrappers.policies import TransformersWrapper  # noqa: E402

REPLY = "<answer>none</answer><|im_end|>"  # never the right answer: the episode goes on


@pytest.fixture(scope="module")
def model():
    """A fresh tiny model: these tests put gradients on it."""
    return make_tiny_llama(0)


@pytest.fixture(scope="module")
def policy(model, tokenizer):
    return TransformersWrapper(model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 6})


@pytest.fixture(scope="module")
def rollout(policy, tokenizer):
    """Two-turn episodes in groups of 2, with rewards made to differ within groups."""
    envs = [gym.make("chatenv/Arithmetic-v0", input_mode="tokens", max_turns=2, tokenizer=tokenizer) for _ in range(2)]
    td = chatenv.rollout(envs, policy, episodes=4, seed=0, group_size=2)
    n = td.batch_size[0]
    td["next", "reward"] = (torch.arange(n, dtype=torch.float32) * 0.7 % 2).unsqueeze(-1)
    return td


# --------------------------------------------------------------------------------------------- env specs


def test_gym_env_token_specs_are_compact_and_steps_keep_ids(tokenizer):
    register()
    register()  # idempotent
    env = gym_env("chatenv/Arithmetic-v0", input_mode="tokens", max_turns=2, tokenizer=tokenizer)
    obs_spec, act_spec = env.observation_spec["observation"], env.action_spec
    for spec in (obs_spec, act_spec):
        assert isinstance(spec, Categorical) and not isinstance(spec, OneHot)
        assert spec.shape == (-1,) and spec.dtype == torch.int64 and spec.space.n == len(tokenizer)
    td = env.reset()
    obs = td["observation"]
    assert obs.dtype == torch.int64 and obs.ndim == 1
    reply = torch.tensor(tokenizer.encode(REPLY))
    td["action"] = reply
    out = env.step(td)
    nxt = out["next", "observation"]
    # token-in/token-out: the next observation is the old ids + the reply verbatim + the env's new tokens
    assert torch.equal(nxt[: len(obs)], obs) and torch.equal(nxt[len(obs) : len(obs) + len(reply)], reply)
    assert tokenizer.decode(nxt[-8:]).endswith("<|im_start|>assistant\n")
    assert out["next", "reward"].shape == (1,) and not out["next", "done"].item()


def test_gym_env_chat_and_text_specs(tokenizer):
    env = gym_env("chatenv/Arithmetic-v0", input_mode="history", max_turns=1, tokenizer=tokenizer)
    assert isinstance(env.observation_spec["observation"], NonTensor)
    assert isinstance(env.action_spec, NonTensor)
    td = env.reset()
    assert td["observation"][-1]["role"] == "user"
    td["action"] = "<answer>none</answer>"
    out = env.step(td)
    # the reply is in the chat (followed by feedback unless it happened to be right), and the one turn is over
    replies = [m for m in out["next", "observation"] if m["role"] == "assistant"]
    assert replies == [{"role": "assistant", "content": "<answer>none</answer>"}]
    assert out["next", "done"].item()
    text = gym_env(gym.make("chatenv/Arithmetic-v0", input_mode="text", tokenizer=tokenizer))
    assert isinstance(text.observation_spec["observation"], NonTensor)
    assert text.reset()["observation"].endswith("<|im_start|>assistant\n")


def test_gym_env_token_level_env_takes_categorical_ids(tokenizer):
    env = gym_env("chatenv/TokenArithmetic-v0", tokenizer=tokenizer)
    assert isinstance(env.action_spec, Categorical) and not isinstance(env.action_spec, OneHot)
    assert env.action_spec.shape == ()
    td = env.reset()
    start = td["observation"]
    for i in tokenizer.encode(REPLY):
        td["action"] = torch.tensor(i)
        out = env.step(td)
        td = out["next"]
    assert td["observation"][len(start) :].tolist()[: len(tokenizer.encode(REPLY))] == tokenizer.encode(REPLY)


# --------------------------------------------------------------------------------------------- GRPO batches


def test_grpo_batch_shapes_and_group_normalised_advantages(rollout):
    batch = grpo_batch(rollout)
    view = chatenv.episodes(rollout)
    e = view.batch_size[0]
    assert batch["next", "reward"].shape == (e, 1, 1) and batch["advantage"].shape == (e, 1, 1)
    assert batch["next", "done"].shape == (e, 1) and batch["next", "done"].all()
    assert batch["tokens"].padded and torch.equal(batch["group"], view["group"])
    # independently: (r - mean) / stdev within each group, over the episodes' summed turn rewards
    rewards = [sum(rollout["next", "reward"][rollout["episode"] == ep].flatten().tolist()) for ep in range(e)]
    groups = view["group"].tolist()
    expected = []
    for g, r in zip(groups, rewards):
        members = [x for h, x in zip(groups, rewards) if h == g]
        expected.append((r - statistics.mean(members)) / max(statistics.stdev(members), 1e-6))
    assert torch.allclose(batch["advantage"].flatten(), torch.tensor(expected), atol=1e-5)
    assert any(abs(a) > 0.1 for a in expected)
    # TorchRL's MCAdvantage, grouping by our group column, computes the same values
    out = MCAdvantage(grpo_size=2, prompt_key="group").inv(grpo_batch(rollout, advantage=False))
    by_episode = dict(zip(out["episode"].tolist(), out["advantage"].flatten().tolist()))
    assert [by_episode[ep] for ep in view["episode"].tolist()] == pytest.approx(expected, abs=1e-5)


def test_group_advantages_of_equal_rewards_are_zero():
    adv = group_advantages(torch.tensor([2.0, 2.0, 1.0, 3.0]), torch.tensor([5, 5, 7, 7]), eps=1e-6, clamp=True)
    assert adv.tolist() == pytest.approx([0.0, 0.0, -math.sqrt(0.5), math.sqrt(0.5)])


# --------------------------------------------------------------------------------------------- training


def test_grpo_loss_backward_gives_gradients_through_the_wrapper(rollout, policy, model):
    batch = grpo_batch(rollout)
    loss_fn = GRPOLoss(actor_network=grpo_actor(policy), masking_strategy="rlhf", entropy_bonus=False)
    model.zero_grad()
    out = loss_fn(batch)
    out.loss_objective.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert grads["lm_head.weight"] is not None and grads["lm_head.weight"].abs().sum() > 0
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0
    # the loss's current log-probs are the generation log-probs: ratio 1, no drift
    assert abs(out.kl_approx.item()) < 1e-5 and out.ESS.item() == pytest.approx(1.0, abs=1e-4)
    model.zero_grad()


def test_differentiable_log_probs_equal_no_grad_and_reference(rollout, policy, model):
    batch = grpo_batch(rollout)
    actor = grpo_actor(policy)
    assert actor.requires_grad and actor.model is model and not policy.requires_grad
    dist = actor.get_dist(batch, logits_key="logits")
    full = batch["tokens"].full
    lp = dist.log_prob(full)
    assert lp.requires_grad and torch.equal(dist.mask, batch["masks"].all_assistant_mask)
    plain = policy.get_new_version(generate=False).log_prob(batch)["log_probs"].full
    assert not plain.requires_grad
    m = dist.mask
    assert (lp[m] - plain[m]).abs().max() < 1e-5
    scored = actor(batch.copy())["log_probs"].full
    assert scored.requires_grad and (scored[m] - plain[m]).abs().max() < 1e-5
    for b, seq in enumerate(batch["tokens"].full_sequences()):
        ref = reference_log_probs(model, seq.tolist())
        mine = lp[b][batch["tokens"].attention_mask()[b]]
        keep = batch["masks"].unpadded()[b]
        assert (mine[keep] - ref[keep]).abs().max() < 1e-5


def test_replay_buffer_samples_stay_aligned(rollout, policy):
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    batch = grpo_batch(rollout)
    buffer = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    buffer.extend(batch)
    sample = buffer.sample()
    dist = grpo_actor(policy)._get_rlhf_dist(sample)
    m = dist.mask
    assert torch.equal(m, sample["masks"].all_assistant_mask)
    gen = sample["log_probs"].full
    assert (dist.log_prob(sample["tokens"].full)[m] - gen[m]).abs().max() < 1e-4


# --------------------------------------------------------------------------------------------- bad input


def test_bad_input_gets_clear_errors(policy, tokenizer, rollout):
    envs = [gym.make("chatenv/Arithmetic-v0", input_mode="tokens", max_turns=1, tokenizer=tokenizer)]
    plain = chatenv.rollout(envs, policy, episodes=2, seed=0)
    with pytest.raises(ValueError, match=r"no 'group' column.*group_size=G"):
        grpo_batch(plain)
    alone = chatenv.episodes(rollout)
    alone["group"] = torch.arange(alone.batch_size[0])  # every episode a group of its own
    with pytest.raises(ValueError, match="at least 2 per group"):
        grpo_batch(alone)
    with pytest.raises(TypeError, match="TensorDict"):
        grpo_batch({"tokens": 1})
    with pytest.raises(ValueError, match="chatenv.rollout"):
        grpo_batch(rollout.exclude("episode"))
    two_turns = [gym.make("chatenv/Arithmetic-v0", input_mode="tokens", max_turns=2, tokenizer=tokenizer)]
    part = chatenv.rollout(two_turns, policy, steps=1, seed=0)
    part["group"] = torch.zeros(part.batch_size[0], dtype=torch.long)
    with pytest.raises(ValueError, match="did not finish"):
        grpo_batch(part)
    with pytest.raises(TypeError, match="env id"):
        gym_env(42)
    with pytest.raises(TypeError, match="policy wrapper"):
        grpo_actor(object())


def test_bad_get_dist_options_and_nested_batches(policy, rollout):
    actor = grpo_actor(policy)
    batch = grpo_batch(rollout)
    with pytest.raises(ValueError, match="padded"):
        actor.get_dist(batch, as_nested_tensor=True)
    with pytest.raises(TypeError, match="unknown keyword"):
        actor.get_dist(batch, logit_key="logits")
    with pytest.raises(ValueError, match="not both"):
        actor.get_dist(batch, "assistant", mask_key=("masks", "all_assistant_mask"))
    with pytest.raises(ValueError, match="padding_side"):
        actor.get_dist(batch, padding_side="middle")
    with pytest.raises(TypeError, match="requires_grad must be True or False"):
        policy.get_new_version(requires_grad="yes")
    nested = chatenv.episodes(rollout)
    nested.set("tokens", nested["tokens"].to_nested())
    nested["advantage"] = torch.zeros(nested.batch_size[0], 1, 1)
    with pytest.raises(ValueError, match="padded containers"):
        GRPOLoss(actor_network=actor, masking_strategy="rlhf")(nested)


@pytest.mark.slow
def test_get_dist_layouts(policy, rollout):
    actor = grpo_actor(policy)
    batch = grpo_batch(rollout)
    base = actor.get_dist(batch, "attention")
    by_key = actor.get_dist(batch, mask_key=("masks", "all_assistant_mask"))
    assert torch.equal(by_key.mask, batch["masks"].all_assistant_mask)
    attention = batch["tokens"].attention_mask()
    for side in ("left", "right"):
        dist = actor.get_dist(batch, "attention", padding_side=side)
        for b in range(attention.shape[0]):
            real = dist.mask[b].nonzero().flatten()
            assert torch.equal(dist.logits[b, real], base.logits[b, base.mask[b]])
        lengths = attention.sum(-1)
        first_real = dist.mask.float().argmax(-1)
        expected = attention.shape[-1] - lengths + 1 if side == "left" else torch.ones_like(lengths)
        assert torch.equal(first_real, expected)


def test_grpo_batch_takes_a_branch_rollout(policy, tokenizer):
    from chatenv.rollout import branch_rollout

    env = chatenv.ChatEnv("arithmetic", input_mode="tokens", max_turns=3, tokenizer=tokenizer)
    env.reset(seed=0)
    env.step(tokenizer.encode("<answer>0</answer>") + [2])  # a wrong first answer: the episode goes on
    td = branch_rollout(env, policy, n=3)
    td["next", "reward"] = (td["branch"].float() * 0.5).unsqueeze(-1)  # rewards that differ between branches
    batch = grpo_batch(td)
    assert batch.batch_size[0] == 3 and batch["group"].tolist() == [0, 0, 0]
    prefix = env.unwrapped.token_ids.tolist()
    assert all(row.tolist()[: len(prefix)] == prefix for row in batch["tokens"].unpadded("full"))
    returns = batch["next", "reward"].reshape(-1)
    centered = returns - returns.mean()
    assert torch.allclose(batch["advantage"].reshape(-1), centered / (returns.std() + 1e-6), atol=1e-4)
