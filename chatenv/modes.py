"""Input modes as objects: observations, policy inputs, env actions and the text/chat views of a batch.

Each mode says what an observation is, how observations become a policy's input, how a policy's output becomes
an env action, and which text/chat views a batch has.

The user-facing argument stays a string (``input_mode="tokens"``); :func:`get_mode` turns it into one of

- :class:`HistoryMode` (``"history"``): observations are chats (lists of message dicts), actions the reply;
- :class:`TextMode` (``"text"``): observations are the rendered prompt, actions the reply's text;
- :class:`TokensMode` (``"tokens"``): observations are int64 token ids, actions the generated ids (verbatim).

Envs (:class:`~chatenv.envs.ChatEnv`), :func:`~chatenv.rollout` and the policy wrappers all ask the mode object,
so each mode's behaviour lives in one class.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
from gymnasium.spaces import Space
from tensordict import NonTensorData, NonTensorStack, TensorDict

from chatenv.containers import ChatHistory, Masks, Text, Tokens
from chatenv.history import History
from chatenv.ids import check_id_dtype, token_id_array
from chatenv.spaces import ChatText, MessagesSpace, TokenIds

__all__ = [
    "MODES",
    "TOKEN_VIEW_KEY",
    "PromptText",
    "attached_views",
    "HistoryMode",
    "InputMode",
    "TextMode",
    "TokensMode",
    "ViewRow",
    "get_mode",
    "read_strings",
]

TOKEN_VIEW_KEY = "token_view"
"""Where :meth:`InputMode.policy_input` marks the env's own token view: a ``(B,)`` bool entry, True where the
``Tokens`` prompt at the tokens key (and the ``Masks`` at the masks key) are the env's ids and assistant mask, so
the policy generates after exactly those ids (no re-tokenization, no consistency check against the text)."""

_HINTS = {
    "text": "text prompts are read by input_mode='text'",
    "history": "chats (lists of message dicts) are read by input_mode='history'",
    "tokens": "token ids are read by input_mode='tokens'",
}


@dataclass
class ViewRow:
    """What the text/chat views of one (prompt, response) row are built from."""

    prompt_text: str | None = None
    response_text: str | None = None
    prompt_chat: list[dict[str, Any]] | None = None
    reply: list[dict[str, Any]] | None = None


T = TypeVar("T")


def _given(value: T | None, name: str) -> T:
    """A view row's field that the mode's views need (rows are built with every field a mode's views read)."""
    if value is None:
        raise ValueError(f"a view row is missing {name}, which this input mode's views are built from")
    return value


def read_strings(value: Any, what: str) -> list[str]:
    """A list of str from a str, a list of str, or tensordict non-tensor data.

    Args:
        value: The text.
        what: What ``value`` is, for messages.

    Raises:
        TypeError: For anything else, naming the first value that is not a str.

    Example:
        >>> read_strings(NonTensorStack.from_list(["a", "b"]), "prompts")
        ['a', 'b']
    """
    if isinstance(value, str):
        return [value]
    if isinstance(value, NonTensorData):
        value = value.data
        if isinstance(value, str):
            return [value]
    if isinstance(value, NonTensorStack):
        value = value.tolist()
    if not isinstance(value, Sequence) or isinstance(value, bytes):
        raise TypeError(f"{what}: expected text (a str or a list of str), got {type(value).__name__}")
    for b, v in enumerate(value):
        if not isinstance(v, str):
            raise TypeError(f"{what}: expected text (a str per row), got {type(v).__name__} {v!r:.60} at row {b}")
    return list(value)


def _is_scalar(x: Any) -> bool:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x.ndim == 0
    return isinstance(x, (int, float, np.number, np.bool_))


def _is_chat(value: Any) -> bool:
    """A message dict, a chat (a non-empty list of message dicts) or a :class:`History`."""
    if isinstance(value, (Mapping, History)):
        return True
    return isinstance(value, Sequence) and not isinstance(value, str) and bool(value) and isinstance(value[0], Mapping)


def _is_ids_like(value: Any) -> bool:
    return _is_scalar(value) or isinstance(value, (Sequence, np.ndarray, torch.Tensor))


def _kind(value: Any) -> str:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return f"{type(value).__name__} of dtype {value.dtype} and shape {tuple(value.shape)}"
    return type(value).__name__


def _observed_ids(value: Any, what: str) -> torch.Tensor:
    """One tokens-mode observation as an int64 tensor; text and chats are refused naming the mode that reads them."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{what} must be token ids, got a str ({value[:40]!r}); {_HINTS['text']}")
    if _is_chat(value):
        raise TypeError(f"{what} must be token ids, got message dicts (a chat); {_HINTS['history']}")
    return torch.tensor(token_id_array(value, what))


def _read_views(views: Sequence[tuple[Any, Any]], n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The ``(ids, assistant_mask)`` token views of ``n`` rows, checked."""
    if len(views) != n:
        raise ValueError(f"got {len(views)} token views for {n} observations; give one (ids, mask) per observation")
    ids, masks = [], []
    for b, view in enumerate(views):
        if not isinstance(view, (tuple, list)) or len(view) != 2:
            raise TypeError(f"token view {b} must be a pair (ids, assistant_mask) as env.token_view() returns it")
        row = token_id_array(view[0], f"token view {b}")
        mask = np.asarray(view[1].detach().cpu() if isinstance(view[1], torch.Tensor) else view[1])
        if mask.dtype != np.bool_:
            raise TypeError(f"token view {b}: the assistant mask must hold bools, got {mask.dtype}")
        if mask.shape != row.shape:
            raise ValueError(f"token view {b}: the assistant mask has shape {mask.shape}, the ids {row.shape}")
        ids.append(torch.tensor(row))
        masks.append(torch.tensor(mask))
    return ids, masks


class InputMode:
    """Base of the three modes; subclasses fill in the mode-specific parts.

    Attributes:
        name: The user-facing name.
        takes_text: Whether envs accept text and message-dict actions (not in tokens mode, where the generated
            ids are the action, verbatim).
        views: Which views of a batch the mode produces (``"text"``, ``"history"``).
    """

    name: str = ""
    takes_text: bool = True
    views: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ------------------------------------------------------------------------------------------ env side

    def spaces(self, vocab_size: int, max_tokens: int | None) -> tuple[Space[Any], Space[Any]]:
        """The env's ``(observation_space, action_space)``."""
        raise NotImplementedError

    def observe(self, episode: Any) -> Any:
        """The observation of an episode (:class:`~chatenv.envs.episode.ChatEpisode`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ policy side

    def split_batch(self, observations: Any) -> tuple[bool, list[Any]]:
        """``(single, batch)``: whether ``observations`` is one observation, and the batch as a list.

        Observations of another input mode are refused with the mode that reads them; in tokens mode every
        observation is read strictly (:func:`chatenv.ids.token_id_array`) and returned as an int64 tensor.

        Raises:
            TypeError: For observations this mode does not read, or ids that are not integers.
        """
        raise NotImplementedError

    def policy_input(
        self,
        observations: Sequence[Any],
        *,
        input_key: Any,
        pad_token_id: int,
        token_views: Sequence[tuple[Any, Any]] | None = None,
        tokens_key: Any = "tokens",
        masks_key: Any = "masks",
    ) -> TensorDict:
        """A ``(B,)`` tensordict a policy reads, from a batch of env observations.

        Args:
            observations: One observation per row, as the env returned them.
            input_key: Where the policy reads its input.
            pad_token_id: Padding id of token tensors.
            token_views: The envs' own ``(ids, assistant_mask)`` per row, if known (``env.token_view()``): written
                as ``Tokens`` (prompt) at ``tokens_key`` and ``Masks`` at ``masks_key``, and marked as the env's
                view at :data:`TOKEN_VIEW_KEY`, so the policy generates after exactly the ids the env holds (no
                re-tokenization of text, masks from the env's segments).
            tokens_key: Where the token view goes.
            masks_key: Where its assistant mask goes (None: not written).

        Raises:
            TypeError: For views that are not integer ids with a bool mask.
            ValueError: For a number of views other than the number of observations, or a mask of another length
                than its ids.
        """
        td = TensorDict(batch_size=[len(observations)])
        self._set_input(td, observations, input_key, pad_token_id)
        if token_views is None:
            return td
        ids, masks = _read_views(token_views, len(observations))
        tokens = Tokens.from_sequences(ids, padded=True, pad_value=pad_token_id)
        if tokens_key is not None and td.get(tokens_key, None) is None:
            td.set(tokens_key, tokens)
            td.set(TOKEN_VIEW_KEY, torch.ones(len(observations), dtype=torch.bool))
        if masks_key is not None:
            td.set(masks_key, Masks.from_tokens(tokens, masks))
        return td

    def _set_input(self, td: TensorDict, observations: Sequence[Any], input_key: Any, pad_token_id: int) -> None:
        raise NotImplementedError

    def action(self, response_ids: torch.Tensor, chat_tokenizer: Any) -> Any:
        """The env action for one generated response (token ids)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ views

    def build_views(self, rows: Sequence[ViewRow]) -> dict[str, Any]:
        """The text/chat containers of a batch of rows, by view name (``"text"``, ``"history"``)."""
        out: dict[str, Any] = {}
        n = len(rows)
        if "text" in self.views:
            p = [_given(r.prompt_text, "prompt_text") for r in rows]
            r_ = [_given(r.response_text, "response_text") for r in rows]
            out["text"] = Text(
                prompt=NonTensorStack.from_list(p),
                response=NonTensorStack.from_list(r_),
                full=NonTensorStack.from_list([a + b for a, b in zip(p, r_)]),
                batch_size=[n],
            )
        if "history" in self.views:
            prompts = [_given(r.prompt_chat, "prompt_chat") for r in rows]
            replies = [_given(r.reply, "reply") for r in rows]
            out["history"] = ChatHistory(
                prompt=History.from_chats(prompts),
                response=History.from_chats(replies),
                full=History.from_chats([a + b for a, b in zip(prompts, replies)]),
                batch_size=[n],
            )
        return out


class HistoryMode(InputMode):
    """Observations are chats; the policy reads a :class:`~chatenv.history.History`."""

    name = "history"
    views = ("text", "history")

    def spaces(self, vocab_size: int, max_tokens: int | None) -> tuple[Space[Any], Space[Any]]:  # noqa: D102
        return MessagesSpace(max_length=1 << 20), ChatText()

    def observe(self, episode: Any) -> Any:  # noqa: D102
        return episode.messages

    def split_batch(self, observations: Any) -> tuple[bool, list[Any]]:  # noqa: D102
        if isinstance(observations, str):
            raise TypeError(f"history mode: expected a chat (a list of message dicts), got a str; {_HINTS['text']}")
        if isinstance(observations, (torch.Tensor, np.ndarray)) or (
            isinstance(observations, Sequence) and observations and all(_is_scalar(x) for x in observations)
        ):
            raise TypeError(
                f"history mode: expected a chat (a list of message dicts), got token ids; {_HINTS['tokens']}"
            )
        if isinstance(observations, History):
            chats = observations.to_chats()
            one = observations.batch_dims == 1
            return one, [chats] if one else chats
        if isinstance(observations, Sequence) and observations and all(isinstance(m, Mapping) for m in observations):
            return True, [list(observations)]
        if isinstance(observations, Sequence) and all(
            isinstance(c, Sequence) and not isinstance(c, str) for c in observations
        ):
            return False, [list(c) for c in observations]
        raise TypeError(
            f"history mode: expected a chat (a list of message dicts) or a list of chats, got {_kind(observations)}"
        )

    def _set_input(self, td: TensorDict, observations: Sequence[Any], input_key: Any, pad_token_id: int) -> None:
        td.set(input_key, History.from_chats([list(o) for o in observations]))

    def action(self, response_ids: torch.Tensor, chat_tokenizer: Any) -> Any:  # noqa: D102
        return chat_tokenizer.parse_response(response_ids)[0]


class PromptText(str):
    """A text-mode observation: the prompt text, carrying the env's token view it renders (``token_view``).

    It is a ``str`` in every way; ``token_view`` is the env's ``(ids, assistant_mask)`` at that observation, so a
    policy given the text alone (``policy.act(obs)``) still generates after exactly those ids: a message whose text
    spells the template's markup can never become markup by re-tokenizing the prompt.
    """

    token_view: tuple[Any, Any]

    def __new__(cls, text: str, token_view: tuple[Any, Any]) -> PromptText:  # noqa: D102
        out = super().__new__(cls, text)
        out.token_view = token_view
        return out

    def __reduce__(self) -> tuple[type[PromptText], tuple[str, tuple[Any, Any]]]:
        return (PromptText, (str(self), self.token_view))


def attached_views(observations: Any) -> list[tuple[Any, Any]] | None:
    """The token views text observations carry (:class:`PromptText`), or None unless every one carries one."""
    items = [observations] if isinstance(observations, str) else observations
    if not isinstance(items, (list, tuple)) or not items:
        return None
    views = [getattr(o, "token_view", None) for o in items]
    return None if any(v is None for v in views) else [v for v in views if v is not None]


class TextMode(InputMode):
    """Observations are the rendered prompt text (a :class:`PromptText` carrying the env's token view)."""

    name = "text"
    views = ("text",)

    def spaces(self, vocab_size: int, max_tokens: int | None) -> tuple[Space[Any], Space[Any]]:  # noqa: D102
        return ChatText(), ChatText()

    def observe(self, episode: Any) -> Any:  # noqa: D102
        return PromptText(episode.text, (episode.token_ids, episode.assistant_mask))

    def split_batch(self, observations: Any) -> tuple[bool, list[Any]]:  # noqa: D102
        if isinstance(observations, str):
            return True, [observations]
        if isinstance(observations, (NonTensorData, NonTensorStack)):
            return False, read_strings(observations, "text mode observations")
        if _is_chat(observations):
            raise TypeError(f"text mode: expected prompt text, got message dicts (a chat); {_HINTS['history']}")
        if not isinstance(observations, Sequence) or isinstance(observations, bytes):
            raise TypeError(f"text mode: expected a prompt (str) or a list of them, got {_kind(observations)}")
        for b, o in enumerate(observations):
            if not isinstance(o, str):
                hint = _HINTS["history"] if _is_chat(o) else _HINTS["tokens"] if _is_ids_like(o) else ""
                raise TypeError(
                    f"text mode: observation {b} must be a str, got {_kind(o)}" + (f"; {hint}" if hint else "")
                )
        return False, list(observations)

    def _set_input(self, td: TensorDict, observations: Sequence[Any], input_key: Any, pad_token_id: int) -> None:
        td.set(input_key, NonTensorStack.from_list(read_strings(list(observations), "text mode observations")))

    def action(self, response_ids: torch.Tensor, chat_tokenizer: Any) -> Any:
        """The reply's text up to its stop id (the env writes the end-of-turn markup itself).

        A reply cut before any stop id comes as ``{"role": "assistant", "content": text, "is_complete": False}``
        so the env does not invent an end-of-turn token the model never sampled.
        """
        ids = [int(i) for i in response_ids]
        end, _ = chat_tokenizer.reply_end(ids)
        if end is None:
            return {"role": "assistant", "content": chat_tokenizer.decode(ids), "is_complete": False}
        return chat_tokenizer.decode(ids[:end])


class TokensMode(InputMode):
    """Observations are token ids; generated ids are the action, verbatim."""

    name = "tokens"
    takes_text = False

    def spaces(self, vocab_size: int, max_tokens: int | None) -> tuple[Space[Any], Space[Any]]:  # noqa: D102
        return TokenIds(vocab_size, min_length=1), TokenIds(vocab_size, min_length=1, max_length=max_tokens)

    def observe(self, episode: Any) -> Any:  # noqa: D102
        return episode.token_ids

    def split_batch(self, observations: Any) -> tuple[bool, list[Any]]:  # noqa: D102
        what = "tokens mode observations"
        if isinstance(observations, (str, bytes)) or _is_chat(observations):
            _observed_ids(observations, what)
        if isinstance(observations, (torch.Tensor, np.ndarray)) and not getattr(observations, "is_nested", False):
            check_id_dtype(observations, what)
            if observations.ndim == 1:
                return True, [_observed_ids(observations, "observation 0")]
            if observations.ndim != 2:
                raise TypeError(
                    f"{what} must be one 1-D sequence of ids or a (B, T) batch of them, got shape "
                    f"{tuple(observations.shape)}"
                )
        elif not isinstance(observations, (Sequence, torch.Tensor)):
            raise TypeError(f"tokens mode: expected token ids or a list of them, got {_kind(observations)}")
        if len(observations) and all(_is_scalar(x) for x in observations):
            return True, [_observed_ids(observations, "observation 0")]
        return False, [_observed_ids(o, f"observation {b}") for b, o in enumerate(observations)]

    def _set_input(self, td: TensorDict, observations: Sequence[Any], input_key: Any, pad_token_id: int) -> None:
        rows = [_observed_ids(o, f"tokens mode: observation {b}") for b, o in enumerate(observations)]
        if isinstance(input_key, tuple) and len(input_key) >= 2 and input_key[-1] == "prompt":
            tokens = Tokens.from_sequences(rows, padded=True, pad_value=pad_token_id)
            td.set(input_key[:-1] if len(input_key) > 2 else input_key[0], tokens)
        else:
            td.set(input_key, torch.nested.as_nested_tensor(rows, layout=torch.jagged))

    def action(self, response_ids: torch.Tensor, chat_tokenizer: Any) -> Any:  # noqa: D102
        return np.asarray(response_ids, dtype=np.int64)


MODES: dict[str, InputMode] = {m.name: m for m in (HistoryMode(), TextMode(), TokensMode())}


def get_mode(mode: str | InputMode) -> InputMode:
    """The mode object for a name (or the object itself).

    Raises:
        ValueError: For an unknown name.

    Example:
        >>> get_mode("tokens").takes_text
        False
    """
    if isinstance(mode, InputMode):
        return mode
    if mode not in MODES:
        raise ValueError(f"input_mode must be one of {tuple(MODES)}, got {mode!r}")
    return MODES[mode]
