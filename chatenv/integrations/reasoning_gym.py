"""reasoning-gym datasets as chat tasks, scored by each dataset's own ``score_answer``.

Needs the optional extra: ``pip install 'chatenv-gym[reasoning-gym]'``.

Example:
    >>> import chatenv
    >>> env = chatenv.ChatEnv("reasoning_gym", task_kwargs={"dataset": "basic_arithmetic", "size": 8})
    >>> obs, _ = env.reset(seed=0)
    >>> obs[-1]["content"].endswith("Put the final answer in <answer></answer> tags.")
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatenv.errors import MissingDependencyError
from chatenv.rewards import extract_answer
from chatenv.tasks.dataset import DatasetTask

__all__ = ["ANSWER_INSTRUCTION", "ReasoningGymTask"]

ANSWER_INSTRUCTION = "Put the final answer in <answer></answer> tags."


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as e:
        raise MissingDependencyError(
            "reasoning-gym tasks need the reasoning-gym package: pip install 'chatenv-gym[reasoning-gym]'"
        ) from e
    return reasoning_gym


class ReasoningGymTask(DatasetTask):
    """A reasoning-gym dataset as a :class:`~chatenv.tasks.DatasetTask`.

    Each entry's ``question`` is the user message (with ``instruction`` added), and a reply is scored by the
    dataset's own ``score_answer(answer, entry)`` on the answer the reply gives (by ``answer_method``, default
    the last ``<answer>`` tag); the whole entry (``question``, ``answer``, ``metadata``) goes to the scorer.

    Args:
        dataset: A reasoning-gym dataset name (``reasoning_gym.create_dataset``) or a dataset object.
        size: Entries to generate (with a name).
        seed: Seed of the generated entries (with a name).
        instruction: Added to each question (None: nothing).
        answer_method: How the answer is read from a reply (see :func:`chatenv.rewards.extract_answer`).
        config: More dataset options, passed to ``create_dataset`` (with a name).
        **kwargs: :class:`~chatenv.tasks.DatasetTask` options (``max_attempts``, ``on_reward_error``, ...).

    Raises:
        MissingDependencyError: Without the reasoning-gym package.
        ValueError: For an unknown dataset name (with the closest names).
    """

    description = "A reasoning-gym dataset scored by its own score_answer."

    def __init__(
        self,
        dataset: str | Any = "basic_arithmetic",
        *,
        size: int = 500,
        seed: int = 0,
        instruction: str | None = ANSWER_INSTRUCTION,
        answer_method: str = "tags",
        config: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ):
        self.dataset = self._make(dataset, size, seed, dict(config or {}))
        if not hasattr(self.dataset, "score_answer"):
            raise TypeError(f"expected a reasoning-gym dataset (with score_answer), got {type(self.dataset).__name__}")
        extract_answer("", answer_method)  # refuse an unknown method now, not at the first reply
        self.answer_method = answer_method
        records = [dict(self.dataset[i]) for i in range(len(self.dataset))]
        super().__init__(records, reward_fn=self._score, pass_record=True, instruction=instruction, **kwargs)

    @staticmethod
    def _make(dataset: Any, size: int, seed: int, config: dict[str, Any]) -> Any:
        if not isinstance(dataset, str):
            return dataset
        rg = _reasoning_gym()
        names = sorted(rg.factory.DATASETS)
        if dataset not in names:
            import difflib

            close = difflib.get_close_matches(dataset, names, n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else f" ({len(names)} are registered)"
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}{hint}")
        return rg.create_dataset(dataset, size=size, seed=seed, **config)

    def _score(self, reply: str, entry: dict[str, Any]) -> tuple[float, dict[str, float]]:
        answer = extract_answer(reply, self.answer_method)
        score = float(self.dataset.score_answer(answer, entry=entry))
        return score, {"score": score, "answered": float(answer is not None)}
