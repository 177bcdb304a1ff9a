"""The turn-level chat environment: one step is one assistant turn."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from chatenv.actions import ScoredAction, scored_action_from_output
from chatenv.messages import check_message
from chatenv.spaces import ChatText, MessagesSpace, TokenIds
from chatenv.tasks import Task, TaskResponse, get_task
from chatenv.tokenization import ChatTokenizer, chat_tokenizer

__all__ = ["ChatEnv", "ScoredAction"]

_MODES = ("history", "text", "tokens")


@functools.lru_cache(maxsize=1)
def _shared_default_tokenizer() -> Any:
    """The embedded model's tokenizer, loaded once and shared by envs built without one (it is never modified)."""
    from chatenv.models import load_default_tokenizer

    return load_default_tokenizer()


class ChatEnv(gym.Env):
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

    Actions: the assistant's reply as text, a message dict, or generated token ids (kept verbatim: the
    observation's ids are the previous ids + the generated ids + the tokens of the new messages and the next
    assistant header). A policy wrapper's output row (a tensordict with ``tokens``) works too.

    ``info`` holds ``turn``, ``num_tokens`` (observation length), ``response_tokens``, ``reward_components``
    and ``task_info`` (whatever the task reported).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

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
    ):
        if input_mode not in _MODES:
            raise ValueError(f"input_mode must be one of {_MODES}, got {input_mode!r}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.task = get_task(task, **dict(task_kwargs or {}))
        if tokenizer is None:
            tokenizer = _shared_default_tokenizer()
        self.tokenizer = tokenizer
        self.chat_tokenizer: ChatTokenizer = chat_tokenizer(tokenizer, template)
        self.input_mode = input_mode
        self.max_turns = max_turns if max_turns is not None else self.task.default_max_turns
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        self.max_tokens = max_tokens
        self.render_mode = render_mode
        self.vocab_size = len(tokenizer)
        if input_mode == "tokens":
            self.observation_space = TokenIds(self.vocab_size, min_length=1)
            self.action_space = TokenIds(self.vocab_size, min_length=1, max_length=max_tokens)
        else:
            if input_mode == "history":
                self.observation_space = MessagesSpace(max_length=1 << 20)
            else:
                self.observation_space = ChatText()
            self.action_space = ChatText()
        self._started = False
        self._done = False
        self._closed = False

    # ------------------------------------------------------------------------------------------ gym API

    def reset(self, *, seed: int | None = None, options: Mapping[str, Any] | None = None):
        """Start an episode: the task draws the opening, or ``options["messages"]`` (or a History) is used as-is.

        ``options`` may also carry task state for a given chat (e.g. ``{"answer": 42}`` for arithmetic).
        """
        super().reset(seed=seed)
        options = dict(options or {})
        if "messages" in options:
            messages = options["messages"]
            from chatenv.history import History

            if isinstance(messages, History):
                messages = messages.to_chats()
            if not isinstance(messages, Sequence) or isinstance(messages, (str, Mapping)) or not messages:
                raise ValueError("options['messages'] must be a non-empty list of message dicts")
            messages = [check_message(m, f"options['messages'][{i}]") for i, m in enumerate(messages)]
            state = self.task.state_for(messages, options)
        else:
            start = self.task.reset(self.np_random)
            messages, state = [check_message(m, "task opening") for m in start.messages], start.state
        enc = self.chat_tokenizer.encode(messages, add_generation_prompt=True)
        self._messages = messages
        self._state = state
        self._ids: list[int] = enc.ids.tolist()
        self._assistant: list[bool] = enc.assistant_mask.tolist()
        self._text = enc.text
        self._turn = 0
        self._started, self._done = True, False
        self._rewards: list[float] = []
        return self._observation(), {"turn": 0, "num_tokens": len(self._ids)}

    def step(self, action: Any):
        """Append the assistant's reply, let the task answer, and return the next observation and reward."""
        if not self._started:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode has ended (terminated or truncated); call reset() to start a new one")
        reply, ids, complete = self._reply(action)
        messages = [*self._messages, reply]
        response: TaskResponse = self.task.respond(messages, self._state)
        if not isinstance(response, TaskResponse):
            raise TypeError(
                f"{type(self.task).__name__}.respond must return a TaskResponse, got {type(response).__name__}"
            )
        new = [check_message(m, "task response") for m in response.messages]
        cont = self.chat_tokenizer.continuation(messages, new, generation_complete=complete)
        # commit: nothing above changed the env, so a bad action leaves it as it was
        self._messages = messages + new
        self._ids += ids + cont.ids.tolist()
        self._assistant += [True] * len(ids) + cont.assistant_mask.tolist()
        if self.input_mode == "text":  # the text view is only kept where it is the observation
            self._text += self.chat_tokenizer.decode(ids) + cont.text
        self._turn += 1
        self._rewards.append(float(response.reward))
        terminated = bool(response.done)
        truncated = not terminated and (
            (self.max_turns is not None and self._turn >= self.max_turns)
            or (self.max_tokens is not None and len(self._ids) >= self.max_tokens)
        )
        self._done = terminated or truncated
        info = {
            "turn": self._turn,
            "num_tokens": len(self._ids),
            "response_tokens": len(ids),
            "reward_components": dict(response.components),
            "task_info": dict(response.info),
        }
        return self._observation(), float(response.reward), terminated, truncated, info

    def render(self) -> str | None:
        """The chat so far as text (``render_mode="ansi"``)."""
        if self.render_mode != "ansi" or not self._started:
            return None
        return "".join(f"[{m['role']}]\n{m['content']}\n\n" for m in self._messages)

    def close(self) -> None:
        """Release the env (safe to call more than once)."""
        self._closed = True
        self._started = False

    # ------------------------------------------------------------------------------------------ views

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat so far (a copy)."""
        return [dict(m) for m in self._messages]

    @property
    def token_ids(self) -> np.ndarray:
        """The token ids of the current observation (prompt for the next turn)."""
        return np.asarray(self._ids, dtype=np.int64)

    @property
    def assistant_mask(self) -> np.ndarray:
        """True on the observation's tokens the assistant produced (same length as :attr:`token_ids`)."""
        return np.asarray(self._assistant, dtype=bool)

    def _observation(self) -> Any:
        if self.input_mode == "tokens":
            return np.asarray(self._ids, dtype=np.int64)
        if self.input_mode == "text":
            return self._text
        return [dict(m) for m in self._messages]

    # ------------------------------------------------------------------------------------------ actions

    def _reply(self, action: Any) -> tuple[dict[str, Any], list[int], bool]:
        """The reply message, its token ids and whether it ended its turn; raises without touching the env."""
        ct = self.chat_tokenizer
        from tensordict import TensorDictBase

        if isinstance(action, ScoredAction):
            action = action.ids
        if isinstance(action, TensorDictBase):
            action = scored_action_from_output(action).ids
        if isinstance(action, str):
            if self.input_mode == "tokens":
                raise TypeError(
                    "tokens mode takes the generated token ids as the action (kept verbatim), not text; use "
                    "input_mode='text' or 'history' to send text"
                )
            reply = {"role": "assistant", "content": action}
            return reply, ct.reply(self._messages, reply).ids.tolist(), True
        if isinstance(action, Mapping):
            if self.input_mode == "tokens":
                raise TypeError("tokens mode takes the generated token ids as the action, not a message dict")
            reply = check_message(action, "action")
            if reply["role"] != "assistant":
                raise ValueError(f"the action is the assistant's reply; got a message with role {reply['role']!r}")
            return reply, ct.reply(self._messages, reply).ids.tolist(), True
        ids = self._ids_from(action)
        message = ct.parse_response(ids)[0]
        complete = bool(ids) and ids[-1] in ct.end_of_turn_ids
        reply = {"role": "assistant", "content": message.get("content", "")}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        return reply, ids, complete

    def _ids_from(self, action: Any) -> list[int]:
        try:
            import torch

            if isinstance(action, torch.Tensor):
                action = action.detach().cpu().numpy()
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
        arr = np.asarray(action) if isinstance(action, (list, tuple, np.ndarray)) else None
        if arr is None or arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise TypeError(
                f"unsupported action {type(action).__name__}: give the reply as text, a message dict, or a 1-D "
                "sequence of generated token ids"
            )
        if arr.size == 0:
            raise ValueError("empty action: a reply needs at least one generated token")
        if arr.min() < 0 or arr.max() >= self.vocab_size:
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise ValueError(f"token id {bad} in the action is outside the vocabulary [0, {self.vocab_size})")
        return arr.astype(np.int64).tolist()
