"""Forking envs in the middle of an episode: exact, independent copies (real tokenizer, tools, sandbox, KL wrappers)."""

import gc
import resource
import threading

import gymnasium as gym
import numpy as np
import pytest
import torch
from helpers import reference_log_probs

import chatenv
from chatenv import ChatEnv, GuessNumberTask, ScoredAction, TokenEnv
from chatenv.tasks import Task, TaskResponse, TaskStart
from chatenv.tools import PerEpisode
from wrappers.kl import KLPenalty, ReferenceModel, RefLogProbs


def guess(tokenizer, n):
    return tokenizer.encode(f"<answer>{n}</answer>") + [2]


def snapshot(env):
    base = env.unwrapped
    episode = base.episode
    return (
        base.token_ids.tolist(),
        episode.assistant_mask.tolist(),
        base.messages,
        repr(episode.state),
        base.turn,
        list(episode.rewards),
    )


def test_a_fork_is_exact_and_independent(tokenizer):
    env = ChatEnv(GuessNumberTask(low=1, high=100), input_mode="tokens", tokenizer=tokenizer)
    env.reset(seed=3)
    env.step(guess(tokenizer, 50))
    twin = chatenv.fork(env)
    assert snapshot(twin) == snapshot(env)
    # the same actions give the same steps
    for n in (25, 75):
        a, b = env.step(guess(tokenizer, n)), twin.step(guess(tokenizer, n))
        assert np.array_equal(a[0], b[0]) and a[1:4] == b[1:4]
        assert snapshot(twin) == snapshot(env)
    # other actions on one leave the other as it was
    before = snapshot(twin)
    env.step(guess(tokenizer, 10))
    assert snapshot(twin) == before and snapshot(env) != before
    twin.reset(seed=5)
    assert snapshot(env)[4] == 4  # resetting the fork leaves the original episode


def test_forks_of_one_point_branch_apart_and_share_the_prefix(tokenizer):
    env = ChatEnv(GuessNumberTask(low=1, high=100), input_mode="tokens", tokenizer=tokenizer)
    env.reset(seed=1)
    env.step(guess(tokenizer, 50))
    prefix = env.unwrapped.token_ids.tolist()
    branches = [chatenv.fork(env) for _ in range(4)]
    for k, branch in enumerate(branches):
        branch.step(guess(tokenizer, 10 + k))
    views = [b.unwrapped.token_ids.tolist() for b in branches]
    assert all(v[: len(prefix)] == prefix for v in views)  # the shared prefix, verbatim
    assert len({tuple(v) for v in views}) == 4 and env.unwrapped.token_ids.tolist() == prefix


def test_a_token_env_forks_in_the_middle_of_a_reply(tokenizer):
    env = TokenEnv(GuessNumberTask(), tokenizer=tokenizer, max_new_tokens=16)
    env.reset(seed=0)
    ids = guess(tokenizer, 42)
    for t in ids[:3]:
        env.step(t)
    twin = chatenv.fork(env)
    for t in ids[3:]:
        a, b = env.step(t), twin.step(t)
        assert np.array_equal(a[0], b[0]) and a[1:4] == b[1:4]
    assert env.unwrapped.token_ids.tolist() == twin.unwrapped.token_ids.tolist()
    assert env.unwrapped.messages == twin.unwrapped.messages


class Boom(Task):
    """Two turns; a reply saying "boom" makes respond() raise."""

    def reset(self, rng):
        return TaskStart([{"role": "user", "content": "Say something."}], {"said": []})

    def respond(self, messages, state):
        if "boom" in messages[-1]["content"]:
            raise RuntimeError("the task broke")
        state["said"].append(messages[-1]["content"])
        return TaskResponse(1.0, len(state["said"]) >= 2, [{"role": "user", "content": "Again."}])


def test_a_failing_step_on_a_fork_changes_neither(tokenizer):
    env = ChatEnv(Boom(), input_mode="text", tokenizer=tokenizer)
    env.reset(seed=0)
    env.step("hello")
    twin = chatenv.fork(env)
    before = snapshot(env)
    with pytest.raises(RuntimeError, match="the task broke"):
        twin.step("boom")
    assert snapshot(twin) == before == snapshot(env)
    _, reward, terminated, _, _ = twin.step("fine")
    assert reward == 1.0 and terminated and snapshot(env) == before


def test_tool_state_is_copied_with_the_episode(tokenizer):
    from chatenv.tools.sandbox import PythonSandbox, python_tool

    def call(env, code):
        message = {"role": "assistant", "content": "", "tool_calls": [{"name": "python", "arguments": {"code": code}}]}
        return env.step(message)

    with PythonSandbox(workers=1) as sandbox:
        env = ChatEnv(Boom(), input_mode="history", tokenizer=tokenizer, tools=[python_tool(sandbox)])
        env.reset(seed=0)
        call(env, "open('notes.txt', 'w').write('shared')")
        twin = chatenv.fork(env)
        call(twin, "open('notes.txt', 'a').write(' + fork only')")
        call(env, "print(open('notes.txt').read())")
        assert env.unwrapped.messages[-1]["content"] == "[stdout]\nshared"
        call(twin, "print(open('notes.txt').read())")
        assert twin.unwrapped.messages[-1]["content"] == "[stdout]\nshared + fork only"
        original, forked = (e.unwrapped.episode.tools.objects[0].workdir for e in (env, twin))
        assert original != forked
        assert env.unwrapped.episode.tools.stats.calls == 2 and twin.unwrapped.episode.tools.stats.calls == 3
        twin.close()
        assert "shared" in call(env, "print(open('notes.txt').read())")[0][-1]["content"]  # still there
        env.close()


class Locked:
    """A per-episode tool object holding a lock: it cannot be copied as is."""

    def __init__(self):
        self.lock = threading.Lock()

    def ping(self) -> str:
        """Answer pong."""
        return "pong"


def test_a_tool_object_that_cannot_be_copied_refuses_clearly(tokenizer):
    env = ChatEnv(Boom(), input_mode="history", tokenizer=tokenizer, tools=[PerEpisode(Locked)])
    env.reset(seed=0)
    with pytest.raises(TypeError, match=r"the episode's Locked tool object cannot be forked .*__deepcopy__"):
        chatenv.fork(env)
    env.step("still fine")  # the failed fork changed nothing
    with pytest.raises(TypeError, match="takes a chatenv ChatEnv or TokenEnv"):
        chatenv.fork(gym.make("CartPole-v1"))


def test_forks_go_through_gymnasium_and_kl_wrappers(tokenizer, tiny_model, ref_tiny):
    ref = ReferenceModel(ref_tiny, tokenizer)
    env = gym.wrappers.RecordEpisodeStatistics(
        KLPenalty(RefLogProbs(ChatEnv(GuessNumberTask(), input_mode="tokens", tokenizer=tokenizer), ref), 0.1)
    )
    obs, _ = env.reset(seed=2)

    def scored(obs, n):
        ids = guess(tokenizer, n)
        lps = reference_log_probs(tiny_model, list(obs) + ids)[len(obs) :].numpy()
        return ScoredAction(ids, lps)

    obs, *_ = env.step(scored(obs, 50))
    twin = chatenv.fork(env)
    assert twin.env is not env.env and twin.unwrapped is not env.unwrapped
    a, b = env.step(scored(obs, 30)), twin.step(scored(obs, 30))
    assert np.array_equal(a[0], b[0]) and a[1] == pytest.approx(b[1]) and a[2:4] == b[2:4]
    assert a[4]["kl"] == pytest.approx(b[4]["kl"])
    assert snapshot(env) == snapshot(twin)


@pytest.mark.slow
def test_a_thousand_forks_release_their_memory(tokenizer):
    torch.set_num_threads(1)
    env = ChatEnv(GuessNumberTask(), input_mode="tokens", tokenizer=tokenizer)
    env.reset(seed=0)
    env.step(guess(tokenizer, 50))

    def churn(n):
        for _ in range(n):
            twin = chatenv.fork(env)
            twin.step(guess(tokenizer, 20))
            twin.close()
        gc.collect()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    churn(100)  # warm caches
    start = churn(100)
    end = churn(1000)
    assert end - start < 20 * 1024, f"max RSS grew by {(end - start) / 1024:.1f} MiB over 1000 forks"


@pytest.fixture(scope="module")
def policy(tiny_model, tokenizer):
    from wrappers.policies import TransformersWrapper

    return TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 12, "seed": 0}
    )


def test_branch_rollout_continues_each_point_n_times_from_its_prefix(tokenizer, policy):
    from chatenv.rollout import branch_rollout

    points = []
    for seed in (0, 1):
        env = ChatEnv(GuessNumberTask(max_guesses=3), input_mode="tokens", tokenizer=tokenizer)
        env.reset(seed=seed)
        env.step(guess(tokenizer, 50))
        points.append(env)
    before = [snapshot(p) for p in points]
    td = branch_rollout(points, policy, n=3)
    assert [snapshot(p) for p in points] == before  # the points were not stepped
    episodes = td["episode"].tolist()
    assert sorted(set(episodes)) == list(range(6))
    assert td["group"].tolist() == [e // 3 for e in episodes] and td["branch"].tolist() == [e % 3 for e in episodes]
    prompts = td["tokens"].unpadded("prompt")
    for ep in range(6):
        rows = [k for k, e in enumerate(episodes) if e == ep]
        point = points[ep // 3].unwrapped
        assert td["turn"][rows].tolist() == list(range(1, 1 + len(rows)))  # from the point's turn on
        assert prompts[rows[0]].tolist() == point.token_ids.tolist()  # the shared prefix, verbatim
        assert bool(td["next", "done"][rows[-1]])  # every branch ran to the end of its episode
    view = chatenv.episodes(td)
    assert view.batch_size[0] == 6 and view["group"].tolist() == [0, 0, 0, 1, 1, 1]
    full = view["tokens"].unpadded("full")
    for ep in range(6):
        prefix = points[ep // 3].unwrapped.token_ids.tolist()
        assert full[ep].tolist()[: len(prefix)] == prefix
    # the replies of one point's branches differ (sampled): the point's value is their mean return
    returns = view["reward"].reshape(2, 3)
    assert returns.shape == (2, 3) and torch.isfinite(returns).all()


def test_branch_rollout_refuses_points_it_cannot_branch(tokenizer, policy):
    from chatenv.rollout import branch_rollout

    env = ChatEnv(GuessNumberTask(), input_mode="tokens", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="no episode in progress"):
        branch_rollout(env, policy, n=2)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="n must be a positive int"):
        branch_rollout(env, policy, n=0)
    with pytest.raises(TypeError, match="not a turn-level chatenv env"):
        branch_rollout(TokenEnv(GuessNumberTask(), tokenizer=tokenizer), policy, n=2)


class Fragile(Task):
    """A task whose reward breaks at its third turn."""

    def reset(self, rng):
        return TaskStart([{"role": "user", "content": "Go."}], {"turns": 0})

    def respond(self, messages, state):
        state["turns"] += 1
        if state["turns"] == 3:
            raise RuntimeError("the reward service is down")
        return TaskResponse(1.0, False, [{"role": "user", "content": "Go on."}])


def test_a_failing_branch_keeps_what_was_collected(tokenizer, policy):
    from chatenv.rollout import branch_rollout

    env = ChatEnv(Fragile(), input_mode="tokens", tokenizer=tokenizer)
    env.reset(seed=0)
    env.step(guess(tokenizer, 1))
    before = snapshot(env)
    with pytest.raises(RuntimeError, match="the reward service is down") as info:
        branch_rollout(env, policy, n=3)
    partial = info.value.partial
    assert sorted(partial["episode"].tolist()) == [0, 1, 2] and set(partial["turn"].tolist()) == {1}
    assert partial["branch"].tolist() == partial["episode"].tolist()
    assert snapshot(env) == before  # the point is untouched


class Counted:
    """A per-episode tool object that counts how many of its copies were closed."""

    closed = 0

    def ping(self) -> str:
        """Answer pong."""
        return "pong"

    def close(self):  # noqa: D102 -- undocumented on purpose: documented public methods become tools
        Counted.closed += 1


def test_branch_rollout_releases_the_forks_it_made(tokenizer, policy):
    from chatenv.rollout import branch_rollout

    env = ChatEnv(GuessNumberTask(max_guesses=2), input_mode="tokens", tokenizer=tokenizer, tools=[PerEpisode(Counted)])
    env.reset(seed=0)
    env.step(guess(tokenizer, 50))
    Counted.closed = 0
    branch_rollout(env, policy, n=3)
    assert Counted.closed == 3 and not env.unwrapped.episode.tools.closed  # the forks', not the point's


def test_async_branch_rollout_gives_the_sync_branches(tokenizer, tiny_model):
    from chatenv.rollout import branch_rollout
    from wrappers.policies import TransformersWrapper

    greedy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 12, "temperature": 0}
    )
    env = ChatEnv(GuessNumberTask(max_guesses=3), input_mode="tokens", tokenizer=tokenizer)
    env.reset(seed=4)
    env.step(guess(tokenizer, 50))
    sync = branch_rollout(env, greedy, n=3)
    fast = branch_rollout(env, greedy, n=3, mode="async")
    for key in ("episode", "turn", "group", "branch", ("next", "reward"), ("next", "done")):
        assert torch.equal(sync[key], fast[key]), key
    assert [x.tolist() for x in sync["tokens"].unpadded("full")] == [
        x.tolist() for x in fast["tokens"].unpadded("full")
    ]
    with pytest.raises(ValueError, match="mode must be 'sync' or 'async'"):
        branch_rollout(env, greedy, n=3, mode="fast")


def test_a_fork_without_the_episode_is_a_fresh_env(tokenizer):
    env = ChatEnv(GuessNumberTask(max_guesses=2), input_mode="tokens", tokenizer=tokenizer, tools=[PerEpisode(Locked)])
    env.reset(seed=0)
    before = snapshot(env)
    fresh = chatenv.fork(gym.wrappers.RecordEpisodeStatistics(env), episode=False)  # copies no tool object
    assert fresh.unwrapped.episode is None and fresh.unwrapped.task is env.task
    with pytest.raises(RuntimeError, match="call reset"):
        fresh.step(guess(tokenizer, 10))
    fresh.reset(seed=0)
    assert snapshot(fresh) == before  # the same seed draws the same episode, on its own tool objects
    assert fresh.unwrapped.episode.tools.objects[0] is not env.episode.tools.objects[0]
    fresh.step(guess(tokenizer, 10))
    assert snapshot(env) == before
    fresh.close()
    env.close()
    # a generator of its own: a fork of a seeded env does not replay the env's next problems
    env = ChatEnv("arithmetic", input_mode="tokens", tokenizer=tokenizer)
    env.reset(seed=3)
    twin = chatenv.fork(env, episode=False)
    drawn = [[e.reset()[0].tolist() for _ in range(5)] for e in (env, twin)]
    assert drawn[0] != drawn[1]


def test_a_closed_env_refuses_to_fork_and_closes_once(tokenizer, ref_tiny):
    ref = ReferenceModel(ref_tiny, tokenizer)
    envs = {
        "ChatEnv": ChatEnv(GuessNumberTask(), input_mode="tokens", tokenizer=tokenizer, tools=[PerEpisode(Counted)]),
        "TokenEnv": TokenEnv(GuessNumberTask(), tokenizer=tokenizer),
        "gym.make": gym.make("chatenv/GuessNumber-v0", input_mode="tokens", tokenizer=tokenizer),
        "KL wrappers": gym.wrappers.RecordEpisodeStatistics(
            KLPenalty(RefLogProbs(ChatEnv(GuessNumberTask(), input_mode="tokens", tokenizer=tokenizer), ref), 0.1)
        ),
    }
    for name, env in envs.items():
        env.reset(seed=0)
        twin = chatenv.fork(env)  # a fork made before the close outlives it
        Counted.closed = 0
        env.close()
        env.close()  # idempotent: the episode's tool objects are closed once
        assert Counted.closed == (1 if name == "ChatEnv" else 0), name
        for episode in (True, False):
            with pytest.raises(RuntimeError, match=f"cannot fork a closed {type(env.unwrapped).__name__}"):
                chatenv.fork(env, episode=episode)
        with pytest.raises(RuntimeError, match="the env is closed"):
            env.unwrapped.step(guess(tokenizer, 50))
        assert chatenv.fork(twin).unwrapped.turn == 0, name  # the fork is open
        env.reset(seed=1)  # a reset reopens the env: it forks again
        assert chatenv.fork(env).unwrapped.episode is not None, name
        for e in (env, twin):
            e.close()
