"""Run a registered env with a saved model on a local Ray cluster (what ``chatenv rollout --workers N`` runs)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from wrappers.distributed.factories import TransformersFactory

__all__ = ["collect_on_ray"]


def _kl_env(env_id: str, kwargs: dict[str, Any], ref: Any, coef: float) -> Any:
    """One env of a Ray env worker, with a KL penalty to the Ray-hosted reference model."""
    import gymnasium as gym

    import chatenv  # noqa: F401  (registers the envs in the worker's process)
    from wrappers.kl import KLPenalty

    return KLPenalty(gym.make(env_id, **kwargs), coef, ref_model=ref)


def _tokenizer(model: str) -> Any:
    if model == "default":
        from chatenv.models import load_default_tokenizer

        return load_default_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def collect_on_ray(
    env_id: str,
    model: str,
    on_episode: Callable[[Any], Any],
    *,
    episodes: int,
    workers: int,
    envs_per_worker: int = 1,
    inference_actors: int = 1,
    input_mode: str = "tokens",
    generate_kwargs: dict[str, Any] | None = None,
    max_turns: int | None = None,
    kl: float | None = None,
    seed: int | None = None,
    group_size: int | None = None,
) -> list[Any]:
    """Run ``episodes`` episodes of ``env_id`` with the transformers model ``model`` on Ray actors.

    Starts a local Ray cluster unless one is initialised (and stops the one it started). With ``kl`` the envs
    get a KL penalty to the model's frozen copy, hosted in a :class:`~wrappers.kl.RayRefModel` actor (at the
    policy's temperature).

    Args:
        env_id: A registered turn-level env.
        model: A model folder or ``"default"``.
        on_episode: Called with each episode's TensorDict as it ends.
        episodes: Episodes to run.
        workers: Env workers.
        envs_per_worker: Envs per worker.
        inference_actors: Inference actors.
        input_mode: The envs' and policy's input mode.
        generate_kwargs: The policy's generation settings.
        max_turns: Turns per episode (default: the task's).
        kl: Constant KL coefficient, or None for no KL penalty.
        seed: Seed of the first reset.
        group_size: Episodes per group sharing a reset.

    Returns:
        The :class:`~chatenv.distributed.LostEpisodes` of env workers that died (empty when none did).
    """
    import ray

    from chatenv.distributed import RayCollector

    settings = dict(generate_kwargs or {})
    kwargs: dict[str, Any] = {"input_mode": input_mode, "tokenizer": _tokenizer(model)}
    if max_turns is not None:
        kwargs["max_turns"] = max_turns
    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False, log_to_driver=False)
    ref = None
    try:
        envs: Any = env_id
        if kl is not None:
            from chatenv.sampling import normalize_generate_kwargs
            from wrappers.kl import RayRefModel, ReferenceModel
            from wrappers.policies.logits import reports_processed

            # the temperature of the log-probs the policy reports (1 for greedy decoding): one rule for every caller
            checked = normalize_generate_kwargs(settings)
            temperature = checked.temperature if reports_processed(checked, raw_log_probs=False) else 1.0
            ref = RayRefModel(functools.partial(ReferenceModel, model, temperature=temperature), num_cpus=0)
            envs, kwargs = functools.partial(_kl_env, env_id, kwargs, ref, kl), None
        share = min(1.0, ray.cluster_resources().get("CPU", 1.0) / (workers + inference_actors + 1))
        policy = TransformersFactory(model, input_mode=input_mode, generate_kwargs=settings)
        with RayCollector(
            envs,
            policy,
            env_kwargs=kwargs,
            num_env_workers=workers,
            envs_per_worker=envs_per_worker,
            num_inference_actors=inference_actors,
            worker_cpus=share,
            inference_cpus=share,
        ) as collector:
            for td in collector.stream(episodes, seed=seed, group_size=group_size):
                on_episode(td)
            return collector.lost
    finally:
        if ref is not None:
            ref.close()
        if started:
            ray.shutdown()
