"""The token-level chat environment: one step is one generated token."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, SupportsFloat, TypeAlias, cast

import gymnasium as gym
import numpy as np
import numpy.typing as npt
import torch

from chatenv.actions import action_token
from chatenv.envs.base import ChatEnvBase, Info
from chatenv.spaces import TokenIds
from chatenv.tasks import Task

__all__ = ["TokenAction", "TokenEnv"]

#: One token id: an int, a numpy integer or a one-element tensor.
TokenAction: TypeAlias = int | np.integer[Any] | torch.Tensor


class TokenEnv(ChatEnvBase[npt.NDArray[np.int64], TokenAction]):
    """A chat where each step is one token of the assistant's reply.

    Args:
        task: A :class:`~chatenv.tasks.Task` or a registered task name.
        task_kwargs: Arguments for a task given by name.
        tokenizer: A fast Hugging Face tokenizer (default: the embedded SmolLM2's).
        template: Chat template name or object (default: the tokenizer's).
        max_new_tokens: Most tokens in one reply; reaching it truncates the episode.
        max_tokens: Context budget; an observation reaching it truncates the episode.
        max_turns: Replies per episode (default: the task's).
        render_mode: ``"ansi"`` to get the chat as text from :meth:`render`.
        tools: Tools the assistant may call, as for :class:`~chatenv.envs.ChatEnv`; a reply's calls run when its
            end-of-turn token arrives.

    Observation: the prompt and the tokens generated so far (int64 ids; after a finished reply the task's
    messages and the next assistant header follow, as in the turn-level env's tokens mode). Action: a token id
    (``Discrete(vocab_size)``). Reward: 0 for a token that does not end a reply; at the end-of-turn token (or
    when a limit cuts the reply) the task's reward for the reply. The task ending sets ``terminated``;
    ``max_new_tokens``, ``max_tokens`` and ``max_turns`` set ``truncated``. Reset options are those of
    :class:`~chatenv.envs.ChatEnv`.
    """

    #: Observations are token ids (the turn-level env's tokens mode).
    input_mode = "tokens"

    def __init__(
        self,
        task: str | Task = "arithmetic",
        *,
        task_kwargs: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        template: Any = None,
        max_new_tokens: int = 64,
        max_tokens: int | None = None,
        max_turns: int | None = None,
        render_mode: str | None = None,
        tools: Any = None,
        rerender: bool = False,
    ):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        super().__init__(
            task,
            task_kwargs=task_kwargs,
            tokenizer=tokenizer,
            template=template,
            max_turns=max_turns,
            max_tokens=max_tokens,
            render_mode=render_mode,
            tools=tools,
            rerender=rerender,
        )
        self.max_new_tokens = max_new_tokens
        self.action_space = gym.spaces.Discrete(self.vocab_size)
        # a Sequence space of stacked ids: its values are the int64 arrays observations are
        self.observation_space = cast(
            "gym.spaces.Space[npt.NDArray[np.int64]]", TokenIds(self.vocab_size, min_length=1)
        )
        self._response: list[int] = []

    def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[npt.NDArray[np.int64], Info]:
        """Start an episode (``options`` as for :class:`~chatenv.envs.ChatEnv`)."""
        episode = self._start(seed, options)
        self._response = []
        return self._obs(), {"turn": 0, "num_tokens": episode.num_tokens}

    def step(self, action: TokenAction) -> tuple[npt.NDArray[np.int64], SupportsFloat, bool, bool, Info]:
        """Append one token; at the end of a reply, let the task answer."""
        episode = self._live_episode()
        token = action_token(action, self.vocab_size)
        response = [*self._response, token]
        info: dict[str, Any] = {"turn": episode.turn, "response_tokens": len(response)}
        ended = token in self.chat_tokenizer.stop_set
        cut = len(response) >= self.max_new_tokens or (
            self.max_tokens is not None and episode.num_tokens + len(response) >= self.max_tokens
        )
        if not ended and not cut:
            self._response = response
            info["num_tokens"] = episode.num_tokens + len(response)
            return self._obs(), 0.0, False, False, info
        # an end-of-turn id completes the turn; another stop id (an EOS) ends the reply, and the env closes the turn
        reply, complete = episode.reply_from_ids(response)
        turn = episode.plan(reply, response, complete, continue_chat=False)
        # a reply cut by a limit truncates the episode (whatever the task says of the cut reply); a finished reply
        # ends it when the task is over
        terminated = bool(turn.response.done) and ended
        truncated = not terminated and (cut or (self.max_turns is not None and episode.turn + 1 >= self.max_turns))
        if not terminated and not truncated:
            episode.continue_turn(turn)
            truncated = self.max_tokens is not None and episode.tokens_after(turn) >= self.max_tokens
        episode.commit(turn)  # validated and computed above: a raising step leaves the env unchanged
        self._response = []
        self._done = terminated or truncated
        info.update(turn=episode.turn, num_tokens=episode.num_tokens)
        info.update(self._turn_info(episode, turn))
        return self._obs(), turn.reward, terminated, truncated, info

    def render(self) -> str | None:
        """The chat so far, with the reply in progress (``render_mode="ansi"``)."""
        if self.render_mode != "ansi" or self._episode is None:
            return None
        return self._episode.render(self._response)

    @property
    def token_ids(self) -> npt.NDArray[np.int64]:
        """The current observation's ids (the reply in progress included)."""
        return self._obs()

    def token_view(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """The current observation's ids (the reply in progress included) with their assistant mask."""
        if self._episode is None:
            return super().token_view()
        return self._episode.view(self._response)

    def _obs(self) -> npt.NDArray[np.int64]:
        if self._episode is None:
            return np.zeros(0, dtype=np.int64)
        return self._episode.view(self._response)[0]
