"""The higher/lower game: :class:`GuessNumberTask` (guess a hidden integer over several turns)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from chatenv.rewards import extract_answer, parse_number
from chatenv.tasks.base import Task, TaskResponse, TaskStart, last_reply, positive_int

__all__ = ["GuessNumberTask"]


class GuessNumberTask(Task):
    """Higher/lower game: guess a hidden integer in ``[low, high]``; each wrong guess is told "higher"/"lower".

    Rewards per turn: 1.0 for the right guess (the game ends), 0.0 for a wrong one, ``invalid_reward`` for a
    reply with no number in range.
    """

    description = "Higher/lower number guessing over many turns."

    def __init__(self, low: int = 1, high: int = 100, max_guesses: int = 8, invalid_reward: float = -0.1):
        for name, value in (("low", low), ("high", high)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"GuessNumberTask: {name} must be an int, got {value!r}")
        positive_int("max_guesses", max_guesses)
        if high <= low:
            raise ValueError(f"high must exceed low, got low={low}, high={high}")
        self.low, self.high = low, high
        self.invalid_reward = invalid_reward
        self.default_max_turns = max_guesses

    def reset(self, rng: np.random.Generator) -> TaskStart:  # noqa: D102
        secret = int(rng.integers(self.low, self.high + 1))
        prompt = (
            f"I am thinking of an integer between {self.low} and {self.high}. Guess it! After each guess I will say "
            "'higher' or 'lower'. Reply with just your guess."
        )
        return TaskStart([{"role": "user", "content": prompt}], {"secret": secret, "guesses": []})

    def state_for(self, messages: list[dict[str, Any]], options: Mapping[str, Any]) -> Any:  # noqa: D102
        if "secret" not in options:
            raise ValueError("GuessNumber needs options['secret'] when the chat is given")
        secret = options["secret"]
        if isinstance(secret, bool) or not isinstance(secret, (int, np.integer)):
            raise TypeError(f"options['secret'] must be an int, got {secret!r:.60}")
        if not self.low <= int(secret) <= self.high:
            raise ValueError(f"options['secret'] must be in [{self.low}, {self.high}], got {secret}")
        return {"secret": int(secret), "guesses": []}

    def respond(self, messages: list[dict[str, Any]], state: Any) -> TaskResponse:  # noqa: D102
        number = parse_number(extract_answer(last_reply(messages)))
        if number is None or not number.is_integer() or not self.low <= number <= self.high:
            msg = f"Please reply with a whole number between {self.low} and {self.high}."
            return TaskResponse(self.invalid_reward, False, [{"role": "user", "content": msg}], {"valid": 0.0})
        guess = int(number)
        state["guesses"].append(guess)
        info = {"secret": state["secret"], "guess": guess}
        if guess == state["secret"]:
            return TaskResponse(1.0, True, [], {"valid": 1.0, "correct": 1.0}, info)
        hint = "Higher." if guess < state["secret"] else "Lower."
        return TaskResponse(0.0, False, [{"role": "user", "content": hint}], {"valid": 1.0, "correct": 0.0}, info)
