"""One episode of a chat: the machinery shared by the turn-level and the token-level env.

:class:`ChatEpisode` holds the chat and its token-in/token-out (TITO) view (an
:class:`~chatenv.envs.state.EpisodeState`: the ids the model has seen and produced, the assistant mask over them),
the task and its state, and the episode's tools. A turn is planned first (:meth:`ChatEpisode.plan`:
the reply, the task's answer on a copy of its state, the continuation ids), and committed last
(:meth:`ChatEpisode.commit`), so a turn that raises leaves the episode exactly as it was.

:class:`~chatenv.envs.ChatEnv` commits a whole reply per step; :class:`~chatenv.envs.TokenEnv` collects one token
per step and plans the turn when the reply ends.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from chatenv.envs.state import EpisodeState, Extension, check_reset_options, open_chat
from chatenv.errors import TemplateError
from chatenv.messages import check_message, check_messages
from chatenv.tasks import Task, TaskResponse
from chatenv.templates.tool_calls import ParsedCalls, ToolCall
from chatenv.tokenization import ChatTokenizer
from chatenv.tools.runner import Toolbox, ToolSession, ToolTurn

__all__ = ["ChatEpisode", "Turn", "check_reset_options"]


@dataclass
class Turn:
    """A planned (not yet committed) assistant turn and the task's answer to it.

    Attributes:
        response: The task's answer (reward checked finite).
        ext: The reply and the task's messages as tokens (:class:`~chatenv.envs.state.Extension`).
        state: The task's state after answering (a copy; the episode's own is untouched until commit).
        tools: The results of the reply's tool calls (None when it made none; the task was not asked then).
    """

    response: TaskResponse
    ext: Extension
    state: Any = None
    tools: ToolTurn | None = None

    @property
    def reply(self) -> dict[str, Any]:
        """The assistant's message."""
        return self.ext.reply

    @property
    def ids(self) -> list[int]:
        """The reply's token ids (verbatim when generated)."""
        return self.ext.ids

    @property
    def complete(self) -> bool:
        """Whether the reply ended its turn (an end-of-turn id), rather than being cut."""
        return self.ext.complete

    @property
    def new_messages(self) -> list[dict[str, Any]]:
        """The task's (or the tools') messages, checked."""
        return self.ext.new_messages

    @property
    def drift(self) -> int:
        """Tokens of the reply that a fresh render writes differently (0 when none; the kept ids are as sampled)."""
        return self.ext.drift

    @property
    def reward(self) -> float:
        """The task's reward for the turn."""
        return float(self.response.reward)


class ChatEpisode:
    """One chat episode: its :class:`~chatenv.envs.state.EpisodeState` (``chat``), the task and its state, tools.

    Args:
        chat_tokenizer: Encodes the chat and continuations.
        task: Answers each assistant turn.
        messages: The opening chat (checked).
        state: The task's hidden state.
        keep_text: Keep the rendered text of the token view (text-mode observations).
        tools: The episode's tool session (their schemas are rendered into the prompt), if the env has tools.
    """

    def __init__(
        self,
        chat_tokenizer: ChatTokenizer,
        task: Task,
        messages: list[dict[str, Any]],
        state: Any,
        *,
        keep_text: bool = False,
        tools: ToolSession | None = None,
    ):
        self.tools = tools
        self.tool_schemas = tools.box.schemas() if tools is not None else None
        self.chat = EpisodeState(chat_tokenizer, messages, tools=self.tool_schemas, keep_text=keep_text)
        self.chat_tokenizer = chat_tokenizer
        self.task = task
        self.state = state
        self.turn = 0
        self.rewards: list[float] = []
        #: with ``rerender``, a drifting turn replaces the context with a fresh render and starts a new segment
        self.rerender = False
        self.segment = 0

    @classmethod
    def start(
        cls,
        task: Task,
        chat_tokenizer: ChatTokenizer,
        rng: np.random.Generator,
        options: Any,
        *,
        keep_text: bool,
        tools: Toolbox | None = None,
    ) -> ChatEpisode:
        """A new episode: from ``options["messages"]`` (task state from ``task.state_for``) or drawn by the task."""
        messages, state = open_chat(task, rng, options)
        session = tools.open(state) if tools is not None else None
        try:
            return cls(chat_tokenizer, task, messages, state, keep_text=keep_text, tools=session)
        except BaseException:
            if session is not None:
                session.close()
            raise

    def fork(self) -> ChatEpisode:
        """An independent episode at the same point: the chat, the task's state, the token view, the tools' state.

        The chat tokenizer, the task object and the tool schemas are shared (they hold no episode state).

        Raises:
            TypeError: If the task state or a per-episode tool object cannot be copied.
        """
        new = copy.copy(self)
        try:
            new.state = copy.deepcopy(self.state)
        except Exception as e:
            raise TypeError(
                f"the task state of this episode ({type(self.state).__name__}) cannot be copied ({e}); keep task "
                "state in plain data (dicts, lists, numbers, arrays) so episodes can be forked"
            ) from e
        new.chat = self.chat.fork()
        new.rewards = list(self.rewards)
        new.tools = self.tools.fork() if self.tools is not None else None
        return new

    # ------------------------------------------------------------------------------------------ views

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat so far (copies of the messages)."""
        return self.chat.messages

    @property
    def num_tokens(self) -> int:
        """Length of the token view."""
        return self.chat.num_tokens

    @property
    def token_ids(self) -> npt.NDArray[np.int64]:
        """The token view: every id the model has seen or produced, ending with an open assistant header."""
        return self.chat.token_ids

    @property
    def assistant_mask(self) -> npt.NDArray[np.bool_]:
        """True on the token view's ids the assistant produced."""
        return self.chat.assistant_mask

    @property
    def text(self) -> str:
        """The token view as text (kept only with ``keep_text``)."""
        return self.chat.text

    def view(self, in_progress: Sequence[int] = ()) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """The token view and its assistant mask, with a reply in progress appended (its ids are the model's)."""
        return self.chat.view(in_progress)

    # ------------------------------------------------------------------------------------------ replies

    @property
    def call_id_prefix(self) -> str:
        """Prefix of the ids given to the tool calls of the next reply (unique within the episode)."""
        return f"call_{self.turn}_"

    def reply_from_ids(self, ids: Sequence[int]) -> tuple[dict[str, Any], bool]:
        """The assistant message that generated ``ids`` spell, and whether they ended the turn."""
        ct = self.chat_tokenizer
        message = ct.parse_response(list(ids), call_id_prefix=self.call_id_prefix)[0]
        reply = {"role": "assistant", "content": message.get("content", "")}
        if message.get("reasoning_content"):
            reply["reasoning_content"] = message["reasoning_content"]
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        return reply, ct.reply_end(ids)[1]

    def reply_from_message(self, message: Any) -> tuple[dict[str, Any], list[int], bool]:
        """A reply given as text or a message dict: the message, its ids, and whether it ended its turn.

        The ids are those a model would have generated for it. A message with ``is_complete: False`` (a cut
        reply) stands for its content's ids alone: no end-of-turn token is invented for it (the env closes the
        turn with unmasked markup, as for cut generated ids).
        """
        given = {"role": "assistant", "content": message} if isinstance(message, str) else message
        reply = check_message(given, "the action")
        if reply["role"] != "assistant":
            raise ValueError(f"the action is the assistant's reply; got a message with role {reply['role']!r}")
        complete = reply.pop("is_complete", True)
        if complete:
            return reply, self.chat.reply_ids(reply), True
        if reply.get("tool_calls"):
            raise ValueError("a cut reply (is_complete=False) cannot carry finished tool calls; send its text only")
        ids = self.chat_tokenizer.encode_content(reply["content"])
        if not ids:
            raise ValueError("a cut reply (is_complete=False) needs some content: it stands for the ids generated")
        return reply, ids, False

    # ------------------------------------------------------------------------------------------ turns

    def plan(self, reply: dict[str, Any], ids: list[int], complete: bool, *, continue_chat: bool = True) -> Turn:
        """Let the task answer ``reply`` (on a copy of its state) and compute the continuation; change nothing.

        Args:
            reply: The assistant's message.
            ids: Its token ids.
            complete: Whether the reply ended its turn.
            continue_chat: Compute the continuation (False when the episode ends with this turn anyway).

        Raises:
            TypeError: If the task does not return a :class:`~chatenv.tasks.TaskResponse`.
            ValueError: For a non-finite reward or bad messages from the task.
        """
        calls = self._tool_calls(ids, complete)
        if calls is not None:
            return self._plan_tools(calls, reply, ids, complete, continue_chat)
        state = copy.deepcopy(self.state)
        name = type(self.task).__name__
        messages = [*self.chat.held_messages(), reply]
        extra: dict[str, Any] = {}
        if getattr(self.task, "uses_tool_stats", False):  # tool tasks score the episode's tool use too
            extra["tool_stats"] = self.tools.stats if self.tools else None
        response = self.task.respond(messages, state, **extra)
        if not isinstance(response, TaskResponse):
            raise TypeError(f"{name}.respond must return a TaskResponse, got {type(response).__name__}")
        _check_reward(response, name)
        new = check_messages(response.messages, f"{name}.respond() messages", allow_empty=True)
        turn = Turn(response, Extension(reply, list(ids), complete, new), state=state)
        if continue_chat:
            self.continue_turn(turn)
        return turn

    def _plan_tools(
        self, calls: ParsedCalls, reply: dict[str, Any], ids: list[int], complete: bool, continue_chat: bool
    ) -> Turn:
        """A reply with tool calls: the episode's tool session answers it (the task is not asked)."""
        assert self.tools is not None  # calls are read only when the episode has tools
        calls, reply = _with_call_ids(calls, reply)
        tool_turn = self.tools.run(calls.items)
        info = {"tool_error": True} if tool_turn.terminate else {}
        response = TaskResponse(0.0, tool_turn.terminate, tool_turn.messages, info=info)
        ext = Extension(reply, list(ids), complete, tool_turn.messages)
        turn = Turn(response, ext, state=self.state, tools=tool_turn)
        if continue_chat:
            try:
                self.continue_turn(turn)
            except TemplateError:
                if calls.canonical:
                    raise
                # the template answers tool messages only after an assistant message with tool_calls (gpt-oss,
                # Llama 3.1, ...): the reply is shown with its calls as data (its ids stay as generated)
                ext.reply = _calls_as_data(calls, reply)
                self.continue_turn(turn)
        return turn

    def _tool_calls(self, ids: Sequence[int], complete: bool) -> ParsedCalls | None:
        """The reply's tool calls when the env has tools and the reply is complete and makes some; else None."""
        if self.tools is None or not complete:
            return None
        ct = self.chat_tokenizer
        end = ct.reply_end(ids)[0]
        calls = ct.parse_tool_calls(list(ids)[:end], id_prefix=self.call_id_prefix)
        return calls if calls.items else None

    def continue_turn(self, turn: Turn) -> None:
        """Compute the ids that follow a planned turn: closing markup if cut, the new messages, the next header."""
        self.chat.continue_(turn.ext, rerender=self.rerender)

    def tokens_after(self, turn: Turn) -> int:
        """Length of the token view once ``turn`` is committed."""
        return self.chat.tokens_after(turn.ext)

    def commit(self, turn: Turn) -> None:
        """Apply a planned turn (cannot fail)."""
        if self.chat.commit(turn.ext):  # a fresh render replaced the context: a new segment
            self.segment += 1
        self.state = turn.state
        self.turn += 1
        self.rewards.append(turn.reward)
        if turn.tools is not None and self.tools is not None:
            self.tools.commit(turn.tools)

    def close(self) -> None:
        """Close the episode's tools (per-episode tool objects); safe to call twice."""
        if self.tools is not None:
            self.tools.close()

    def render(self, in_progress: Sequence[int] = ()) -> str:
        """The chat as text, with an unfinished reply's ids shown at the end."""
        text = "".join(f"[{m['role']}]\n{m['content']}\n\n" for m in self.chat.messages)
        if in_progress:
            text += f"[assistant, in progress]\n{self.chat_tokenizer.decode(list(in_progress))}\n"
        return text


def _check_reward(response: TaskResponse, name: str) -> None:
    try:
        reward = float(response.reward)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}.respond returned a reward that is not a number: {response.reward!r}") from e
    if not math.isfinite(reward):
        raise ValueError(f"{name}.respond returned a non-finite reward {reward}; rewards must be finite numbers")
    if not isinstance(response.components, Mapping):
        raise TypeError(
            f"{name}.respond returned reward components of type {type(response.components).__name__}; give a dict "
            "of name -> number (or leave them out)"
        )
    for key, value in dict(response.components).items():
        try:
            ok = math.isfinite(float(value))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(
                f"{name}.respond returned reward component {key!r} = {value!r}; it must be a finite number"
            )


def _calls_as_data(calls: ParsedCalls, reply: dict[str, Any]) -> dict[str, Any]:
    """A non-canonical tool reply as ``content`` + ``tool_calls`` (for templates that need them before tool messages).

    A malformed call keeps what could be read of it: its tool's name (if any), no arguments.
    """
    entries = [
        item.to_message()
        if isinstance(item, ToolCall)
        else {"id": item.id, "type": "function", "function": {"name": item.name or "", "arguments": {}}}
        for item in calls.items
    ]
    message = {"role": "assistant", "content": calls.content, "tool_calls": entries}
    if reply.get("reasoning_content"):
        message["reasoning_content"] = reply["reasoning_content"]
    return message


def _with_call_ids(calls: ParsedCalls, reply: dict[str, Any]) -> tuple[ParsedCalls, dict[str, Any]]:
    """The calls and the reply message for a reply with tool calls (read from its ids).

    Calls exactly as the template writes them give ``content`` + ``tool_calls``; the ids that a given message's
    calls carried are kept (and answered). Otherwise the reply keeps its whole text: nothing the model wrote is
    dropped, and the readable calls still run.
    """
    if not calls.canonical:
        return calls, {"role": "assistant", "content": reply["content"]}
    given = [c.get("id") if isinstance(c, dict) else None for c in reply.get("tool_calls") or []]
    items = []
    for k, item in enumerate(calls.items):
        if k < len(given) and isinstance(item, ToolCall) and given[k]:
            item = dataclasses.replace(item, id=str(given[k]))
        items.append(item)
    calls = dataclasses.replace(calls, items=tuple(items))
    message = {"role": "assistant", "content": calls.content, "tool_calls": [c.to_message() for c in calls.calls]}
    if reply.get("reasoning_content"):
        message["reasoning_content"] = reply["reasoning_content"]
    return calls, message
