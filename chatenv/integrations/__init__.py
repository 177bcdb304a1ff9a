"""Bridges to other libraries, each an optional extra imported only when used.

- :mod:`chatenv.integrations.reasoning_gym`: any reasoning-gym dataset as a chat task (extra ``reasoning-gym``).
- :mod:`chatenv.integrations.trl`: TRL's GRPOTrainer on multi-turn episodes (``grpo_kwargs``, ``rollout_func``,
  ``env_reward``, ``prompt_dataset``; extra ``trl``).
- :mod:`chatenv.integrations.torchrl`: TorchRL envs with compact specs (``gym_env``, ``register``), rollouts as
  ``GRPOLoss`` / ``MCAdvantage`` batches (``grpo_batch``) and trainable actors
  (``grpo_actor``; extra ``torchrl``).
"""

__all__: list[str] = []
