"""Bridges to other libraries, each an optional extra imported only when used.

- :mod:`chatenv.integrations.reasoning_gym`: any reasoning-gym dataset as a chat task (extra ``reasoning-gym``).
- :mod:`chatenv.integrations.trl`: TRL's GRPOTrainer on multi-turn episodes (``grpo_kwargs``, ``rollout_func``,
  ``env_reward``, ``prompt_dataset``; extra ``trl``).
"""

__all__: list[str] = []
