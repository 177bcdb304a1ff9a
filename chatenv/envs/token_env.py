"""The token-level chat environment: one step is one generated token."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gymnasium as gym
import numpy as np

from chatenv.envs.chat_env import _shared_default_tokenizer
from chatenv.messages import check_message
from chatenv.spaces import TokenIds
from chatenv.tasks import Task, TaskResponse, get_task
from chatenv.tokenization import ChatTokenizer, chat_tokenizer

__all__ = ["TokenEnv"]


class TokenEnv(gym.Env):
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

    Observation: the prompt and the tokens generated so far (int64 ids; after a finished reply the task's
    messages and the next assistant header follow, as in the turn-level env's tokens mode). Action: a token id
    (``Discrete(vocab_size)``). Reward: 0 for a token that does not end a reply; at the end-of-turn token (or
    when a limit cuts the reply) the task's reward for the decoded reply. The task ending sets ``terminated``;
    ``max_new_tokens``, ``max_tokens`` and ``max_turns`` set ``truncated``.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

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
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.task = get_task(task, **dict(task_kwargs or {}))
        self.tokenizer = tokenizer if tokenizer is not None else _shared_default_tokenizer()
        self.chat_tokenizer: ChatTokenizer = chat_tokenizer(self.tokenizer, template)
        self.vocab_size = len(self.tokenizer)
        self.max_new_tokens = max_new_tokens
        self.max_tokens = max_tokens
        self.max_turns = max_turns if max_turns is not None else self.task.default_max_turns
        self.render_mode = render_mode
        self.input_mode = "tokens"
        self.action_space = gym.spaces.Discrete(self.vocab_size)
        self.observation_space = TokenIds(self.vocab_size, min_length=1)
        self._end = set(self.chat_tokenizer.end_of_turn_ids)
        if self.tokenizer.eos_token_id is not None:
            self._end.add(int(self.tokenizer.eos_token_id))
        self._started = self._done = False

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        """Start an episode (``options`` as for :class:`~chatenv.envs.ChatEnv`)."""
        super().reset(seed=seed)
        options = dict(options or {})
        if "messages" in options:
            messages = [check_message(m, f"options['messages'][{i}]") for i, m in enumerate(options["messages"])]
            if not messages:
                raise ValueError("options['messages'] must be a non-empty list of message dicts")
            state = self.task.state_for(messages, options)
        else:
            start = self.task.reset(self.np_random)
            messages, state = [check_message(m, "task opening") for m in start.messages], start.state
        enc = self.chat_tokenizer.encode(messages, add_generation_prompt=True)
        if self.max_tokens is not None and len(enc.ids) >= self.max_tokens:
            raise ValueError(f"the opening chat has {len(enc.ids)} tokens, at or over max_tokens={self.max_tokens}")
        self._messages, self._state = messages, state
        self._ids: list[int] = enc.ids.tolist()
        self._response: list[int] = []
        self._turn = 0
        self._started, self._done = True, False
        return self._obs(), {"turn": 0, "num_tokens": len(self._ids)}

    def step(self, action: Any):
        """Append one token; at the end of a reply, let the task answer."""
        if not self._started:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode has ended (terminated or truncated); call reset() to start a new one")
        token = self._token(action)
        self._ids.append(token)
        self._response.append(token)
        info: dict[str, Any] = {"turn": self._turn, "response_tokens": len(self._response)}
        ended = token in self._end
        cut = len(self._response) >= self.max_new_tokens or (
            self.max_tokens is not None and len(self._ids) >= self.max_tokens
        )
        if not ended and not cut:
            info["num_tokens"] = len(self._ids)
            return self._obs(), 0.0, False, False, info
        reply = self.chat_tokenizer.parse_response(self._response)[0]
        reply = {k: v for k, v in reply.items() if k != "is_complete"}
        messages = [*self._messages, reply]
        response: TaskResponse = self.task.respond(messages, self._state)
        self._turn += 1
        info.update(reward_components=dict(response.components), task_info=dict(response.info), turn=self._turn)
        # a reply cut by a limit truncates the episode (whatever the task says of the cut reply); a finished reply
        # ends it when the task is over
        terminated = bool(response.done) and ended
        truncated = not terminated and (cut or (self.max_turns is not None and self._turn >= self.max_turns))
        new = [check_message(m, "task response") for m in response.messages]
        if not terminated and not truncated:
            cont = self.chat_tokenizer.continuation(messages, new, generation_complete=ended)
            self._ids += cont.ids.tolist()
            if self.max_tokens is not None and len(self._ids) >= self.max_tokens:
                truncated = True
        self._messages = messages + new
        self._response = []
        self._done = terminated or truncated
        info["num_tokens"] = len(self._ids)
        return self._obs(), float(response.reward), terminated, truncated, info

    def render(self) -> str | None:
        """The chat so far, with the reply in progress (``render_mode="ansi"``)."""
        if self.render_mode != "ansi" or not self._started:
            return None
        text = "".join(f"[{m['role']}]\n{m['content']}\n\n" for m in self._messages)
        if self._response:
            text += f"[assistant, in progress]\n{self.chat_tokenizer.decode(self._response)}\n"
        return text

    def close(self) -> None:
        """Release the env (safe to call more than once)."""
        self._started = False

    @property
    def token_ids(self) -> np.ndarray:
        """The current observation's ids."""
        return np.asarray(self._ids, dtype=np.int64)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The finished turns of the chat (a copy)."""
        return [dict(m) for m in self._messages]

    def _obs(self) -> np.ndarray:
        return np.asarray(self._ids, dtype=np.int64)

    def _token(self, action: Any) -> int:
        from chatenv.actions import ScoredAction

        if isinstance(action, ScoredAction):
            action = np.asarray(action.ids)
        try:
            import torch

            if isinstance(action, torch.Tensor):
                action = action.detach().cpu().numpy()
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
        if isinstance(action, np.ndarray):
            if action.size != 1:
                raise TypeError(f"one step takes one token id, got an array of shape {action.shape}")
            action = action.reshape(()).item()
        if isinstance(action, (bool, np.bool_)) or not isinstance(action, (int, np.integer)):
            raise TypeError(f"the action is one token id (an int), got {type(action).__name__}")
        if not 0 <= int(action) < self.vocab_size:
            raise ValueError(f"token id {int(action)} is outside the vocabulary [0, {self.vocab_size})")
        return int(action)
