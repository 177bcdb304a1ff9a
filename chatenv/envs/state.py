"""One token-exact chat: the episode state that envs, the endpoint's sessions and agent episodes all keep.

An :class:`EpisodeState` is a chat's messages and its token view: every id the model has seen or produced, the
assistant mask over them (True on generated ids), their generation log-probs (NaN where there are none: prompts,
markup, replies given without them) and, when asked, the rendered text. It is opened by rendering the first
messages, ending in an open assistant header (:meth:`EpisodeState.__init__`), and grows only by
:class:`Extension` objects: a reply (its ids kept verbatim) and the messages that answer it, of which only the new
tokens are appended (:meth:`~chatenv.tokenization.ChatTokenizer.continuation`), never a re-rendering of the chat.
An extension is planned first (:meth:`EpisodeState.plan` computes everything and changes nothing) and committed
last (:meth:`EpisodeState.commit` cannot fail), so a step that raises leaves the state exactly as it was.

:func:`open_chat` draws an episode's opening (the task's, or ``reset(options={"messages": ...})``) for every kind of
episode: :class:`~chatenv.envs.episode.ChatEpisode` (turn- and token-level envs) and
:class:`~chatenv.serve.AgentEnv`; the capture endpoint's segments (:mod:`chatenv.serve.sessions`) are
episode states opened from a request's messages.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from chatenv.envs.buffer import TokenBuffer
from chatenv.history import History
from chatenv.messages import check_messages
from chatenv.tasks import Task
from chatenv.tokenization import ChatTokenizer, EncodedChat

__all__ = ["EpisodeState", "Extension", "check_reset_options", "open_chat"]

Message = dict[str, Any]


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
    checked_options: dict[str, Any] = dict(options)
    if "messages" in checked_options:
        messages = checked_options["messages"]
        if isinstance(messages, History):
            if messages.batch_dims != 1:
                raise ValueError(f"options['messages'] as a History must be one chat (n,), got {tuple(messages.shape)}")
            messages = messages.to_chats()
        checked_options["messages"] = check_messages(messages, "options['messages']")
    return checked_options


def open_chat(task: Task | None, rng: np.random.Generator, options: Any) -> tuple[list[Message], Any]:
    """An episode's opening chat and the task's state for it.

    ``options["messages"]`` when given (the task's state from ``task.state_for``), else drawn by ``task.reset``.

    Args:
        task: The episode's task; None for episodes whose opening is always given (no state then).
        rng: The generator the task draws from.
        options: The reset options (checked by :func:`check_reset_options`).

    Raises:
        TypeError, ValueError: For bad options or bad messages from the task; ValueError when there is no task and
            no opening was given.
    """
    options = check_reset_options(options)
    if "messages" in options:
        messages = options["messages"]
        return messages, (task.state_for(messages, options) if task is not None else None)
    if task is None:
        raise ValueError(
            "there is no task to draw an opening from: an episode without a task needs its opening, given as "
            "reset(options={'messages': [...]})"
        )
    start = task.reset(rng)
    return check_messages(start.messages, f"{type(task).__name__}.reset() messages"), start.state


@dataclass
class Extension:
    """A planned (not yet committed) growth of an episode state: a reply and the messages that answer it.

    Attributes:
        reply: The assistant's message, as the chat records it.
        ids: The reply's token ids (verbatim when generated).
        complete: Whether the reply ended its turn (an end-of-turn id), rather than being cut.
        new_messages: The messages answering the reply (user, tool, ...), checked.
        log_probs: The reply's generation log-probs, one per id (None: not known, recorded as NaN).
        cont_ids: Ids appended after the reply: its closing markup if cut, the new messages, the next header.
        cont_mask: Assistant mask of ``cont_ids``.
        cont_text: Text of ``cont_ids``.
        drift: Tokens of the reply that a fresh render of the chat writes differently (templates that rewrite
            earlier turns); the kept ids stay as sampled. 0 when none.
        fresh: With ``rerender`` and a drifting reply, a fresh render of the whole chat that replaces the token
            view at commit (a new segment).
        messages: The chat after the extension (default: the chat, the reply, the new messages).
    """

    reply: Message
    ids: list[int]
    complete: bool
    new_messages: list[Message] = field(default_factory=list)
    log_probs: list[float] | None = None
    cont_ids: list[int] = field(default_factory=list)
    cont_mask: list[bool] = field(default_factory=list)
    cont_text: str = ""
    drift: int = 0
    fresh: EncodedChat | None = None
    messages: list[Message] | None = None

    @property
    def num_tokens(self) -> int:
        """Ids the extension appends: the reply's and the continuation's."""
        return len(self.ids) + len(self.cont_ids)


class EpisodeState:
    """One token-exact chat: messages, token ids, assistant mask, log-probs (and text).

    Args:
        chat_tokenizer: Renders the chat and its continuations.
        messages: The opening chat (checked).
        tools: Tool schemas rendered into the prompt, or None.
        keep_text: Keep the rendered text of the token view.
        generated_mask: Mark only the ids of replies appended to this state (what the capture endpoint records:
            the ids generated here); False (default): the template's assistant spans, so assistant messages of the
            opening and of later messages are marked too (what envs observe).
    """

    def __init__(
        self,
        chat_tokenizer: ChatTokenizer,
        messages: Sequence[Message],
        *,
        tools: list[Any] | None = None,
        keep_text: bool = False,
        generated_mask: bool = False,
    ):
        enc = chat_tokenizer.encode(list(messages), add_generation_prompt=True, tools=tools)
        self.chat_tokenizer = chat_tokenizer
        self.tools = tools
        self.generated_mask = generated_mask
        self._messages = [dict(m) for m in messages]
        mask = np.zeros(len(enc.ids), dtype=bool) if generated_mask else enc.assistant_mask.numpy()
        self._tokens = TokenBuffer(enc.ids.numpy(), mask, enc.text if keep_text else None)

    def fork(self) -> EpisodeState:
        """An independent copy (the chat tokenizer and the tool schemas are shared: they hold no episode state)."""
        new = copy.copy(self)
        vars(new).update(_messages=copy.deepcopy(self._messages), _tokens=copy.deepcopy(self._tokens))
        return new

    # ------------------------------------------------------------------------------------------ views

    @property
    def messages(self) -> list[Message]:
        """The chat so far (copies of the messages)."""
        return [dict(m) for m in self._messages]

    def held_messages(self) -> list[Message]:
        """The chat's messages as held: a new list of the same dicts (read them; never change them).

        What a task is shown each turn: copying every message of a long chat per step would make a step cost the
        length of the chat.
        """
        return list(self._messages)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def num_tokens(self) -> int:
        """Length of the token view."""
        return len(self._tokens)

    @property
    def token_ids(self) -> npt.NDArray[np.int64]:
        """Every id the model has seen or produced, ending with an open assistant header."""
        return self._tokens.ids()

    @property
    def assistant_mask(self) -> npt.NDArray[np.bool_]:
        """True on the ids the assistant produced."""
        return self._tokens.mask()

    @property
    def log_probs(self) -> npt.NDArray[np.float64]:
        """The generation log-prob of each id (NaN where none was recorded)."""
        return self._tokens.log_probs()

    @property
    def text(self) -> str:
        """The token view as text (kept only with ``keep_text``)."""
        return self._tokens.text

    def view(self, in_progress: Sequence[int] = ()) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """The token view and its assistant mask, with a reply in progress appended (its ids are the model's)."""
        return self._tokens.ids(in_progress), self._tokens.mask(len(in_progress))

    def view_after(self, ext: Extension) -> tuple[list[int], list[bool], list[float]]:
        """Ids, assistant mask and log-probs the state will hold once ``ext`` is committed (changes nothing)."""
        lps = [float("nan")] * len(ext.ids) if ext.log_probs is None else list(ext.log_probs)
        ids = self._tokens.ids(ext.ids + ext.cont_ids).tolist()
        mask = [*self._tokens.mask().tolist(), *([True] * len(ext.ids)), *ext.cont_mask]
        log_probs = [*self._tokens.log_probs().tolist(), *lps, *([float("nan")] * len(ext.cont_ids))]
        return ids, mask, log_probs

    def reply_ids(self, reply: Message) -> list[int]:
        """The ids a model would have generated for the complete reply ``reply`` after this chat."""
        return self.chat_tokenizer.reply(self._messages, reply, tools=self.tools).ids.tolist()

    # ------------------------------------------------------------------------------------------ growth

    def plan(
        self,
        reply: Message,
        ids: Sequence[int],
        complete: bool,
        new_messages: Sequence[Message] = (),
        *,
        log_probs: Sequence[float] | None = None,
        rerender: bool = False,
    ) -> Extension:
        """The extension by ``reply`` (its ids) and ``new_messages``, its continuation computed; changes nothing.

        Raises:
            ValueError: If ``log_probs`` and ``ids`` differ in length.
            TemplateError: If the template cannot write the new messages after the chat.
        """
        if log_probs is not None and len(log_probs) != len(ids):
            raise ValueError(f"{len(log_probs)} log-probs for a reply of {len(ids)} ids: give one per id")
        ext = Extension(
            reply, list(ids), complete, list(new_messages), None if log_probs is None else [float(v) for v in log_probs]
        )
        self.continue_(ext, rerender=rerender)
        return ext

    def continue_(self, ext: Extension, *, rerender: bool = False) -> None:
        """Compute the ids that follow the reply of ``ext``: closing markup if cut, the new messages, the next header.

        With ``rerender``, a reply that a fresh render writes differently also gets that fresh render (``fresh``),
        which replaces the token view at commit.
        """
        cont = self.chat_tokenizer.continuation(
            [*self._messages, ext.reply],
            ext.new_messages,
            generation_complete=ext.complete,
            tools=self.tools,
            reply_ids=ext.ids,
        )
        ext.cont_ids, ext.cont_text = cont.ids.tolist(), cont.text
        ext.cont_mask = [False] * len(ext.cont_ids) if self.generated_mask else cont.assistant_mask.tolist()
        ext.drift = cont.drift
        if rerender and ext.drift:
            chat = [*self._messages, ext.reply, *ext.new_messages]
            ext.fresh = self.chat_tokenizer.encode(chat, add_generation_prompt=True, tools=self.tools)

    def tokens_after(self, ext: Extension) -> int:
        """Length of the token view once ``ext`` is committed."""
        if ext.fresh is not None:
            return len(ext.fresh.ids)
        return len(self._tokens) + ext.num_tokens

    def commit(self, ext: Extension) -> bool:
        """Apply a planned extension (cannot fail); True when a fresh render replaced the token view."""
        self._messages = (
            [dict(m) for m in ext.messages]
            if ext.messages is not None
            else [*self._messages, ext.reply, *ext.new_messages]
        )
        if ext.fresh is not None:
            keep = ext.fresh.text if self._tokens.has_text else None
            fresh_ids = ext.fresh.ids.numpy()
            mask = np.zeros(len(fresh_ids), dtype=bool) if self.generated_mask else ext.fresh.assistant_mask.numpy()
            self._tokens = TokenBuffer(fresh_ids, mask, keep)
            return True
        text = self.chat_tokenizer.decode(ext.ids) + ext.cont_text if self._tokens.has_text else ""
        lps = None if ext.log_probs is None else [*ext.log_probs, *([float("nan")] * len(ext.cont_ids))]
        self._tokens.extend(ext.ids + ext.cont_ids, [True] * len(ext.ids) + ext.cont_mask, text, lps)
        return False
