"""``History``: a batch of chats as a tensordict tensorclass.

Each element is one message with a ``role``, a ``content``, optional ``tool_calls`` (a JSON list, ``""`` when
there are none), a tool result's ``tool_call_id`` and ``name`` (``""`` when none) and an ``is_complete`` flag
(False for a message cut off mid-way, e.g. parsed from a partial generation). A ``History`` of shape ``(n,)`` is
one chat; ``(B, n)`` is a batch of chats. Ragged batches are padded at the end with messages whose role is the
empty string; rendering and :meth:`History.to_chats` skip them.

Construction never depends on tensordict's global ``list_to_stack`` setting.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from tensordict import NonTensorStack, TensorClass

from chatenv.messages import check_message
from chatenv.padding import pad_sequences
from chatenv.templates import ChatTemplate, resolve_template
from chatenv.tokenization import chat_tokenizer

if TYPE_CHECKING:
    from chatenv.spaces import MessagesSpace

__all__ = ["PAD_ROLE", "History", "apply_chat_template"]

PAD_ROLE = ""

# one chat (message dicts), or a batch of chats
Chats = Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]]

# tensordict ships no type information: to the type checker its classes are Any
_TensorClass: Any = TensorClass["nocast"]


class _Row(NamedTuple):
    """One message as History stores it."""

    role: str
    content: str
    tool_calls: str
    tool_call_id: str
    name: str
    reasoning_content: str
    is_complete: bool


def _check_message(m: Any, where: str) -> _Row:
    msg = check_message(m, where)
    calls = msg.get("tool_calls")
    return _Row(
        msg["role"],
        msg["content"],
        json.dumps(calls, ensure_ascii=False) if calls else "",
        msg.get("tool_call_id", ""),
        msg.get("name", ""),
        msg.get("reasoning_content", ""),
        msg.get("is_complete", True),
    )


class History(_TensorClass):  # type: ignore[misc]  # subclassing tensordict's untyped (Any) TensorClass
    """A batch of chats: one element per message.

    Attributes:
        role: Message roles (``"system"``, ``"user"``, ``"assistant"``, ``"tool"``, ...); ``""`` pads.
        content: Message texts.
        tool_calls: JSON-encoded list of tool calls of an assistant message, ``""`` when none.
        tool_call_id: The call a tool result answers, ``""`` when none.
        reasoning_content: An assistant reply's reasoning (read from its ids by the template's reasoning
            format), ``""`` when none.
        name: The tool's name on a tool result, ``""`` when none.
        is_complete: ``bool`` tensor, False for a message that was cut off.

    Example:
        >>> h = History.from_chats([[{"role": "user", "content": "Hi"}],
        ...                         [{"role": "user", "content": "Yo"}, {"role": "assistant", "content": "Hey"}]])
        >>> h.shape
        torch.Size([2, 2])
        >>> h.to_chats()[0]
        [{'role': 'user', 'content': 'Hi'}]
        >>> h.append(History.from_chats([{"role": "user", "content": "A"}, {"role": "user", "content": "B"}])).shape
        torch.Size([2, 3])
    """

    role: str
    content: str
    tool_calls: str
    tool_call_id: str
    name: str
    reasoning_content: str
    is_complete: torch.Tensor

    # ------------------------------------------------------------------------------------- construction

    @classmethod
    def from_chats(cls, chats: History | Mapping[str, Any] | Chats) -> History:
        """Build from one chat (a list of message dicts) or a batch of chats (a list of such lists).

        A single message dict gives a History of shape ``()``. Ragged batches are padded with empty-role
        messages at the end.

        Raises:
            TypeError: For content that is not a str, or messages that are not dicts.
            ValueError: For an empty list or an empty chat, a missing or empty role, missing content, or unknown keys.
        """
        if isinstance(chats, Mapping):
            return cls._build([_check_message(chats, "message")], ())
        if isinstance(chats, History):
            return cast(History, chats.clone())
        if not isinstance(chats, Sequence) or isinstance(chats, str):
            raise TypeError(f"expected a list of message dicts or a list of chats, got {type(chats).__name__}")
        if len(chats) == 0:
            raise ValueError("got an empty list: give one chat (a list of message dicts) or a list of chats")
        empty = [b for b, c in enumerate(chats) if isinstance(c, Sequence) and not isinstance(c, str) and not c]
        if empty:
            raise ValueError(f"chat {empty[0]} is empty: every chat needs at least one message")
        if chats and all(isinstance(c, Mapping) for c in chats):
            rows = [[_check_message(m, f"message {i}") for i, m in enumerate(chats)]]
            batched = False
        elif all(isinstance(c, Sequence) and not isinstance(c, (str, Mapping)) for c in chats):
            rows = [[_check_message(m, f"chat {b}, message {i}") for i, m in enumerate(c)] for b, c in enumerate(chats)]
            batched = True
        else:
            raise TypeError("expected a list of message dicts or a list of lists of message dicts, not a mix")
        width = max((len(r) for r in rows), default=0)
        pad = _Row(PAD_ROLE, "", "", "", "", "", True)
        rows = [r + [pad] * (width - len(r)) for r in rows]
        flat = [m for r in rows for m in r]
        shape = (len(rows), width) if batched else (width,)
        return cls._build(flat, shape)

    @classmethod
    def _build(cls, rows: list[_Row], batch_shape: tuple[int, ...]) -> History:
        shape = torch.Size(batch_shape)
        n = shape.numel()

        def stack(values: list[str]) -> Any:  # a str for shape (), else a NonTensorStack
            if shape == ():
                return values[0]
            return NonTensorStack.from_list(_nest(values, list(shape))) if n else _empty(shape)

        return cls(
            role=stack([r.role for r in rows]),
            content=stack([r.content for r in rows]),
            tool_calls=stack([r.tool_calls for r in rows]),
            tool_call_id=stack([r.tool_call_id for r in rows]),
            name=stack([r.name for r in rows]),
            reasoning_content=stack([r.reasoning_content for r in rows]),
            is_complete=torch.tensor([r.is_complete for r in rows], dtype=torch.bool).reshape(shape),
            batch_size=shape,
        )

    @classmethod
    def from_text(
        cls,
        text: str | Sequence[str],
        template: str | ChatTemplate | None = None,
        *,
        tokenizer: Any = None,
    ) -> History:
        """Parse rendered chat text back into messages.

        A text that stops inside a message (a partial generation, or a trailing generation prompt) ends with a
        message whose ``is_complete`` is False.

        Args:
            text: One rendered chat, or a list of them (giving a batch, padded).
            template: Template name or object; default: the tokenizer's own.
            tokenizer: Used to pick the template when none is named.

        Raises:
            TemplateParseError: If the text does not follow the template.
        """
        tmpl = resolve_template(template, tokenizer)
        if isinstance(text, str):
            return cls.from_chats(tmpl.parse(text))
        if not isinstance(text, Sequence) or not all(isinstance(t, str) for t in text):
            raise TypeError(f"expected a str or a list of str, got {type(text).__name__}")
        return cls.from_chats([tmpl.parse(t) for t in text])

    # ------------------------------------------------------------------------------------- conversion

    def to_chats(self) -> Any:
        """Message dicts without padding: a list for shape ``(n,)``, a list of lists for ``(B, n)``.

        Keys ``tool_calls`` (decoded), ``tool_call_id``, ``name``, ``reasoning_content`` and ``is_complete`` appear
        only when set.
        """
        fields = (self.role, self.content, self.tool_calls, self.tool_call_id, self.name, self.reasoning_content)
        if self.batch_dims == 0:
            return self._message(*fields, bool(self.is_complete))
        return _map(self._message, *fields, self.is_complete.tolist())

    @staticmethod
    def _message(
        role: str, content: str, calls: str, call_id: str, name: str, reasoning: str, complete: bool
    ) -> dict[str, Any] | None:
        if role == PAD_ROLE:
            return None
        msg: dict[str, Any] = {"role": role, "content": content}
        if calls:
            msg["tool_calls"] = json.loads(calls)
        if call_id:
            msg["tool_call_id"] = call_id
        if name:
            msg["name"] = name
        if reasoning:
            msg["reasoning_content"] = reasoning
        if not complete:
            msg["is_complete"] = False
        return msg

    # ------------------------------------------------------------------------------------- edits

    def append(self, other: History | Mapping[str, Any] | Chats, *, inplace: bool = False) -> History:
        """Add one message to each chat (``other`` has the batch shape without the message dim).

        Padding in ragged batches is moved after the new messages, so each chat stays contiguous.

        Raises:
            ValueError: If ``other``'s shape does not match.
        """
        other = other if isinstance(other, History) else History.from_chats(other)
        if self.batch_dims == 0:
            raise ValueError("cannot append to a History of shape (): it is a single message, not a chat")
        expected = self.batch_size[:-1]
        if other.batch_size == expected + (1,) and other.batch_dims == self.batch_dims:
            return self.extend(other, inplace=inplace)
        if other.batch_size != expected:
            raise ValueError(
                f"append adds one message per chat: expected a History of shape {tuple(expected)}, got "
                f"{tuple(other.batch_size)} (use extend() to add several messages per chat)"
            )
        return self.extend(other.unsqueeze(-1), inplace=inplace)

    def extend(self, other: History | Chats, *, inplace: bool = False) -> History:
        """Add messages to each chat (``other`` has shape ``(*batch, k)``).

        Raises:
            ValueError: If ``other``'s batch shape does not match.
        """
        other = other if isinstance(other, History) else History.from_chats(other)
        if self.batch_dims == 0 or other.batch_dims != self.batch_dims or other.batch_size[:-1] != self.batch_size[:-1]:
            raise ValueError(
                f"extend needs a History of shape {(*tuple(self.batch_size[:-1]), 'k')}, got {tuple(other.batch_size)}"
            )
        if self.is_padded() or other.is_padded():
            mine, theirs = self.to_chats(), other.to_chats()
            if self.batch_dims == 1:
                out = History.from_chats(mine + theirs)
            else:
                out = History.from_chats([a + b for a, b in zip(_rows(mine), _rows(theirs))])
                out = out.reshape(*self.batch_size[:-1], out.batch_size[-1])
        else:
            out = cast(History, torch.cat([self, other], dim=-1))  # tensorclasses implement torch.cat
        if inplace:
            # the message dim grows, so the storage is swapped rather than updated
            object.__setattr__(self, "_tensordict", out._tensordict)  # noqa: SLF001
            return self
        return out

    def is_padded(self) -> bool:
        """Whether any chat of the batch ends in padding messages (ragged batch)."""
        roles = self.role
        if isinstance(roles, str):
            return roles == PAD_ROLE
        return any(r == PAD_ROLE for r in _flatten(roles))

    # ------------------------------------------------------------------------------------- templates

    def apply_chat_template(self, tokenizer: Any, **kwargs: Any) -> Any:
        """Render or tokenize with a chat template; see :func:`apply_chat_template`."""
        return apply_chat_template(tokenizer, self, **kwargs)

    @classmethod
    def default_spec(
        cls, *, max_messages: int | None = None, max_length: int = 4096, roles: Sequence[str] = ()
    ) -> MessagesSpace:
        """A Gymnasium space describing chats (lists of message dicts), for env observation/action spaces.

        Args:
            max_messages: Upper bound on messages per chat (None: unbounded).
            max_length: Upper bound on characters per message content.
            roles: Allowed roles (empty: any non-empty str).
        """
        from chatenv.spaces import MessagesSpace

        return MessagesSpace(max_messages=max_messages, max_length=max_length, roles=tuple(roles))


def _empty(shape: torch.Size) -> Any:  # an empty NonTensorStack
    return (
        NonTensorStack(*[], batch_size=shape)
        if len(shape) == 1
        else NonTensorStack.from_list([[] for _ in range(shape[0])], batch_size=shape)
    )


def _nest(values: list[Any], shape: list[int]) -> list[Any]:
    if len(shape) == 1:
        return values
    step = len(values) // shape[0]
    return [_nest(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def _flatten(x: str | Iterable[Any]) -> Iterator[str]:
    if isinstance(x, str):
        yield x
        return
    for item in x:
        yield from _flatten(item)


def _map(fn: Callable[..., dict[str, Any] | None], roles: Any, *rest: Any) -> Any:
    """``fn`` over the messages of nested lists of fields (one chat, or a batch), padding dropped."""
    if isinstance(roles, str):
        return fn(roles, *rest)
    if roles and isinstance(roles[0], str):
        return [m for m in map(fn, roles, *rest) if m is not None]
    return [_map(fn, *row) for row in zip(roles, *rest)]


def _rows(chats: list[Any]) -> list[Any]:
    if chats and isinstance(chats[0], list) and chats[0] and isinstance(chats[0][0], list):
        return [row for block in chats for row in _rows(block)]
    return chats


def _as_chats(chats: Any) -> tuple[list[list[dict[str, Any]]], bool]:
    if isinstance(chats, History):
        if chats.batch_dims == 1:
            return [chats.to_chats()], False
        if chats.batch_dims == 2:
            return chats.to_chats(), True
        raise ValueError(f"expected a History of shape (n,) or (B, n), got {tuple(chats.batch_size)}")
    if isinstance(chats, Sequence) and not isinstance(chats, str):
        if all(isinstance(m, Mapping) for m in chats):
            return [list(History.from_chats(chats).to_chats())] if chats else [[]], False
        return History.from_chats(chats).to_chats(), True
    raise TypeError(f"expected a History, a list of message dicts or a list of chats, got {type(chats).__name__}")


def apply_chat_template(
    tokenizer: Any,
    chats: Any,
    *,
    template: str | ChatTemplate | None = None,
    add_generation_prompt: bool = False,
    tokenize: bool = True,
    padding: bool = True,
    padding_side: str = "left",
    pad_token_id: int | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> Any:
    """Render or tokenize chats with a template, with exact assistant masks.

    Args:
        tokenizer: A fast Hugging Face tokenizer.
        chats: A :class:`~chatenv.history.History` (shape ``(n,)`` or ``(B, n)``), a list of message dicts,
            or a list of chats.
        template: Template name or object; default: the tokenizer's own (see
            :func:`~chatenv.templates.resolve_template`).
        add_generation_prompt: End each chat with the header of a new assistant turn.
        tokenize: Return token ids and masks; if False, only the text.
        padding: For a batch, return padded ``(B, T)`` tensors; if False, lists of ``(T_b,)`` tensors.
        padding_side: ``"left"`` (prompts, the default) or ``"right"``.
        pad_token_id: Padding id; default: the tokenizer's.
        tools: Tool schemas for templates that describe tools.

    Returns:
        With ``tokenize=False``, the text (a list for a batch). Otherwise a dict with ``input_ids``,
        ``attention_mask``, ``all_assistant_mask`` (True on assistant content and end-of-turn tokens) and
        ``text``; a single chat gives ``(T,)`` tensors.

    Raises:
        ValueError: For a batch with ``padding`` when there is no pad token, or a bad ``padding_side``.

    Example:
        >>> from chatenv.models import load_default_tokenizer
        >>> tok = load_default_tokenizer()
        >>> out = apply_chat_template(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
        >>> tok.decode(out["input_ids"][out["all_assistant_mask"]])
        'Yo<|im_end|>'
    """
    rows, batched = _as_chats(chats)
    ct = chat_tokenizer(tokenizer, template)
    if not tokenize:
        texts = [ct.render(r, add_generation_prompt=add_generation_prompt, tools=tools).text for r in rows]
        return texts if batched else texts[0]
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if batched and padding:
        pad_token_id = tokenizer.pad_token_id if pad_token_id is None else pad_token_id
        if pad_token_id is None:
            raise ValueError(
                "padding a batch needs a pad token, and the tokenizer has none; set tokenizer.pad_token "
                "(e.g. tokenizer.pad_token = tokenizer.eos_token), pass pad_token_id=..., or padding=False"
            )
    encoded = [ct.encode(r, add_generation_prompt=add_generation_prompt, tools=tools) for r in rows]
    if not batched:
        e = encoded[0]
        return {
            "input_ids": e.ids,
            "attention_mask": torch.ones_like(e.ids, dtype=torch.bool),
            "all_assistant_mask": e.assistant_mask,
            "text": e.text,
        }
    ids = [e.ids for e in encoded]
    masks = [e.assistant_mask for e in encoded]
    texts = [e.text for e in encoded]
    if not padding:
        ones = [torch.ones_like(i, dtype=torch.bool) for i in ids]
        return {"input_ids": ids, "attention_mask": ones, "all_assistant_mask": masks, "text": texts}
    padded, attn = pad_sequences(ids, padding_side, pad_token_id)
    assistant, _ = pad_sequences(masks, padding_side, False)
    return {"input_ids": padded, "attention_mask": attn, "all_assistant_mask": assistant, "text": texts}
