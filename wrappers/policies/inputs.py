"""Readers: a policy's input tensordict turned into rows of token ids, one reader per input mode.

- history: chats rendered and tokenized with the chat template (exact assistant masks); when scoring, the last
  assistant message is the response and ends where generation would have ended;
- text: rendered chat text, tokenized with special tokens recognised (text that spells markup becomes markup);
  the assistant mask comes from parsing the text with the template when that reproduces the same ids;
- history and text, when generating: the env's own token view (``Tokens`` with a prompt at the tokens key and
  ``Masks`` at the masks key, marked at :data:`~chatenv.modes.TOKEN_VIEW_KEY`; what :func:`chatenv.rollout` and
  ``act(..., token_views=...)`` pass through :meth:`~chatenv.modes.InputMode.policy_input`) is used instead, as
  is: no rendering, no re-tokenization, masks from the env's segments. Unmarked ids that sit at the tokens key are
  used only when they spell the same text;
- tokens: ids used verbatim, from :class:`~chatenv.containers.Tokens`, a padded ``(B, T)`` tensor with an
  attention mask, a nested tensor or a list of id tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

from chatenv.containers import Masks, Tokens
from chatenv.errors import ChatEnvError
from chatenv.history import History
from chatenv.ids import check_id_dtype, check_vocab, token_ids
from chatenv.modes import MODES, TOKEN_VIEW_KEY, read_strings
from chatenv.tokenization import ChatTokenizer
from wrappers.policies.config import PolicyConfig

__all__ = ["InputKeyError", "InputReader", "Row", "check_rows"]


class InputKeyError(ChatEnvError, KeyError):
    """A policy's input key is missing from its input (a ``KeyError`` whose message prints as written)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass
class Row:
    """One prompt (generation) or one full sequence (scoring), as ids.

    Attributes:
        ids: The token ids.
        assistant: Per id, whether the assistant produced it.
        split: ``ids[:split]`` is the prompt (all of ``ids`` when generating).
        text: The rendered text (history and text modes).
        chat: The messages (history mode).
    """

    ids: list[int]
    assistant: list[bool]
    split: int
    text: str | None = None
    chat: list[dict] | None = None


@dataclass
class _Given:
    """Prompt ids given next to text or chats: their assistant mask, and whether they are the env's own view."""

    ids: list[int]
    assistant: list[bool]
    env: bool


def _without_flags(chat: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k != "is_complete"} for m in chat]


class InputReader:
    """Reads the input of a policy call into :class:`Row` s, as its config says.

    Args:
        config: The policy's options (input mode and key, generate or score, mask keys).
        chat_tokenizer: The policy's chat tokenizer.
        pad_token_id: The pad id (to refuse padded id tensors that come without an attention mask).
    """

    def __init__(self, config: PolicyConfig, chat_tokenizer: ChatTokenizer, pad_token_id: int):
        self.config = config
        self.chat_tokenizer = chat_tokenizer
        self.pad_token_id = pad_token_id
        self.key = config.resolved_input_key

    def read(self, td: TensorDictBase) -> list[Row]:
        """The rows of a ``(B,)`` tensordict.

        Raises:
            InputKeyError: A ``KeyError``, if the input key is missing (with the keys present).
            TypeError, ValueError: If the input is not what the input mode reads.
        """
        c = self.config
        if self.key not in td.keys(include_nested=True, leaves_only=False):
            present = td.keys(include_nested=True, leaves_only=False)
            others = [m for m in MODES if m != c.input_mode and (m in present or (m, "prompt") in present)]
            hint = f" The input looks like input_mode={others[0]!r}." if others and c.input_key is None else ""
            raise InputKeyError(
                f"input key {self.key!r} not found (input_mode={c.input_mode!r}, generate={c.generate}); keys "
                f"present: {sorted(map(str, present))}. Pass input_key=... if it lives elsewhere.{hint}"
            )
        if c.input_mode == "history":
            rows = self._history(td.get(self.key), self._given_view(td))
        elif c.input_mode == "text":
            rows = self._text(td, td.get(self.key), self._given_view(td))
        else:
            rows = self._tokens(td)
        if len(rows) != td.batch_size[0]:
            raise ValueError(f"read {len(rows)} inputs for a batch of {td.batch_size[0]}")
        return rows

    # ------------------------------------------------------------------------------------ history

    def _given_view(self, td: TensorDictBase) -> list[_Given] | None:
        """Prompt ids and assistant masks given next to text or chats, and whether each is the env's own view.

        The env's view (marked at :data:`~chatenv.modes.TOKEN_VIEW_KEY` by
        :meth:`~chatenv.modes.InputMode.policy_input`) is used as is; ids that merely sit at the tokens key (a
        user's tensordict, a stale entry of another prompt) only when they spell the same text.

        Raises:
            TypeError: For a marker that is not a ``(B,)`` bool tensor.
            ValueError: For rows marked as the env's view without a ``Tokens`` prompt at the tokens key.
        """
        c = self.config
        if not c.generate:
            return None
        marked = self._marked(td)
        tokens = td.get(c.tokens_key, None)
        if not isinstance(tokens, Tokens) or tokens.batch_dims != 1 or not tokens.has("prompt"):
            if any(marked):
                raise ValueError(
                    f"{TOKEN_VIEW_KEY!r} marks rows as the env's token view, but {c.tokens_key!r} holds no Tokens with "
                    "a prompt; pass the views through InputMode.policy_input(token_views=...)"
                )
            return None
        ids = [p.tolist() for p in tokens.unpadded("prompt")]
        return [_Given(i, a, m) for i, a, m in zip(ids, self._given_assistant(td, ids), marked)]

    def _marked(self, td: TensorDictBase) -> list[bool]:
        n = td.batch_size[0]
        flag = td.get(TOKEN_VIEW_KEY, None)
        if flag is None:
            return [False] * n
        if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool or tuple(flag.shape) != (n,):
            got = (
                f"{flag.dtype} of shape {tuple(flag.shape)}" if isinstance(flag, torch.Tensor) else type(flag).__name__
            )
            raise TypeError(f"{TOKEN_VIEW_KEY!r} marks the env's token view: expected a ({n},) bool tensor, got {got}")
        return flag.tolist()

    def _history(self, value: Any, given: list | None = None) -> list[Row]:
        if not isinstance(value, History):
            raise TypeError(f"history mode: expected a History at {self.key!r}, got {type(value).__name__}")
        if value.batch_dims != 2:
            raise ValueError(f"history mode: expected a History of shape (B, messages), got {tuple(value.shape)}")
        ct = self.chat_tokenizer
        rows = []
        for b, chat in enumerate(value.to_chats()):
            chat = [m for m in chat if m is not None]
            if given is not None and given[b].env:
                # the env's own ids: authoritative (a template that trims content renders other text)
                rows.append(Row(given[b].ids, given[b].assistant, len(given[b].ids), ct.decode(given[b].ids), chat))
                continue
            if given is not None:
                text = ct.render(chat, add_generation_prompt=True).text
                if ct.decode(given[b].ids) == text:
                    rows.append(Row(given[b].ids, given[b].assistant, len(given[b].ids), text, chat))
                    continue
            if self.config.generate or not chat or chat[-1]["role"] != "assistant":
                enc = ct.encode(chat, add_generation_prompt=self.config.generate)
                rows.append(Row(enc.ids.tolist(), enc.assistant_mask.tolist(), len(enc.ids), enc.text, chat))
            else:
                rows.append(self._scored_chat(chat))
        return rows

    def _scored_chat(self, chat: list[dict]) -> Row:
        """A chat whose last assistant message is the response: its ids end where generation would have ended.

        That is after the end-of-turn token, or after the content of a cut-off (``is_complete=False``) message,
        without the template's trailing markup.
        """
        ct = self.chat_tokenizer
        head = ct.encode(chat[:-1], add_generation_prompt=True)
        if chat[-1].get("is_complete", True):
            enc = ct.encode(_without_flags(chat))
            end = int(enc.assistant_mask.nonzero()[-1]) + 1
            ids, mask = enc.ids[:end].tolist(), enc.assistant_mask[:end].tolist()
        else:
            content = ct.encode_content(chat[-1]["content"])
            ids = head.ids.tolist() + content
            mask = head.assistant_mask.tolist() + [True] * len(content)
        if ids[: len(head.ids)] != head.ids.tolist():
            raise ValueError(
                "history mode: the chat's prompt does not tokenize to a prefix of the full chat; score it in "
                "tokens mode instead"
            )
        return Row(ids, mask, len(head.ids), ct.decode(ids), chat)

    # ------------------------------------------------------------------------------------ text

    def _text(self, td: TensorDictBase, value: Any, given: list | None = None) -> list[Row]:
        texts = read_strings(value, f"text mode input {self.key!r}")
        prompts = self._scored_prompts(td)
        rows = []
        for b, text in enumerate(texts):
            if given is not None and (given[b].env or self.chat_tokenizer.decode(given[b].ids) == text):
                rows.append(Row(given[b].ids, given[b].assistant, len(given[b].ids), text))
                continue
            if prompts is not None and text.startswith(prompts[b]):
                head = self.chat_tokenizer.encode_markup(prompts[b])
                ids = head + self.chat_tokenizer.encode_markup(text[len(prompts[b]) :])
                split = len(head)
            else:
                ids = self.chat_tokenizer.encode_markup(text)
                split = len(ids)
            rows.append(Row(ids, self._text_assistant(text, ids), len(ids) if self.config.generate else split, text))
        return rows

    def _scored_prompts(self, td: TensorDictBase) -> list[str] | None:
        """When scoring ``(..., "full")`` text, the prompts next to it (they set the prompt/response split)."""
        key = self.key
        if self.config.generate or not isinstance(key, tuple) or key[-1] != "full":
            return None
        pkey = (*key[:-1], "prompt")
        if pkey not in td.keys(include_nested=True):
            return None
        return read_strings(td.get(pkey), f"text mode prompt {pkey!r}")

    def _text_assistant(self, text: str, ids: list[int]) -> list[bool]:
        """Assistant mask of rendered chat text: from the template's parse, when it reproduces the same ids."""
        ct = self.chat_tokenizer
        none = [False] * len(ids)
        try:
            chat = ct.template.parse(text)
            open_turn = bool(chat) and chat[-1].get("is_complete") is False
            enc = ct.encode(_without_flags(chat[:-1] if open_turn else chat), add_generation_prompt=open_turn)
        except ValueError:
            return none
        n = len(enc.ids)
        if enc.ids.tolist() != ids[:n]:
            return none
        rest = open_turn and chat[-1]["role"] == "assistant"
        return enc.assistant_mask.tolist() + [rest] * (len(ids) - n)

    # ------------------------------------------------------------------------------------ tokens

    def _tokens(self, td: TensorDictBase) -> list[Row]:
        container, part = self._container(td)
        if container is not None:
            seqs, splits = self._container_rows(container, part)
        else:
            seqs = self._bare_rows(td, td.get(self.key))
            splits = [len(s) for s in seqs]
        assistant = self._given_assistant(td, seqs)
        generate = self.config.generate
        return [Row(s, a, len(s) if generate else sp) for s, a, sp in zip(seqs, assistant, splits)]

    def _container(self, td: TensorDictBase) -> tuple[Tokens | None, str | None]:
        """The :class:`Tokens` the key points into (``(tokens_key, "prompt" | "full")``), if it is one."""
        key = self.key
        if isinstance(key, tuple) and len(key) >= 2 and key[-1] in ("prompt", "full"):
            maybe = td.get(key[:-1] if len(key) > 2 else key[0], None)
            if isinstance(maybe, Tokens):
                return maybe, key[-1]
        return None, None

    def _container_rows(self, container: Tokens, part: str | None) -> tuple[list[list[int]], list[int]]:
        if container.batch_dims != 1:
            raise ValueError(f"expected Tokens of batch shape (B,), got {tuple(container.batch_size)}")
        for name in ("prompt", "response", "full"):
            if container.has(name):
                check_id_dtype(container.get(name), f"tokens mode input {self.key!r} ({name})")
        if part == "prompt":
            if not container.has("prompt"):
                raise ValueError(f"{self.key!r} holds no prompt")
            seqs = [p.tolist() for p in container.unpadded("prompt")]
            return seqs, [len(s) for s in seqs]
        seqs = [s.tolist() for s in container.unpadded("full")]
        splits = container.prompt_length.tolist() if container.has("prompt") else [len(s) for s in seqs]
        return seqs, splits

    def _given_assistant(self, td: TensorDictBase, seqs: list[list[int]]) -> list[list[bool]]:
        """The prompt's assistant mask from the input's ``masks`` entry when it describes these ids."""
        default = [[False] * len(s) for s in seqs]
        key = self.config.masks_key
        masks = td.get(key, None) if key is not None else None
        if not isinstance(masks, Masks) or masks.all_assistant_mask is None:
            return default
        try:
            nested = masks.to_nested() if masks.padded else masks
            rows = [m.tolist() for m in nested.all_assistant_mask.unbind()]
        except (RuntimeError, ValueError):
            return default
        if [len(r) for r in rows] != [len(s) for s in seqs]:
            return default
        return rows

    def _bare_rows(self, td: TensorDictBase, value: Any) -> list[list[int]]:
        what = f"tokens mode input {self.key!r}"
        if isinstance(value, torch.Tensor) and value.is_nested:
            check_id_dtype(value, what)
            return [v.tolist() for v in value.unbind()]
        if isinstance(value, (list, tuple)):
            return [token_ids(v, f"{what}, row {b}") for b, v in enumerate(value)]
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            shape = f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""
            raise TypeError(
                f"tokens mode: expected Tokens, a (B, T) tensor, a nested tensor or a list of id tensors at "
                f"{self.key!r}, got {type(value).__name__}{shape}"
            )
        check_id_dtype(value, what)
        mask_key = self.config.attention_mask_key
        mask = td.get(mask_key, None)
        if mask is not None:
            return [row[m].tolist() for row, m in zip(value, _bool_mask(mask, value, mask_key))]
        edges = torch.cat([value[:, :1], value[:, -1:]], dim=1)
        if (edges == self.pad_token_id).any():
            raise ValueError(
                f"tokens mode: a padded (B, T) id tensor without an attention mask is ambiguous (the pad id "
                f"{self.pad_token_id} is a real token for this tokenizer); put the ids in a chatenv Tokens container, "
                f"pass a nested tensor or a list, or give the mask at {mask_key!r}"
            )
        return [row.tolist() for row in value]


def _bool_mask(mask: Any, ids: torch.Tensor, key: Any) -> torch.Tensor:
    """An attention mask as bool, refused unless it is a tensor of the ids' shape holding only 0/1 values."""
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(
            f"tokens mode: the attention mask at {key!r} has shape {shape}, the ids {tuple(ids.shape)}; give one "
            "mask value per id"
        )
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)][0].item()
        raise ValueError(f"tokens mode: the attention mask at {key!r} must hold 0/1 (or bool) values, got {bad}")
    return mask.bool()


def check_rows(rows: Sequence[Row], *, vocab: int, context_length: int | None, max_new_tokens: int = 0) -> None:
    """Refuse rows a model cannot take: empty, ids outside ``[0, vocab)``, or longer than its context.

    Args:
        rows: The rows read.
        vocab: Number of token ids the model knows.
        context_length: Most tokens a sequence can hold (None: unknown).
        max_new_tokens: Tokens generation adds to each row (0 when scoring).

    Raises:
        ValueError: Naming the row and the problem.
    """
    for b, r in enumerate(rows):
        if not r.ids:
            raise ValueError(f"row {b}: empty input; a prompt needs at least one token")
        check_vocab(r.ids, vocab, f"row {b}")
        if context_length is not None and len(r.ids) + max_new_tokens > context_length:
            added = f" + max_new_tokens={max_new_tokens}" if max_new_tokens else ""
            raise ValueError(
                f"row {b}: {len(r.ids)} input tokens{added} exceed the model's context length {context_length}; "
                "shorten the chat or lower max_new_tokens"
            )
