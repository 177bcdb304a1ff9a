"""Async rollouts (continuous batching), policy versions, weight updates mid-rollout and staleness."""

import math
import threading
import time

import gymnasium as gym
import pytest
import torch
from helpers import async_vllm_policy

from chatenv import ChatEnv, Task, TaskResponse, TaskStart, rollout
from chatenv.rollout import Batcher, episodes
from wrappers.kl import KLPenalty, ReferenceModel, RefLogProbs
from wrappers.policies import TransformersWrapper


class Count(Task):
    """A chat of ``turns`` turns; its ``gate`` respond call (if any) waits for ``gate_event`` first."""

    def __init__(self, turns, gate=None, gate_event=None, delay=0.0):
        self.turns, self.gate, self.gate_event, self.delay = turns, gate, gate_event, delay
        self.calls, self.waited = 0, None

    def reset(self, rng):
        return TaskStart([{"role": "user", "content": "Count with me."}], {"n": 0})

    def respond(self, messages, state):
        self.calls += 1
        if self.calls == self.gate:
            self.waited = self.gate_event.wait(timeout=60)
        time.sleep(self.delay)
        state["n"] += 1
        return TaskResponse(0.25 * state["n"], state["n"] >= self.turns, [{"role": "user", "content": "More."}])


class Boom(Count):
    def respond(self, messages, state):
        if self.calls == 2:
            raise RuntimeError("the judge is down")
        return super().respond(messages, state)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    # its own copy: these tests load new weights into it
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture
def policy(model, tokenizer, tiny_model):
    model.load_state_dict(tiny_model.state_dict())
    return TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 12, "temperature": 0}
    )


def _envs(tokenizer, n=3, **kwargs):
    return [ChatEnv("arithmetic", input_mode="tokens", tokenizer=tokenizer, max_turns=3, **kwargs) for _ in range(n)]


def _same_episodes(a, b):
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    assert a.batch_size == b.batch_size
    for key in ("episode", "turn", ("next", "done"), ("next", "terminated"), "policy_version"):
        assert torch.equal(a[key], b[key]), key
    # KL-shaped rewards: the reference scores other batches (other padding) in the two modes
    assert torch.allclose(a["next", "reward"], b["next", "reward"], atol=1e-5)
    full = [x.tolist() for x in a["tokens"].unpadded("full")]
    assert full == [x.tolist() for x in b["tokens"].unpadded("full")]
    for x, y in zip(a["masks"].unpadded(), b["masks"].unpadded()):
        assert torch.equal(x, y)
    for x, y in zip(a["log_probs"].unpadded("response"), b["log_probs"].unpadded("response")):
        assert (x - y).abs().max() < 1e-4


def test_async_gives_the_sync_episodes_and_layout(policy, tokenizer):
    # group_size=1 plans every episode's reset (episode k: seed + k), whichever env runs it
    sync = rollout(_envs(tokenizer), policy, episodes=5, seed=3, group_size=1)
    fast = rollout(_envs(tokenizer), policy, episodes=5, seed=3, group_size=1, mode="async")
    _same_episodes(sync, fast)
    assert fast["episode"].tolist() == sorted(fast["episode"].tolist())  # by episode, then turn
    assert episodes(fast).batch_size == (5,)
    # generation-time log-probs equal a scoring pass over the same ids
    scorer = policy.get_new_version(generate=False)
    seqs = [s.tolist() for s in fast["tokens"].unpadded("full")]
    prompts = [len(p) for p in fast["tokens"].unpadded("prompt")]
    for seq, n, lp in zip(seqs, prompts, fast["log_probs"].unpadded("response")):
        assert (scorer.score_sequences([seq])[0][n:] - lp).abs().max() < 1e-4
    assert max(policy._batcher.batches) > 1  # requests that were ready together ran as one batch
    # steps=: exactly that many transitions, as in the sync rollout
    assert rollout(_envs(tokenizer), policy, steps=4, seed=0, mode="async").batch_size == (4,)


def test_a_slow_reward_does_not_stall_the_other_envs(policy, tokenizer):
    # env 0's first reward waits until env 1 has stepped three turns: a turn barrier would deadlock here
    released = threading.Event()
    slow = Count(1, gate=1, gate_event=released)
    fast = Count(4)
    envs = [
        ChatEnv(slow, input_mode="tokens", tokenizer=tokenizer),
        ChatEnv(fast, input_mode="tokens", tokenizer=tokenizer),
    ]
    original = fast.respond

    def respond(messages, state):
        out = original(messages, state)
        if fast.calls == 3:
            released.set()
        return out

    fast.respond = respond
    td = rollout(envs, policy, episodes=2, seed=0, mode="async")
    assert slow.waited is True  # released by env 1's third step, not by the timeout
    assert sorted(zip(td["env_index"].tolist(), td["turn"].tolist())) == [(0, 0), (1, 0), (1, 1), (1, 2), (1, 3)]


def test_versions_per_turn_across_a_weight_update(policy, tokenizer, ref_tiny):
    # env 0's one-turn episode ends first; its on_episode loads new weights while env 1's episode is in flight
    updated = threading.Event()
    long_task = Count(4, gate=2, gate_event=updated)
    envs = [
        ChatEnv(Count(1), input_mode="tokens", tokenizer=tokenizer),
        ChatEnv(long_task, input_mode="tokens", tokenizer=tokenizer),
    ]
    seen = []

    def on_episode(td):
        seen.append(td["policy_version"].tolist())
        if len(seen) == 1:
            # env 1's first reply is generated (its respond ran) before the update, however loaded the machine
            deadline = time.monotonic() + 60
            while long_task.calls < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            assert policy.update_weights(ref_tiny.state_dict()) == 1
            updated.set()

    td = rollout(envs, policy, episodes=2, seed=0, mode="async", on_episode=on_episode)
    assert policy.version == 1 and seen[0] == [0]
    long = td[td["env_index"] == 1]["policy_version"].tolist()
    # in flight across the update: turn 0 on the old weights, turns 2 and 3 on the new ones
    assert long[0] == 0 and long[2:] == [1, 1] and long == sorted(long)
    # the new weights generated them: their log-probs are the new model's
    scorer = TransformersWrapper(ref_tiny, tokenizer=tokenizer, input_mode="tokens", generate=False)
    row = td[(td["env_index"] == 1) & (td["turn"] == 3)]
    seq, n = row["tokens"].unpadded("full")[0].tolist(), len(row["tokens"].unpadded("prompt")[0])
    assert (scorer.score_sequences([seq])[0][n:] - row["log_probs"].unpadded("response")[0]).abs().max() < 1e-4


def test_staleness_flags_or_drops(policy, tokenizer, ref_tiny):
    def update(td):
        policy.update_weights(ref_tiny.state_dict())

    # one episode per env at a time (in_flight=None): the updates fall between known episodes
    kwargs = {"seed": 0, "mode": "async", "on_episode": update, "in_flight": None}
    flagged = rollout(_envs(tokenizer, 2), policy, episodes=4, max_staleness=1, **kwargs)
    versions = flagged["policy_version"]
    assert policy.version == 4 and versions.min() == 0
    assert torch.equal(flagged["stale"], policy.version - versions > 1) and flagged["stale"].any()
    # two turns each; four updates in all: episode 3 starts after the second (kept), episode 0 ran before any
    envs = [ChatEnv(Count(2), input_mode="tokens", tokenizer=tokenizer) for _ in range(2)]
    dropped = rollout(
        envs, policy, episodes=4, seed=0, mode="async", on_episode=update, max_staleness=2, stale="drop", in_flight=None
    )
    assert 2 <= dropped.batch_size[0] < 8 and "stale" not in dropped.keys()
    assert (policy.version - dropped["policy_version"] <= 2).all() and 0 not in dropped["episode"].tolist()
    policy.update_weights(ref_tiny.state_dict())  # everything generated before is now one version behind
    with pytest.raises(ValueError, match="stale must be one of"):
        rollout(_envs(tokenizer, 1), policy, steps=1, max_staleness=0, stale="keep")
    with pytest.raises(ValueError, match="max_staleness must be an int"):
        rollout(_envs(tokenizer, 1), policy, steps=1, max_staleness=-1)


def test_kl_wrappers_async(policy, tokenizer, ref_tiny):
    ref = ReferenceModel(ref_tiny, tokenizer)

    def envs():
        return [KLPenalty(RefLogProbs(e, ref), 0.1) for e in _envs(tokenizer)]

    sync = rollout(envs(), policy, episodes=3, seed=1)
    fast = rollout(envs(), policy, episodes=3, seed=1, mode="async")
    _same_episodes(sync, fast)
    for key in ("ref_log_probs", "kl"):
        for x, y in zip(sync[key].unpadded("response"), fast[key].unpadded("response")):
            assert torch.isfinite(y).all() and (x - y).abs().max() < 1e-4
    assert torch.allclose(sync["next", "task_reward"], fast["next", "task_reward"])


def test_a_failing_env_keeps_what_was_collected(policy, tokenizer):
    envs = [ChatEnv(Count(3), input_mode="tokens", tokenizer=tokenizer), ChatEnv(Boom(3), input_mode="tokens")]
    with pytest.raises(RuntimeError, match="the judge is down") as info:
        rollout(envs, policy, episodes=4, seed=0, mode="async", in_flight=None)
    err = info.value
    assert err.env_index == 1
    kept = err.partial
    assert (kept[kept["env_index"] == 1]["turn"].tolist()) == [0, 1]  # its third step failed
    assert kept.batch_size[0] >= 3 and "policy_version" in kept.keys()
    assert any("err.partial" in note for note in getattr(err, "__notes__", []))


def test_bad_input_is_refused(policy, tokenizer, tiny_model):
    with pytest.raises(ValueError, match="mode must be 'sync' or 'async'"):
        rollout(_envs(tokenizer, 1), policy, steps=1, mode="fast")
    venv = gym.make_vec("chatenv/Arithmetic-v0", num_envs=2, input_mode="tokens")
    with pytest.raises(ValueError, match="Pass a list of envs"):
        rollout(venv, policy, steps=2, mode="async")
    venv.close()

    class Plain:
        generate, num_samples, input_mode = True, None, "tokens"

    with pytest.raises(TypeError, match="submit"):
        rollout(_envs(tokenizer, 1), Plain(), steps=1, mode="async")
    with pytest.raises(KeyError, match="no parameters named"):
        policy.update_weights({"not.a.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        policy.update_weights({"lm_head.weight": torch.zeros(3, 3)})
    with pytest.raises(TypeError, match="state dict"):
        policy.update_weights([1, 2])
    assert policy.version == 0
    assert policy.get_new_version(generate=False).version == 0
    sibling = policy.get_new_version(generate_kwargs={"max_new_tokens": 4})
    sibling.update_weights(tiny_model.state_dict())
    assert policy.version == 1  # policies on one model share its version


def test_batcher_batches_and_fails_every_item_of_a_failing_batch():
    gate = threading.Event()

    def run(items):
        gate.wait(5)
        if "bad" in items:
            raise ValueError("bad item")
        return [x * 2 for x in items]

    b = Batcher(run, window=0.05)
    futures = [b.submit(i) for i in range(4)]
    gate.set()
    assert [f.result(5) for f in futures] == [0, 2, 4, 6] and b.batches[0] >= 1 and sum(b.batches) == 4
    bad = [b.submit("bad"), b.submit(1)]
    for f in bad:
        with pytest.raises(ValueError, match="bad item"):
            f.result(5)
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        b.submit(1)
    with pytest.raises(ValueError, match="max_batch"):
        Batcher(run, max_batch=0)


def test_agenerate(policy, tokenizer):
    import asyncio

    env = _envs(tokenizer, 1)[0]
    obs, _ = env.reset(seed=0)
    _, td = policy.act(obs, token_views=env.token_view())
    from chatenv.modes import get_mode

    inp = get_mode("tokens").policy_input(
        [obs], input_key=policy.input_key, pad_token_id=policy.pad_token_id, token_views=[env.token_view()]
    )
    out = asyncio.run(policy.agenerate(inp))
    assert out["tokens"].unpadded("response")[0].tolist() == td["tokens"].unpadded("response")[0].tolist()
    assert out["policy_version"].tolist() == [policy.version]
    assert not math.isnan(float(out["log_probs"].unpadded("response")[0][0]))


@pytest.mark.slow
def test_vllm_async_engine(tiny_model_dir, tokenizer, ref_tiny, tiny_model):
    pytest.importorskip("vllm")
    settings = {"max_new_tokens": 10, "min_new_tokens": 3, "temperature": 0}
    policy = async_vllm_policy(tiny_model_dir, input_mode="tokens", generate_kwargs=settings)
    try:
        assert policy.is_async
        # the synchronous rollout (one engine call per round) and the async one (one request per turn) agree
        sync = rollout(_envs(tokenizer), policy, episodes=4, seed=2, group_size=1)
        fast = rollout(_envs(tokenizer), policy, episodes=4, seed=2, group_size=1, mode="async")
        _same_episodes(sync, fast)
        assert all(len(r) >= 3 for r in fast["tokens"].unpadded("response"))
        # new weights in the engine: the version is bumped and the log-probs are the new model's
        scorer = policy.get_new_version(generate=False)
        seq = fast["tokens"].unpadded("full")[0].tolist()
        before = scorer.score_sequences([seq])[0]
        assert policy.update_weights(ref_tiny.state_dict()) == 1 == scorer.version
        after = scorer.score_sequences([seq])[0]
        ref = TransformersWrapper(ref_tiny, tokenizer=tokenizer, generate=False).score_sequences([seq])[0]
        assert (after[1:] - ref[1:]).abs().max() < 1e-3 and (before[1:] - after[1:]).abs().max() > 0.1
        td = rollout(_envs(tokenizer, 2), policy, episodes=2, seed=0, mode="async", max_staleness=0)
        assert td["policy_version"].unique().tolist() == [1] and not td["stale"].any()
    finally:
        policy.shutdown()


class Logged(Task):
    """Two-turn chats that log when each episode starts and each reply is judged (shared by all envs and forks)."""

    def __init__(self):
        self.log, self.lock = [], threading.Lock()

    def reset(self, rng):
        with self.lock:
            self.log.append("reset")
        return TaskStart([{"role": "user", "content": f"Say {int(rng.integers(100))}."}], {"n": 0})

    def respond(self, messages, state):
        with self.lock:
            self.log.append("respond")
        state["n"] += 1
        return TaskResponse(float(state["n"]), state["n"] >= 2, [{"role": "user", "content": "Again."}])


def _started_before_first_reply(log):
    return log.index("respond")


def test_in_flight_starts_episodes_on_forks(policy, tokenizer):
    task = Logged()
    envs = [ChatEnv(task, input_mode="tokens", tokenizer=tokenizer) for _ in range(2)]
    sync = rollout(envs, policy, episodes=6, seed=5, group_size=1)
    task.log.clear()
    fast = rollout(envs, policy, episodes=6, seed=5, group_size=1, mode="async")  # in_flight="auto": 4 at once
    assert _started_before_first_reply(task.log) == 4 and task.log.count("reset") == 6
    _same_episodes(sync, fast)  # planned resets: the same episodes whichever env or fork runs them
    assert set(fast["env_index"].tolist()) == {0, 1}  # forks report the env they were made from
    task.log.clear()
    rollout(envs, policy, episodes=6, seed=5, group_size=1, mode="async", in_flight=None)
    assert _started_before_first_reply(task.log) == 2
    task.log.clear()
    rollout(envs, policy, episodes=6, seed=5, group_size=1, mode="async", in_flight=6)
    assert _started_before_first_reply(task.log) == 6
    task.log.clear()
    rollout(envs, policy, episodes=3, seed=5, mode="async", in_flight=6)  # never more than the episodes asked for
    assert task.log.count("reset") == 3 and _started_before_first_reply(task.log) == 3
    # the envs given are the caller's: they hold their last episode; the forks are closed
    assert all(e.episode is not None for e in envs)


def test_in_flight_refuses_what_it_cannot_do(policy, tokenizer):
    envs = _envs(tokenizer, 2)
    with pytest.raises(ValueError, match="mode='sync' runs one per env"):
        rollout(envs, policy, episodes=4, in_flight=4)
    with pytest.raises(ValueError, match="fewer than the 2 envs given"):
        rollout(envs, policy, episodes=4, mode="async", in_flight=1)
    with pytest.raises(ValueError, match="in_flight must be a positive int"):
        rollout(envs, policy, episodes=4, mode="async", in_flight="many")


class Locked:
    """A per-episode tool object holding a lock: an episode in progress cannot be copied."""

    def __init__(self):
        self.lock = threading.Lock()

    def ping(self) -> str:
        """Answer pong."""
        return "pong"


def test_envs_mid_episode_with_uncopyable_tools_still_get_forks(policy, tokenizer):
    from chatenv.tools import PerEpisode

    task = Logged()
    envs = [ChatEnv(task, input_mode="tokens", tokenizer=tokenizer, tools=[PerEpisode(Locked)]) for _ in range(2)]
    for env in envs:
        env.reset(seed=0)  # mid-episode: chatenv.fork(env) would refuse (the lock); the pool's forks copy no episode
    task.log.clear()
    td = rollout(envs, policy, episodes=4, seed=0, mode="async")
    assert sorted(set(td["episode"].tolist())) == [0, 1, 2, 3] and _started_before_first_reply(task.log) == 4
