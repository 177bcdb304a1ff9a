"""Distributed collection on Ray: many env workers, several inference actors, one trainer.

:class:`RayCollector` starts three kinds of Ray actors:

- **inference actors** (:class:`~chatenv.distributed.inference.InferenceActor`), each building a policy from a
  factory (``wrappers.distributed.TransformersFactory``, or any callable returning a
  :class:`~chatenv.protocols.RolloutPolicy`; a vLLM-backed policy is a drop-in), answering policy requests one at a
  time and stamping each reply with the version of the weights that made it;
- a **router** (:class:`~chatenv.distributed.router.Router`) sending each request to the inference actor with the
  fewest requests in flight;
- **env workers** (:class:`~chatenv.distributed.worker.EnvWorker`), each holding several envs (a list, or a vector
  env) and running :func:`chatenv.rollout` on them with a policy proxy that forwards every round's policy input.

The trainer gets TensorDicts in the layout of a local rollout: :meth:`RayCollector.collect` (all episodes at once,
numbered across workers, with a ``worker`` column) or :meth:`RayCollector.stream` (each episode as it ends), and
sends new weights with :meth:`RayCollector.broadcast` (through Ray's object store, once). Dead actors are handled:
see :class:`RayCollector`. Ray is an optional extra (``pip install 'chatenv-gym[ray]'``); nothing here imports it
until a collector starts.

Example::

    import ray
    from chatenv.distributed import RayCollector
    from wrappers.distributed import TransformersFactory

    ray.init()
    policy = TransformersFactory("path/to/model", input_mode="tokens", generate_kwargs={"max_new_tokens": 64})
    with RayCollector("chatenv/Arithmetic-v0", policy, env_kwargs={"input_mode": "tokens"},
                      num_env_workers=4, envs_per_worker=8, num_inference_actors=2) as collector:
        batch = collector.collect(episodes=256, seed=0)
        collector.broadcast(trainer_model.state_dict())
"""

from __future__ import annotations

from chatenv.distributed.collector import LostEpisodes, RayCollector
from chatenv.distributed.common import DistributedError, InferenceUnavailable, PolicySpec
from chatenv.distributed.episodes import WORKER_KEY, episode_transitions
from chatenv.distributed.inference import InferenceActor, load_state_dict

__all__ = [
    "WORKER_KEY",
    "DistributedError",
    "InferenceActor",
    "InferenceUnavailable",
    "LostEpisodes",
    "PolicySpec",
    "RayCollector",
    "episode_transitions",
    "load_state_dict",
]
