"""Gymnasium spaces for chat observations and actions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import numpy as np
from gymnasium.spaces import Discrete, Space, Text
from gymnasium.spaces import Sequence as SequenceSpace

from chatenv.messages import Message, is_valid_message

__all__ = ["ChatText", "MessagesSpace", "TokenIds"]

_SAMPLE_CHARS = np.array(list("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!\n"))


class MessagesSpace(Space[list[Message]]):
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
            if not is_valid_message(m):
                return False
            if (self.roles and m["role"] not in self.roles) or len(m["content"]) > self.max_length:
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


class ChatText(Text):
    r"""Any text up to ``max_length`` characters (chat text uses every Unicode character).

    Gymnasium's :class:`~gymnasium.spaces.Text` only admits characters from its charset; this subclass keeps its
    interface (and vector-env batching) but admits every character. Samples use a readable charset.

    Example:
        >>> ChatText(100).contains("<|im_start|>user\\nÇa va? 🙂")
        True
    """

    def __init__(self, max_length: int = 1 << 20, *, min_length: int = 0, seed: Any = None):
        charset = "".join(_SAMPLE_CHARS.tolist())
        super().__init__(max_length, min_length=min_length, charset=charset, seed=seed)

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """Random readable text of ``min_length`` to ``min(max_length, min_length + 64)`` characters."""
        if mask is not None or probability is not None:
            raise NotImplementedError("ChatText.sample does not support masks")
        hi = min(self.max_length, self.min_length + 64)
        n = int(self.np_random.integers(self.min_length, hi + 1))
        return "".join(self.np_random.choice(_SAMPLE_CHARS, size=n))

    def contains(self, x: Any) -> bool:
        """Whether ``x`` is a str within the length bounds."""
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"ChatText(min_length={self.min_length}, max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ChatText) and (self.min_length, self.max_length) == (
            other.min_length,
            other.max_length,
        )


class TokenIds(SequenceSpace):
    """Variable-length sequences of token ids in ``[0, vocab_size)`` as 1-D ``int64`` numpy arrays.

    Args:
        vocab_size: Number of token ids.
        min_length: Shortest allowed sequence.
        max_length: Longest allowed sequence (None: unbounded); also caps the length of samples.
    """

    def __init__(self, vocab_size: int, *, min_length: int = 0, max_length: int | None = None, seed: Any = None):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        super().__init__(Discrete(vocab_size), seed=seed, stack=True)
        self.vocab_size = vocab_size
        self.min_length = min_length
        self.max_length = max_length

    def sample(self, mask: Any = None, probability: Any = None) -> np.ndarray:
        """Random ids, ``min_length`` to ``min(max_length, min_length + 16)`` of them."""
        if mask is not None or probability is not None:
            raise NotImplementedError("TokenIds.sample does not support masks")
        hi = self.min_length + 16 if self.max_length is None else min(self.max_length, self.min_length + 16)
        n = int(self.np_random.integers(max(self.min_length, 1) if hi >= 1 else 0, max(hi, 1) + 1))
        return self.np_random.integers(0, self.vocab_size, size=n, dtype=np.int64)

    def contains(self, x: Any) -> bool:
        """Whether ``x`` is a 1-D integer array of ids in range and length bounds."""
        if not isinstance(x, np.ndarray) or x.ndim != 1 or not np.issubdtype(x.dtype, np.integer):
            return False
        if len(x) < self.min_length or (self.max_length is not None and len(x) > self.max_length):
            return False
        return bool(len(x) == 0 or (x.min() >= 0 and x.max() < self.vocab_size))

    def __repr__(self) -> str:
        return f"TokenIds(vocab_size={self.vocab_size}, min_length={self.min_length}, max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenIds) and (self.vocab_size, self.min_length, self.max_length) == (
            other.vocab_size,
            other.min_length,
            other.max_length,
        )


# --------------------------------------------------------------------------------------- vector envs


class _SharedObservations(Sequence[Any]):
    """Observations of an ``AsyncVectorEnv`` kept in a manager list (chat observations have no fixed size).

    It reads as a tuple of the latest observations; ``copy.deepcopy`` (what the vector env returns by default)
    gives a plain tuple.
    """

    def __init__(self, manager: Any, memory: Any, n: int):
        self._manager, self._memory, self._n = manager, memory, n

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[Any, ...]: ...
    def __getitem__(self, i: int | slice) -> Any:
        return tuple(self._memory[: self._n])[i]

    def __len__(self) -> int:
        return self._n

    def __deepcopy__(self, memo: dict[int, object]) -> tuple[Any, ...]:
        import copy

        return copy.deepcopy(tuple(self._memory[: self._n]), memo)


def _register_vector_support() -> None:
    """Let ``AsyncVectorEnv`` (with its default ``shared_memory=True``) carry chat observations."""
    from gymnasium.vector.utils import shared_memory as shm

    def create(space: Space[Any], n: int = 1, ctx: Any = None) -> Any:
        import multiprocessing as mp

        manager = (ctx or mp).Manager()
        memory = manager.list([None] * n)
        # keep the manager (its server process) alive as long as the list
        memory._chatenv_manager = manager  # noqa: SLF001
        return memory

    def read(space: Space[Any], memory: Any, n: int = 1) -> _SharedObservations:
        return _SharedObservations(getattr(memory, "_chatenv_manager", None), memory, n)

    def write(space: Space[Any], index: int, value: Any, memory: Any) -> None:
        memory[index] = value

    for cls in (ChatText, TokenIds, MessagesSpace):
        shm.create_shared_memory.register(cls)(create)
        # gymnasium types a reader as returning a dict, tuple or array; AsyncVectorEnv takes any sequence
        shm.read_from_shared_memory.register(cls)(read)  # type: ignore[arg-type]
        shm.write_to_shared_memory.register(cls)(write)


_register_vector_support()
