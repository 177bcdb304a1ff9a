"""Distributed collection on a real local Ray cluster: 2 env workers (2 envs each), 2 inference actors building the
tiny model themselves from its saved folder, the Ray reference model, weight broadcast, routing, and dead actors.
One cluster and one collector for the module (the test that kills actors runs last)."""

import asyncio

import pytest
import torch
from conftest import make_tiny_llama

from chatenv import ChatEnv
from chatenv.distributed import DistributedError, LostEpisodes, RayCollector
from chatenv.distributed.router import Router
from chatenv.rollout import rollout
from wrappers.distributed import TransformersFactory
from wrappers.kl import KLPenalty, RayRefModel, ReferenceModel
from wrappers.policies import TransformersWrapper

pytestmark = pytest.mark.slow  # the module's Ray cluster and actors take over a minute to start

ray = pytest.importorskip("ray")

POLICY = {"input_mode": "tokens", "generate_kwargs": {"max_new_tokens": 8, "temperature": 0}}


def _factories(tokenizer, ref, n=4):
    def make():  # a local function: pickled by value, so the workers need not import this test module
        env = ChatEnv("arithmetic", input_mode="tokens", tokenizer=tokenizer, max_turns=2)
        return KLPenalty(env, 0.1, ref_model=ref)

    return [make] * n


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def collector(cluster, tiny_model_dir, tokenizer):
    ref = RayRefModel(str(tiny_model_dir), num_cpus=0)
    policy = TransformersFactory(str(tiny_model_dir), **POLICY)
    with RayCollector(
        _factories(tokenizer, ref), policy, num_env_workers=2, num_inference_actors=2, worker_cpus=0, inference_cpus=0
    ) as c:
        yield c
    ref.close()


def _local(tokenizer, tiny_model_dir, model=None, **kwargs):
    """The same rollout in this process: local policy, local reference, the same four envs."""
    ref = ReferenceModel(str(tiny_model_dir))
    envs = [f() for f in _factories(tokenizer, ref)]
    policy = TransformersWrapper(str(tiny_model_dir) if model is None else model, tokenizer=tokenizer, **POLICY)
    return rollout(envs, policy, **kwargs)


def _by_env(td):
    """Rows of each env's n-th episode: {(env_index, n): [row, ...]} (episode numbers differ, the work does not)."""
    rows: dict = {}
    for k, (ep, env) in enumerate(zip(td["episode"].tolist(), td["env_index"].tolist())):
        rows.setdefault(env, {}).setdefault(ep, []).append(k)
    return {(env, n): eps[ep] for env, eps in rows.items() for n, ep in enumerate(sorted(eps))}


def _same_rows(a, rows_a, b, rows_b):
    full_a, full_b = a["tokens"].unpadded("full"), b["tokens"].unpadded("full")
    for key in ("log_probs", "ref_log_probs"):
        lp_a, lp_b = a[key].unpadded("full"), b[key].unpadded("full")
        for i, j in zip(rows_a, rows_b):
            assert torch.allclose(lp_a[i], lp_b[j], atol=1e-4, equal_nan=True)
    for i, j in zip(rows_a, rows_b, strict=True):
        assert torch.equal(full_a[i], full_b[j])
        assert torch.equal(a["masks"].unpadded()[i], b["masks"].unpadded()[j])
        assert a["next", "reward"][i] == pytest.approx(b["next", "reward"][j], abs=1e-4)
        assert a["next", "terminated"][i] == b["next", "terminated"][j]


def test_bad_arguments_fail_before_any_actor():
    factory = TransformersFactory("unused")
    with pytest.raises(ValueError, match="num_env_workers must be an int >= 1, got 0"):
        RayCollector("chatenv/Arithmetic-v0", factory, num_env_workers=0)
    with pytest.raises(TypeError, match=r"envs\[0\] is a ChatEnv, not a factory"):
        RayCollector([ChatEnv("arithmetic")], factory)
    with pytest.raises(TypeError, match="env_kwargs= goes with an env id"):
        RayCollector(ChatEnv, factory, env_kwargs={"max_turns": 2})
    with pytest.raises(ValueError, match="3 env factories cannot fill num_env_workers=4"):
        RayCollector([ChatEnv] * 3, factory, num_env_workers=4)
    with pytest.raises(TypeError, match="policy_factory must be a callable"):
        RayCollector(ChatEnv, "path/to/model")
    with pytest.raises(ValueError, match="inference_gpus must be a finite number >= 0"):
        RayCollector(ChatEnv, factory, inference_gpus=-1)
    with pytest.raises(TypeError, match="model must be a model path"):
        TransformersFactory(object())
    if not ray.is_initialized():
        with pytest.raises(DistributedError, match=r"Ray is not initialised: call ray.init"):
            RayCollector(ChatEnv, factory)


def test_router_sends_each_request_to_the_least_loaded_actor():
    class Actor:
        def __init__(self):
            self.gate, self.seen = asyncio.Event(), []
            self.generate = self

        def remote(self, td):
            async def answer():
                self.seen.append(td)
                await self.gate.wait()
                return td

            return answer()

    async def main():
        a, b = Actor(), Actor()
        router = Router([a, b])
        first = [asyncio.ensure_future(router.generate(k)) for k in range(3)]
        await asyncio.sleep(0.01)
        assert (a.seen, b.seen) == ([0, 2], [1])  # 0 -> a, 1 -> b (a busy), 2 -> a (tie: both hold one)
        b.gate.set()
        await asyncio.sleep(0.01)
        assert [s["inflight"] for s in router.stats()] == [2, 0]
        assert await router.generate(3) == 3 and b.seen[-1] == 3  # b is free, a holds two
        a.gate.set()
        assert await asyncio.gather(*first) == [0, 1, 2]
        assert [(s["served"], s["peak"]) for s in router.stats()] == [(2, 2), (2, 1)]

    asyncio.run(main())


@pytest.mark.slow
def test_factory_errors_reach_the_caller(cluster):
    def no_gpu():
        raise RuntimeError("no GPU here")

    with pytest.raises(DistributedError, match=r"inference actor 0 raised RuntimeError: no GPU here") as info:
        RayCollector(ChatEnv, no_gpu, num_env_workers=1, worker_cpus=0, inference_cpus=0)
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.slow
def test_collect_equals_the_local_rollout(collector, tokenizer, tiny_model_dir):
    td = collector.collect(episodes=8, seed=0)
    local = _local(tokenizer, tiny_model_dir, episodes=8, seed=0)
    assert td.batch_size == local.batch_size and set(td.keys(True, True)) == set(local.keys(True, True)) | {"worker"}
    assert sorted(set(td["episode"].tolist())) == list(range(8))
    assert set(td["env_index"].tolist()) == {0, 1, 2, 3}
    assert {w: sorted(set(td["env_index"][td["worker"] == w].tolist())) for w in (0, 1)} == {0: [0, 1], 1: [2, 3]}
    assert td["policy_version"].eq(0).all() and collector.lost == []
    ours, theirs = _by_env(td), _by_env(local)
    assert ours.keys() == theirs.keys()
    for key in ours:
        _same_rows(td, ours[key], local, theirs[key])
    # planned episodes (groups from one reset) equal row for row, with the same episode and group numbers
    td = collector.collect(episodes=4, seed=3, group_size=2)
    local = _local(tokenizer, tiny_model_dir, episodes=4, seed=3, group_size=2)
    for key in ("episode", "group", "env_index"):
        assert td[key].tolist() == local[key].tolist()
    _same_rows(td, range(td.batch_size[0]), local, range(local.batch_size[0]))
    with pytest.raises(ValueError, match="episodes=3 is not a multiple of group_size=2"):
        collector.collect(episodes=3, group_size=2)
    with pytest.raises(ValueError, match="episodes must be an int >= 1, got 0"):
        collector.collect(episodes=0)


@pytest.mark.slow
def test_requests_spread_over_both_inference_actors(collector):
    before = [s["served"] for s in collector.stats()]
    episodes = list(collector.stream(episodes=8, seed=1))
    served = [s["served"] - b for s, b in zip(collector.stats(), before)]
    assert len(episodes) == 8 and all(e["next", "done"][-1].item() for e in episodes)
    assert sorted(e["episode"][0].item() for e in episodes) == list(range(8))
    assert 0 < sum(served) <= sum(e.batch_size[0] for e in episodes)  # one request per worker and round
    assert min(served) >= sum(served) // 4, served  # both actors take a fair share


@pytest.mark.slow
def test_broadcast_weights_are_used_and_stamped(collector, tokenizer, tiny_model_dir):
    new = make_tiny_llama(seed=1)
    assert collector.broadcast(new.state_dict()) == 1 and collector.version == 1
    td = collector.collect(episodes=2, seed=0, group_size=1)
    assert td["policy_version"].eq(1).all()
    local = _local(tokenizer, tiny_model_dir, model=new, episodes=2, seed=0, group_size=1)
    for ep in (0, 1):
        rows = [(t["episode"] == ep).nonzero().reshape(-1).tolist() for t in (td, local)]
        _same_rows(td, rows[0], local, rows[1])
    with pytest.raises(TypeError, match="state_dict must map parameter names to tensors"):
        collector.broadcast({"w": [1.0]})
    with pytest.raises(RuntimeError, match="size mismatch"):  # the actor's own error: the weights do not fit
        collector.broadcast({"lm_head.weight": torch.zeros(3, 3)}, version=7)
    assert collector.version == 1


@pytest.mark.slow
def test_dead_actors_mid_collection(collector):
    got = {0: 0, 1: 0}
    stream = collector.stream(episodes=16, seed=2)
    for episode in stream:
        w = int(episode["worker"][0])
        got[w] += 1
        if w == 1 and got[1] == 1:  # mid-collection: one inference actor and one env worker go down
            ray.kill(collector.inference_actors[0])
            ray.kill(collector.env_workers[1])
    assert got[0] == 8 and got[1] < 8  # worker 0 finished everything, on the surviving inference actor
    assert collector.lost == [LostEpisodes(worker=1, episodes=8 - got[1], reason="died")]
    assert [s["alive"] for s in collector.stats()] == [False, True]
    assert collector.workers_alive == [0]
    # the collector goes on with what is left
    td = collector.collect(episodes=4, seed=0)
    assert sorted(set(td["episode"].tolist())) == [0, 1, 2, 3] and td["worker"].eq(0).all()
    assert collector.lost == [] and td["policy_version"].eq(1).all()
