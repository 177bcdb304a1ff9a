"""Bridges to other libraries, each an optional extra imported only when used.

- :mod:`chatenv.integrations.reasoning_gym`: any reasoning-gym dataset as a chat task (extra ``reasoning-gym``).
"""

__all__: list[str] = []
