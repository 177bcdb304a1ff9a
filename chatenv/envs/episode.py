"""One episode of a chat: the machinery shared by the turn-level and the token-level env.

:class:`ChatEpisode` holds the chat, the task's state and the token-in/token-out (TITO) view: the ids the
model has seen and produced, and the assistant mask over them. A turn is planned first (:meth:`ChatEpisode.plan`:
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from chatenv.envs.buffer import TokenBuffer
from chatenv.errors import TemplateError
from chatenv.history import History
from chatenv.messages import check_message, check_messages
from chatenv.tasks import Task, TaskResponse
from chatenv.templates.tool_calls import ParsedCalls, ToolCall
from chatenv.tokenization import ChatTokenizer
from chatenv.tools.runner import Toolbox, ToolSession, ToolTurn

__all__ = ["ChatEpisode", "Turn", "check_reset_options"]


def check_reset_options(options: Any) -> dict[str, Any]:
    """``reset(options=...)`` as a dict; ``options["messages"]`` (a list of message dicts or a History) checked.

    Raises:
        TypeError: For options that are not a mapping, or messages of the wrong type.
        ValueError: For an empty chat or a bad message.
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"reset options must be a dict (or None), got {type(options).__name__}")
    options = dict(options)
    if "messages" in options:
        messages = options["messages"]
        if isinstance(messages, History):
            if messages.batch_dims != 1:
                raise ValueError(f"options['messages'] as a History must be one chat (n,), got {tuple(messages.shape)}")
            messages = messages.to_chats()
        options["messages"] = check_messages(messages, "options['messages']")
    return options


@dataclass
class Turn:
    """A planned (not yet committed) assistant turn and the task's answer to it.

    Attributes:
        reply: The assistant's message.
        ids: The reply's token ids (verbatim when generated).
        complete: Whether the reply ended its turn (an end-of-turn id), rather than being cut.
        response: The task's answer (reward checked finite).
        new_messages: The task's messages, checked.
        cont_ids: Ids appended after the reply: its closing markup if cut, the new messages, the next header.
        cont_mask: Assistant mask of ``cont_ids``.
        cont_text: Text of ``cont_ids``.
        state: The task's state after answering (a copy; the episode's own is untouched until commit).
        tools: The results of the reply's tool calls (None when it made none; the task was not asked then).
        drift: Tokens of the reply that a fresh render of the chat writes differently (templates that rewrite
            earlier turns, e.g. drop past reasoning); the kept ids stay as sampled. 0 when none.
    """

    reply: dict[str, Any]
    ids: list[int]
    complete: bool
    response: TaskResponse
    new_messages: list[dict[str, Any]]
    cont_ids: list[int] = field(default_factory=list)
    cont_mask: list[bool] = field(default_factory=list)
    cont_text: str = ""
    state: Any = None
    tools: ToolTurn | None = None
    drift: int = 0
    fresh: Any = None

    @property
    def reward(self) -> float:
        """The task's reward for the turn."""
        return float(self.response.reward)


class ChatEpisode:
    """The state of one chat episode and its token view.

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
        enc = chat_tokenizer.encode(messages, add_generation_prompt=True, tools=self.tool_schemas)
        self.chat_tokenizer = chat_tokenizer
        self.task = task
        self._messages = messages
        self.state = state
        self._tokens = TokenBuffer(enc.ids.numpy(), enc.assistant_mask.numpy(), enc.text if keep_text else None)
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
        options = check_reset_options(options)
        if "messages" in options:
            messages = options["messages"]
            state = task.state_for(messages, options)
        else:
            start = task.reset(rng)
            messages, state = check_messages(start.messages, f"{type(task).__name__}.reset() messages"), start.state
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
        vars(new).update(_messages=copy.deepcopy(self._messages), _tokens=copy.deepcopy(self._tokens))
        new.rewards = list(self.rewards)
        new.tools = self.tools.fork() if self.tools is not None else None
        return new

    # ------------------------------------------------------------------------------------------ views

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The chat so far (copies of the messages)."""
        return [dict(m) for m in self._messages]

    @property
    def num_tokens(self) -> int:
        """Length of the token view."""
        return len(self._tokens)

    @property
    def token_ids(self) -> np.ndarray:
        """The token view: every id the model has seen or produced, ending with an open assistant header."""
        return self._tokens.ids()

    @property
    def assistant_mask(self) -> np.ndarray:
        """True on the token view's ids the assistant produced."""
        return self._tokens.mask()

    @property
    def text(self) -> str:
        """The token view as text (kept only with ``keep_text``)."""
        return self._tokens.text

    def view(self, in_progress: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The token view and its assistant mask, with a reply in progress appended (its ids are the model's)."""
        return self._tokens.ids(in_progress), self._tokens.mask(len(in_progress))

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
            ids = self.chat_tokenizer.reply(self._messages, reply, tools=self.tool_schemas).ids.tolist()
            return reply, ids, True
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
            calls, reply = _with_call_ids(calls, reply)
            tool_turn = self.tools.run(calls.items)
            info = {"tool_error": True} if tool_turn.terminate else {}
            response = TaskResponse(0.0, tool_turn.terminate, tool_turn.messages, info=info)
            turn = Turn(reply, list(ids), complete, response, tool_turn.messages, state=self.state, tools=tool_turn)
            if continue_chat:
                try:
                    self.continue_turn(turn)
                except TemplateError:
                    if calls.canonical:
                        raise
                    # the template answers tool messages only after an assistant message with tool_calls (gpt-oss,
                    # Llama 3.1, ...): the reply is shown with its calls as data (its ids stay as generated)
                    turn.reply = _calls_as_data(calls, reply)
                    self.continue_turn(turn)
            return turn
        messages = [*self._messages, reply]
        state = copy.deepcopy(self.state)
        name = type(self.task).__name__
        if getattr(self.task, "uses_tool_stats", False):
            response = self.task.respond(messages, state, tool_stats=self.tools.stats if self.tools else None)
        else:
            response = self.task.respond(messages, state)
        if not isinstance(response, TaskResponse):
            raise TypeError(f"{name}.respond must return a TaskResponse, got {type(response).__name__}")
        _check_reward(response, name)
        new = check_messages(response.messages, f"{name}.respond() messages", allow_empty=True)
        turn = Turn(reply, list(ids), complete, response, new, state=state)
        if continue_chat:
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
        cont = self.chat_tokenizer.continuation(
            [*self._messages, turn.reply],
            turn.new_messages,
            generation_complete=turn.complete,
            tools=self.tool_schemas,
            reply_ids=turn.ids,
        )
        turn.cont_ids, turn.cont_mask, turn.cont_text = cont.ids.tolist(), cont.assistant_mask.tolist(), cont.text
        turn.drift = cont.drift
        if self.rerender and turn.drift:
            chat = [*self._messages, turn.reply, *turn.new_messages]
            turn.fresh = self.chat_tokenizer.encode(chat, add_generation_prompt=True, tools=self.tool_schemas)

    def tokens_after(self, turn: Turn) -> int:
        """Length of the token view once ``turn`` is committed."""
        return len(self._tokens) + len(turn.ids) + len(turn.cont_ids)

    def commit(self, turn: Turn) -> None:
        """Apply a planned turn (cannot fail)."""
        self._messages = [*self._messages, turn.reply, *turn.new_messages]
        if turn.fresh is not None:  # a fresh render replaces the context: a new segment
            fresh = turn.fresh
            keep = fresh.text if self._tokens.has_text else None
            self._tokens = TokenBuffer(fresh.ids.numpy(), fresh.assistant_mask.numpy(), keep)
            self.segment += 1
        else:
            text = self.chat_tokenizer.decode(turn.ids) + turn.cont_text if self._tokens.has_text else ""
            self._tokens.extend(turn.ids + turn.cont_ids, [True] * len(turn.ids) + turn.cont_mask, text)
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
        text = "".join(f"[{m['role']}]\n{m['content']}\n\n" for m in self._messages)
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
