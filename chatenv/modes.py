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
from typing import Any

import numpy as np
import torch
from gymnasium.spaces import Space
from tensordict import NonTensorData, NonTensorStack, TensorDict

from chatenv.containers import ChatHistory, Masks, Text, Tokens
from chatenv.history import History
from chatenv.spaces import ChatText, MessagesSpace, TokenIds

__all__ = ["MODES", "HistoryMode", "InputMode", "TextMode", "TokensMode", "ViewRow", "get_mode", "read_strings"]


@dataclass
class ViewRow:
    """What the text/chat views of one (prompt, response) row are built from."""

    prompt_text: str | None = None
    response_text: str | None = None
    prompt_chat: list[dict] | None = None
    reply: list[dict] | None = None


def read_strings(value: Any, what: str) -> list[str]:
    """A list of str from a str, a list of str, or tensordict non-tensor data.

    Raises:
        TypeError: For anything else.
    """
    if isinstance(value, str):
        return [value]
    if isinstance(value, NonTensorData):
        return [value.data] if isinstance(value.data, str) else list(value.data)
    if isinstance(value, NonTensorStack):
        value = value.tolist()
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(f"{what}: expected text (a str or a list of str), got {type(value).__name__}")


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

    def spaces(self, vocab_size: int, max_tokens: int | None) -> tuple[Space, Space]:
        """The env's ``(observation_space, action_space)``."""
        raise NotImplementedError

    def observe(self, episode: Any) -> Any:
        """The observation of an episode (:class:`~chatenv.envs.episode.ChatEpisode`)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ policy side

    def split_batch(self, observations: Any) -> tuple[bool, list]:
        """``(single, batch)``: whether ``observations`` is one observation, and the list of them."""
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
            token_views: The envs' own ``(ids, assistant_mask)`` per row, if known: written as ``Tokens`` (prompt)
                at ``tokens_key`` and ``Masks`` at ``masks_key``, so the policy generates after exactly the ids
                the env holds (no re-tokenization of text, masks from the env's segments).
            tokens_key: Where the token view goes.
            masks_key: Where its assistant mask goes (None: not written).
        """
        td = TensorDict(batch_size=[len(observations)])
        self._set_input(td, observations, input_key, pad_token_id)
        if token_views is not None:
            ids = [torch.as_tensor(np.asarray(v[0], dtype=np.int64)) for v in token_views]
            tokens = Tokens.from_sequences(ids, padded=True, pad_value=pad_token_id)
            if tokens_key is not None and td.get(tokens_key, None) is None:
                td.set(tokens_key, tokens)
            if masks_key is not None:
                masks = [torch.as_tensor(np.asarray(v[1], dtype=bool)) for v in token_views]
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
            p = [r.prompt_text for r in rows]
            r_ = [r.response_text for r in rows]
            out["text"] = Text(
                prompt=NonTensorStack.from_list(p),
                response=NonTensorStack.from_list(r_),
                full=NonTensorStack.from_list([a + b for a, b in zip(p, r_)]),
                batch_size=[n],
            )
        if "history" in self.views:
            out["history"] = ChatHistory(
                prompt=History.from_chats([r.prompt_chat for r in rows]),
                response=History.from_chats([r.reply for r in rows]),
                full=History.from_chats([r.prompt_chat + r.reply for r in rows]),
                batch_size=[n],
            )
        return out


class HistoryMode(InputMode):
    """Observations are chats; the policy reads a :class:`~chatenv.history.History`."""

    name = "history"
    views = ("text", "history")

    def spaces(self, vocab_size: int, max_tokens: int | None) -> tuple[Space, Space]:  # noqa: D102
        return MessagesSpace(max_length=1 << 20), ChatText()

    def observe(self, episode: Any) -> Any:  # noqa: D102
        return episode.messages

    def split_batch(self, observations: Any) -> tuple[bool, list]:  # noqa: D102
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
        raise TypeError("history mode: expected a chat (a list of message dicts) or a list of chats")

    def _set_input(self, td, observations, input_key, pad_token_id) -> None:
        td.set(input_key, History.from_chats([list(o) for o in observations]))

    def action(self, response_ids: torch.Tensor, chat_tokenizer: Any) -> Any:  # noqa: D102
        return chat_tokenizer.parse_response(response_ids)[0]


class TextMode(InputMode):
    """Observations are the rendered prompt text."""

    name = "text"
    views = ("text",)

    def spaces(self, vocab_size: int, max_tokens: int | None) -> tuple[Space, Space]:  # noqa: D102
        return ChatText(), ChatText()

    def observe(self, episode: Any) -> Any:  # noqa: D102
        return episode.text

    def split_batch(self, observations: Any) -> tuple[bool, list]:  # noqa: D102
        if isinstance(observations, str):
            return True, [observations]
        return False, read_strings(observations, "text mode observations")

    def _set_input(self, td, observations, input_key, pad_token_id) -> None:
        td.set(input_key, NonTensorStack.from_list(read_strings(list(observations), "text mode observations")))

    def action(self, response_ids: torch.Tensor, chat_tokenizer: Any) -> Any:
        """The reply's text up to its stop id (the env writes the end-of-turn markup itself).

        A reply cut before any stop id comes as ``{"role": "assistant", "content": text, "is_complete": False}``
        so the env does not invent an end-of-turn token the model never sampled.
        """
        ids = [int(i) for i in response_ids]
        stops = set(chat_tokenizer.stop_ids)
        end = next((k for k, i in enumerate(ids) if i in stops), None)
        if end is None:
            return {"role": "assistant", "content": chat_tokenizer.decode(ids), "is_complete": False}
        return chat_tokenizer.decode(ids[:end])


class TokensMode(InputMode):
    """Observations are token ids; generated ids are the action, verbatim."""

    name = "tokens"
    takes_text = False

    def spaces(self, vocab_size: int, max_tokens: int | None) -> tuple[Space, Space]:  # noqa: D102
        return TokenIds(vocab_size, min_length=1), TokenIds(vocab_size, min_length=1, max_length=max_tokens)

    def observe(self, episode: Any) -> Any:  # noqa: D102
        return episode.token_ids

    def split_batch(self, observations: Any) -> tuple[bool, list]:  # noqa: D102
        if isinstance(observations, (torch.Tensor, np.ndarray)) and observations.ndim == 1:
            return True, [observations]
        if (
            isinstance(observations, Sequence)
            and observations
            and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in observations)
        ):
            return True, [observations]
        if isinstance(observations, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(observations, str):
            return False, list(observations)
        raise TypeError(f"tokens mode: expected token ids or a list of them, got {type(observations).__name__}")

    def _set_input(self, td, observations, input_key, pad_token_id) -> None:
        rows = [_id_tensor(o, b) for b, o in enumerate(observations)]
        if isinstance(input_key, tuple) and len(input_key) >= 2 and input_key[-1] == "prompt":
            tokens = Tokens.from_sequences(rows, padded=True, pad_value=pad_token_id)
            td.set(input_key[:-1] if len(input_key) > 2 else input_key[0], tokens)
        else:
            td.set(input_key, torch.nested.as_nested_tensor(rows, layout=torch.jagged))

    def action(self, response_ids: torch.Tensor, chat_tokenizer: Any) -> Any:  # noqa: D102
        return np.asarray(response_ids, dtype=np.int64)


def _id_tensor(observation: Any, b: int) -> torch.Tensor:
    arr = np.asarray(observation.detach().cpu() if isinstance(observation, torch.Tensor) else observation)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(
            f"tokens mode: observation {b} must be a 1-D sequence of integer token ids, got dtype {arr.dtype} and "
            f"shape {arr.shape}"
        )
    return torch.as_tensor(arr.astype(np.int64))


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
