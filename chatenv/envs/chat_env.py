"""The turn-level chat environment: one step is one assistant turn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, SupportsFloat, TypeAlias

import numpy as np
import numpy.typing as npt
import torch
from tensordict import TensorDictBase

from chatenv.actions import ScoredAction, action_ids
from chatenv.envs.base import ChatEnvBase, Info
from chatenv.modes import InputMode, get_mode
from chatenv.tasks import Task

__all__ = ["ChatAction", "ChatEnv", "ChatObservation", "ScoredAction"]

#: An observation: the messages (``history`` mode), the rendered prompt (``text``) or its token ids (``tokens``).
ChatObservation: TypeAlias = list[dict[str, Any]] | str | npt.NDArray[np.int64]
#: An action: the reply as text or a message dict, its generated ids (a sequence, array or tensor), a
#: :class:`~chatenv.actions.ScoredAction`, or a policy wrapper's output row.
ChatAction: TypeAlias = (
    str | Mapping[str, Any] | Sequence[int] | npt.NDArray[np.integer[Any]] | torch.Tensor | ScoredAction
)


class ChatEnv(ChatEnvBase[ChatObservation, ChatAction]):
    """A chat as a Gymnasium environment: each step is one assistant turn, answered by a task.

    Args:
        task: A :class:`~chatenv.tasks.Task` or a registered task name (``"arithmetic"``, ``"guess_number"``,
            ``"dataset"``).
        task_kwargs: Arguments for a task given by name.
        input_mode: What observations are: ``"history"`` (a list of message dicts), ``"text"`` (the rendered
            prompt, ending with the assistant header) or ``"tokens"`` (its token ids, an int64 array).
        tokenizer: A fast Hugging Face tokenizer (default: the embedded SmolLM2's).
        template: Chat template name or object (default: the tokenizer's).
        max_turns: Truncate after this many assistant turns (default: the task's).
        max_tokens: Truncate once the next observation holds this many tokens (the context budget).
        render_mode: ``"ansi"`` to get the chat as text from :meth:`render`.
        tools: Tools the assistant may call (a :class:`~chatenv.tools.Toolbox` or a list of functions/tools); a
            reply with tool calls is answered with ``tool`` messages (see :class:`~chatenv.envs.base.ChatEnvBase`).
            ``info`` then counts ``tool_calls``/``tool_errors`` of the episode and the turn's (``tool_turn``).

    Actions: the assistant's reply as text, a message dict, or generated token ids (kept verbatim: the
    observation's ids are the previous ids + the generated ids + the tokens of the new messages and the next
    assistant header). A policy wrapper's output row (a tensordict with ``tokens``) works too.

    ``info`` holds ``turn``, ``num_tokens`` (observation length), ``response_tokens``, ``reward_components``
    and ``task_info`` (whatever the task reported); the step that ends an episode adds ``chat``, the whole chat.

    Example:
        >>> env = ChatEnv("arithmetic", input_mode="history")
        >>> obs, info = env.reset(seed=0)
        >>> obs[-1]["role"], info["turn"]
        ('user', 0)
    """

    def __init__(
        self,
        task: str | Task = "arithmetic",
        *,
        task_kwargs: Mapping[str, Any] | None = None,
        input_mode: str = "history",
        tokenizer: Any = None,
        template: Any = None,
        max_turns: int | None = None,
        max_tokens: int | None = None,
        render_mode: str | None = None,
        tools: Any = None,
        rerender: bool = False,
    ):
        self.mode: InputMode = get_mode(input_mode)
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
        self._keep_text = self.mode.name == "text"
        self.observation_space, self.action_space = self.mode.spaces(self.vocab_size, max_tokens)

    @property
    def input_mode(self) -> str:
        """The input mode's name."""
        return self.mode.name

    @property
    def assistant_mask(self) -> npt.NDArray[np.bool_]:
        """True on the observation's tokens the assistant produced (same length as :attr:`token_ids`)."""
        return np.zeros(0, dtype=bool) if self._episode is None else self._episode.assistant_mask

    def reset(
        self, *, seed: int | None = None, options: Mapping[str, Any] | None = None
    ) -> tuple[ChatObservation, Info]:
        """Start an episode: the task draws the opening, or ``options["messages"]`` (or a History) is used as-is.

        ``options`` may also carry task state for a given chat (e.g. ``{"answer": 42}`` for arithmetic).
        """
        episode = self._start(seed, options)
        return self.mode.observe(episode), {"turn": 0, "num_tokens": episode.num_tokens}

    def step(self, action: ChatAction) -> tuple[ChatObservation, SupportsFloat, bool, bool, Info]:
        """Append the assistant's reply, let the task answer, and return the next observation and reward.

        A placeholder :class:`~chatenv.actions.ScoredAction` (what :func:`~chatenv.rollout` gives a vector env's
        idle sub-envs) changes nothing and never reaches the task: the same observation, reward 0, and
        ``info["placeholder"]``.
        """
        if isinstance(action, ScoredAction) and action.placeholder and self._episode is not None:
            return self.mode.observe(self._episode), 0.0, False, False, {"placeholder": True}
        episode = self._live_episode()
        reply, ids, complete = self._reply(action)
        turn = episode.plan(reply, ids, complete)
        episode.commit(turn)  # nothing above changed the env: a step that raises leaves it as it was
        terminated = bool(turn.response.done)
        truncated = not terminated and self._over_budget(episode.num_tokens, episode.turn)
        self._done = terminated or truncated
        info = {"turn": episode.turn, "num_tokens": episode.num_tokens, "response_tokens": len(ids)}
        info.update(self._turn_info(episode, turn))
        return self.mode.observe(episode), turn.reward, terminated, truncated, info

    def _reply(self, action: Any) -> tuple[dict[str, Any], list[int], bool]:
        """The reply message, its token ids and whether it ended its turn; raises without touching the env."""
        episode = self._live_episode()
        if isinstance(action, str) or (isinstance(action, Mapping) and not isinstance(action, TensorDictBase)):
            if not self.mode.takes_text:
                raise TypeError(
                    "tokens mode takes the generated token ids as the action (kept verbatim), not text or a message "
                    "dict; use input_mode='text' or 'history' to send text"
                )
            return episode.reply_from_message(action)
        ids = action_ids(action, self.vocab_size)
        reply, complete = episode.reply_from_ids(ids)
        return reply, ids, complete
