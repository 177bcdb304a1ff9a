"""Gymnasium spaces for chat observations and actions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from gymnasium.spaces import Space

__all__ = ["MessagesSpace"]

_SAMPLE_CHARS = np.array(list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!\n"))


class MessagesSpace(Space[list]):
    """Chats as lists of message dicts (``role`` and ``content`` strings, optional ``tool_calls``).

    Args:
        max_messages: Most messages in a chat (None: unbounded).
        max_length: Most characters in one message's content.
        roles: Allowed roles; empty means any non-empty str.
        seed: Seed of the space's random generator.

    Example:
        >>> space = MessagesSpace(max_messages=4, roles=("user", "assistant"))
        >>> space.contains([{"role": "user", "content": "Hi"}])
        True
        >>> space.contains([{"role": "narrator", "content": "Hi"}])
        False
    """

    def __init__(
        self,
        max_messages: int | None = None,
        max_length: int = 4096,
        roles: Sequence[str] = (),
        seed: int | np.random.Generator | None = None,
    ):
        if max_messages is not None and max_messages < 1:
            raise ValueError(f"max_messages must be >= 1 or None, got {max_messages}")
        if max_length < 0:
            raise ValueError(f"max_length must be >= 0, got {max_length}")
        self.max_messages = max_messages
        self.max_length = max_length
        self.roles = tuple(roles)
        super().__init__(shape=None, dtype=None, seed=seed)

    @property
    def is_np_flattenable(self) -> bool:
        """Chats have no fixed-size array form."""
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> list[dict[str, str]]:
        """A random chat of short random messages."""
        if mask is not None or probability is not None:
            raise NotImplementedError("MessagesSpace.sample does not support masks")
        roles = self.roles or ("system", "user", "assistant")
        n = int(self.np_random.integers(1, (self.max_messages or 4) + 1))
        out = []
        for _ in range(n):
            length = int(self.np_random.integers(0, min(self.max_length, 32) + 1))
            content = "".join(self.np_random.choice(_SAMPLE_CHARS, size=length))
            out.append({"role": str(self.np_random.choice(roles)), "content": content})
        return out

    def contains(self, x: Any) -> bool:
        """Whether ``x`` is a list of valid message dicts within the bounds."""
        if not isinstance(x, Sequence) or isinstance(x, (str, bytes)):
            return False
        if self.max_messages is not None and len(x) > self.max_messages:
            return False
        for m in x:
            if not isinstance(m, Mapping):
                return False
            role, content = m.get("role"), m.get("content")
            if not isinstance(role, str) or not role or (self.roles and role not in self.roles):
                return False
            if not isinstance(content, str) or len(content) > self.max_length:
                return False
        return True

    def __repr__(self) -> str:
        return f"MessagesSpace(max_messages={self.max_messages}, max_length={self.max_length}, roles={self.roles})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessagesSpace) and (self.max_messages, self.max_length, self.roles) == (
            other.max_messages,
            other.max_length,
            other.roles,
        )
