"""What the turn-level and the token-level env share: construction, reset, guards, views, render and close."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import gymnasium as gym
import numpy as np
import numpy.typing as npt

from chatenv.envs.episode import ChatEpisode, Turn
from chatenv.errors import TemplateError
from chatenv.tasks import Task, get_task
from chatenv.templates import ChatTemplate, get_template, resolve_template
from chatenv.tokenization import ChatTokenizer, chat_tokenizer
from chatenv.tools.runner import Toolbox

__all__ = ["ChatEnvBase", "Info", "shared_default_tokenizer"]

ObsT = TypeVar("ObsT")
ActT = TypeVar("ActT")
#: What ``reset`` and ``step`` return as ``info``.
Info = dict[str, Any]


@functools.lru_cache(maxsize=1)
def shared_default_tokenizer() -> Any:
    """The embedded model's tokenizer, loaded once and shared by envs built without one (it is never modified)."""
    from chatenv.models import load_default_tokenizer

    return load_default_tokenizer()


class ChatEnvBase(gym.Env[ObsT, ActT], Generic[ObsT, ActT]):
    """Base of :class:`~chatenv.envs.ChatEnv` and :class:`~chatenv.envs.TokenEnv`: one :class:`ChatEpisode` at a time.

    Args:
        task: A :class:`~chatenv.tasks.Task` or a registered task name.
        task_kwargs: Arguments for a task given by name.
        tokenizer: A fast Hugging Face tokenizer (default: the embedded SmolLM2's).
        template: Chat template name or object (default: the tokenizer's).
        max_turns: Replies per episode before truncation (default: the task's).
        max_tokens: Context budget in tokens; an opening at or over it is refused at reset.
        render_mode: ``"ansi"`` to get the chat as text from :meth:`render`.
        tools: Tools the assistant may call: a :class:`~chatenv.tools.Toolbox`, or a list of functions,
            :class:`~chatenv.tools.Tool` and :class:`~chatenv.tools.PerEpisode` objects (default rules). They add
            to the task's own ``tools``. A reply with tool calls is answered with one ``tool`` message per call
            (the task is not asked); a reply without calls goes to the task. With tools, a template without tool
            support is replaced by its tool variant (``smollm2`` -> ``smollm2-tools``).
        rerender: For templates that rewrite earlier turns (dropped reasoning, ...). False (default): token-in/
            token-out, the sampled ids stay verbatim and each step records ``info["template_drift"]``. True: after a
            turn whose reply a fresh render writes differently, the context is replaced by a fresh render of the
            chat, as an inference server would show it, and a new segment starts (``info["segment"]``); each
            transition's prompt is still exactly what the model saw, but an episode no longer extends one chain.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}
    #: Keep the episode's text view (text-mode observations).
    _keep_text = False

    def __init__(
        self,
        task: str | Task = "arithmetic",
        *,
        task_kwargs: Mapping[str, Any] | None = None,
        tokenizer: Any = None,
        template: str | ChatTemplate | None = None,
        max_turns: int | None = None,
        max_tokens: int | None = None,
        render_mode: str | None = None,
        tools: Toolbox | Any = None,
        rerender: bool = False,
    ):
        if not isinstance(rerender, bool):
            raise TypeError(f"rerender must be a bool, got {type(rerender).__name__}")
        self.rerender = rerender
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        if task_kwargs is not None and not isinstance(task_kwargs, Mapping):
            raise TypeError(f"task_kwargs must be a dict, got {type(task_kwargs).__name__}")
        self.task = get_task(task, **dict(task_kwargs or {}))
        self.tokenizer = tokenizer if tokenizer is not None else shared_default_tokenizer()
        self.tools: Toolbox | None = _toolbox(tools, getattr(self.task, "tools", None))
        self.chat_tokenizer: ChatTokenizer = chat_tokenizer(self.tokenizer, _tool_template(template, self))
        self.vocab_size = len(self.tokenizer)
        self.max_turns = max_turns if max_turns is not None else self.task.default_max_turns
        if self.max_turns is not None and (isinstance(self.max_turns, bool) or self.max_turns < 1):
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2
        ):
            raise ValueError(f"max_tokens must be an int >= 2 or None, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.render_mode = render_mode
        self._episode: ChatEpisode | None = None
        self._done = False
        self._closed = False  # close() was called (and no reset since)

    # ------------------------------------------------------------------------------------------ episodes

    def _start(self, seed: int | None, options: Any) -> ChatEpisode:
        """Seed, draw and check a new episode (the env changes only once it is valid)."""
        super().reset(seed=seed)
        episode = ChatEpisode.start(
            self.task, self.chat_tokenizer, self.np_random, options, keep_text=self._keep_text, tools=self.tools
        )
        episode.rerender = self.rerender
        if self.max_tokens is not None and episode.num_tokens >= self.max_tokens:
            episode.close()
            raise ValueError(
                f"the opening chat has {episode.num_tokens} tokens, at or over max_tokens={self.max_tokens}; raise "
                "max_tokens or shorten the chat"
            )
        if self._episode is not None:
            self._episode.close()
        self._episode, self._done, self._closed = episode, False, False
        return episode

    def _turn_info(self, episode: ChatEpisode, turn: Turn) -> dict[str, Any]:
        """What every finished turn reports: reward parts, the task's info, tool use, and the chat at the end."""
        info: dict[str, Any] = {
            "reward_components": {k: float(v) for k, v in turn.response.components.items()},
            "task_info": dict(turn.response.info),
            "template_drift": turn.drift,
            "segment": episode.segment,
        }
        if episode.tools is not None:
            counts = turn.tools.counts() if turn.tools is not None else {"calls": 0, "errors": 0, "truncated": 0}
            stats = episode.tools.stats
            info["tool_turn"] = counts
            info.update(tool_calls=stats.calls, tool_errors=stats.errors, tool_truncated=stats.truncated)
        if self._done:
            info["chat"] = episode.messages
            episode.close()
        return info

    def fork(self, *, episode: bool = True) -> ChatEnvBase[ObsT, ActT]:
        """An independent env at the same point of the same episode (see :func:`chatenv.fork`, also for wrappers).

        Args:
            episode: Copy the episode in progress; ``False``: the fork has none (reset it before stepping).

        Raises:
            RuntimeError: If the env is closed (its episode and tool objects are released: nothing to copy).
            TypeError: If the task state or a per-episode tool object cannot be copied.
        """
        if self._closed:
            raise RuntimeError(
                f"cannot fork a closed {type(self).__name__}: close() released its episode; fork the env before "
                "closing it (or reset it first to start a new episode)"
            )
        new = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, list):  # e.g. a token-level env's reply in progress
                setattr(new, name, list(value))
        if not episode:  # a fresh env: no episode, and a generator of its own (seeded at its first reset)
            vars(new).update(_episode=None, _done=False, _np_random=None, _np_random_seed=None)
            return new
        if self._episode is not None and not self._done:  # a finished episode is never changed again: shared
            vars(new)["_episode"] = self._episode.fork()
        if getattr(self, "_np_random", None) is not None:
            vars(new)["_np_random"] = copy.deepcopy(self._np_random)
        return new

    def _live_episode(self) -> ChatEpisode:
        """The episode in progress; raises if there is none to step."""
        if self._episode is None:
            raise RuntimeError(
                "the env is closed; call reset() to start a new episode"
                if self._closed
                else "call reset() before step()"
            )
        if self._done:
            raise RuntimeError("the episode has ended (terminated or truncated); call reset() to start a new one")
        return self._episode

    def _over_budget(self, num_tokens: int, turn: int) -> bool:
        return (self.max_turns is not None and turn >= self.max_turns) or (
            self.max_tokens is not None and num_tokens >= self.max_tokens
        )

    # ------------------------------------------------------------------------------------------ views

    @property
    def done(self) -> bool:
        """Whether the current episode has ended (terminated or truncated): it must be reset before a step."""
        return self._done

    @property
    def episode(self) -> ChatEpisode | None:
        """The current episode (None before the first reset)."""
        return self._episode

    @property
    def turn(self) -> int:
        """Assistant turns finished in the current episode."""
        return 0 if self._episode is None else self._episode.turn

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat so far (a copy)."""
        return [] if self._episode is None else self._episode.messages

    @property
    def token_ids(self) -> npt.NDArray[np.int64]:
        """The token ids of the current observation."""
        return np.zeros(0, dtype=np.int64) if self._episode is None else self._episode.token_ids

    def token_view(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """The current observation as ids with their assistant mask (what a policy should be given verbatim)."""
        if self._episode is None:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
        return self._episode.token_ids, self._episode.assistant_mask

    def render(self) -> str | None:
        """The chat so far as text (``render_mode="ansi"``)."""
        if self.render_mode != "ansi" or self._episode is None:
            return None
        return self._episode.render()

    def close(self) -> None:
        """Release the env's episode and its tool objects (safe to call more than once); a reset starts anew."""
        if self._episode is not None:
            self._episode.close()
        self._episode, self._closed = None, True


def _toolbox(tools: Any, task_tools: Any) -> Toolbox | None:
    """The env's toolbox: the task's tools, then the env's (a Toolbox's rules apply to both)."""
    extra = [*task_tools.static, *task_tools.per_episode] if isinstance(task_tools, Toolbox) else list(task_tools or [])
    if tools is None:
        if isinstance(task_tools, Toolbox):
            return task_tools
        return Toolbox(extra) if extra else None
    box = tools if isinstance(tools, Toolbox) else Toolbox(tools)
    box = box.with_tools(extra) if extra else box
    return box if box.schemas() else None


def _tool_template(template: str | ChatTemplate | None, env: ChatEnvBase[Any, Any]) -> str | ChatTemplate | None:
    """The template to use: with tools, one that can write tool calls (a template's tool variant if needed)."""
    if env.tools is None:
        return template
    chosen = resolve_template(template, env.tokenizer)
    if chosen.tool_format is not None:
        return chosen
    if chosen.tool_variant is not None:
        return get_template(chosen.tool_variant)
    raise TemplateError(
        f"template {chosen.name or '<tokenizer template>'!r} cannot render tool calls; pass a template with tool "
        "support (smollm2-tools, qwen2.5, llama3) or register one with tool_format=..."
    )
