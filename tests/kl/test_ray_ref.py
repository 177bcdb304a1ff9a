"""The reference model in a real Ray actor on a local cluster (loopback): results, and faults (a factory that
raises or returns the wrong thing, errors of the remote model, a dead actor). One cluster for the module."""

import time

import numpy as np
import pytest
import torch

from chatenv import ChatEnv, ScoredAction
from wrappers.kl import KLPenalty, RayRefModel, ReferenceModel, RefModelUnavailable

pytestmark = pytest.mark.slow  # the module's Ray cluster and actors take tens of seconds to start

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_reference_equals_local(cluster, tiny_model_dir, tokenizer):
    remote = RayRefModel(str(tiny_model_dir), num_cpus=1)
    local = ReferenceModel(str(tiny_model_dir))
    seqs = [tokenizer.encode("<|im_start|>user\nHi there<|im_end|>\n"), [1, 4093, 198, 22, 33, 2]]
    for a, b in zip(remote.log_probs(seqs), local.log_probs(seqs)):
        assert torch.isnan(a[0]) and torch.allclose(a[1:], b[1:], atol=1e-5)
    # shared by several envs through KLPenalty
    envs = [KLPenalty(ChatEnv("arithmetic", input_mode="tokens"), 0.1, ref_model=remote) for _ in range(2)]
    for env in envs:
        obs, _ = env.reset(seed=0)
        ids = np.array(tokenizer.encode("<answer>3</answer>") + [2])
        lp = local.log_probs([obs.tolist() + ids.tolist()])[0][len(obs) :]
        _, reward, _, _, info = env.step(ScoredAction(ids, lp.numpy()))
        assert np.abs(info["kl"]).max() < 1e-4 and reward == pytest.approx(info["task_reward"], abs=1e-3)
    # one batched call per vector step for model-free sub-envs
    import gymnasium as gym

    from wrappers.kl import RefLogProbs, VectorRefLogProbs

    venv = VectorRefLogProbs(
        gym.vector.SyncVectorEnv([lambda: KLPenalty(RefLogProbs(ChatEnv("arithmetic", input_mode="tokens")), 0.1)] * 2),
        remote,
    )
    obs, _ = venv.reset(seed=4)
    ids = np.array(tokenizer.encode("<answer>8</answer>") + [2])
    _, _, _, _, info = venv.step(tuple(ScoredAction(ids, np.zeros(len(ids), np.float32), prompt_ids=o) for o in obs))
    for o, row in zip(obs, info["ref_log_probs"]):
        q = local.log_probs([list(o) + ids.tolist()])[0][len(o) :]
        assert np.allclose(row, q.numpy(), atol=1e-5)
    venv.close()
    # the remote model's own errors keep their type and message; ids are checked here before any remote call
    outside = r"token id 60000 in sequence 0 is outside the vocabulary \[0, 49152\) of the reference model"
    with pytest.raises(ValueError, match=outside + r" \(at position 2\)"):
        remote.log_probs([[1, 2, 60000]])
    with pytest.raises(TypeError, match=r"sequence 0 must be integer token ids, got 1.0 \(float\) at position 0"):
        remote.log_probs([[1.0, 2.5]])
    with pytest.raises(ValueError, match="sequence 0 is empty"):
        remote.log_probs([[]])
    assert remote.log_probs([]) == [] and len(remote.log_probs([[1, 2, 3]])[0]) == 3  # it still answers
    remote.close()
    remote.close()
    with pytest.raises(RefModelUnavailable, match="closed"):
        remote.log_probs([[1, 2, 3]])


def test_dead_actor_is_a_clear_error(cluster, tiny_model_dir):
    remote = RayRefModel(str(tiny_model_dir), num_cpus=1)
    ray.kill(remote.actor)
    with pytest.raises(RefModelUnavailable, match="the reference model's Ray actor died or is unreachable"):
        remote.log_probs([[1, 2, 3]])
    remote.close()


def _free_cpus_after(seconds):
    deadline = time.monotonic() + seconds
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    return ray.available_resources().get("CPU", 0)


def test_factory_errors_reach_the_caller(cluster):
    def no_gpu_factory():
        raise RuntimeError("no GPU here")

    with pytest.raises(
        RefModelUnavailable,
        match=r"the reference model's factory .*no_gpu_factory raised RuntimeError: no GPU here \(in the Ray actor, "
        r"which was stopped",
    ) as info:
        RayRefModel(no_gpu_factory, num_cpus=1)
    assert isinstance(info.value.__cause__, RuntimeError) and str(info.value.__cause__) == "no GPU here"
    with pytest.raises(
        TypeError,
        match=r"the RayRefModel factory must return a ReferenceModel \(anything with a log_probs\(sequences\) "
        r"method\) or a transformers model, got dict \{'weights': 1\}",
    ):
        RayRefModel(lambda: {"weights": 1}, num_cpus=1)
    assert _free_cpus_after(20.0) == 2  # both failed actors were stopped: nothing holds the CPUs


def test_a_slow_start_is_refused_at_start_timeout_and_says_so(cluster, tiny_model_dir):
    def slow_factory():
        time.sleep(30)

    t = time.monotonic()
    with pytest.raises(
        RefModelUnavailable, match=r"did not start and load the model within 1 s \(start_timeout\); give a larger"
    ):
        RayRefModel(slow_factory, num_cpus=1, timeout=60, start_timeout=1)
    # The factory sleeps 30 s and the per-call timeout is 60 s: within 20 s, it was the 1 s start-up limit.
    assert time.monotonic() - t < 20
    assert _free_cpus_after(20.0) == 2  # the actor was stopped
    with pytest.raises(ValueError, match="start_timeout must be a finite number > 0"):
        RayRefModel(str(tiny_model_dir), start_timeout=0)
