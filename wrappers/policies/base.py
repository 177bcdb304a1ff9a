"""The policy API shared by every backend.

:class:`LLMWrapperBase` turns tensordicts (or plain env observations, through :meth:`~LLMWrapperBase.act`)
into token ids, asks its backend to generate or score them, and writes the results into the
:mod:`chatenv.containers` so that ``prompt + response == full`` and masks and log-probs have the shape of
``tokens.full``. Backends (:class:`~wrappers.policies.TransformersWrapper`,
:class:`~wrappers.policies.VLLMWrapper`) implement three things only: generate ids, score ids, and (where the
engine exposes them) full logits for :meth:`~LLMWrapperBase.get_dist`.

Input modes:

- ``"history"``: chats as :class:`~chatenv.history.History`; prompts are rendered and tokenized with the chat
  template (exact assistant masks), responses are parsed back into messages.
- ``"text"``: rendered chat text; tokenized with special tokens recognised.
- ``"tokens"``: token ids, used verbatim; generated ids are returned verbatim (never decoded and re-encoded).
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase, lazy_stack
from tensordict.nn import TensorDictModuleBase

from chatenv.containers import ChatHistory, LogProbs, Masks, Text, Tokens
from chatenv.history import History
from chatenv.tokenization import ChatTokenizer, chat_tokenizer
from wrappers.policies.settings import GenerationSettings, normalize_generate_kwargs

__all__ = ["LLMWrapperBase", "MaskedCategorical"]

InputMode = Literal["history", "text", "tokens"]
_MODES = ("history", "text", "tokens")
_UNSET: Any = object()


@dataclass
class _Row:
    """One prompt (generation) or one full sequence (scoring), as ids."""

    ids: list[int]
    assistant: list[bool]
    split: int  # ids[:split] is the prompt
    text: str | None = None
    chat: list[dict] | None = None


@dataclass
class _Sample:
    """One generated response."""

    ids: list[int]
    log_probs: torch.Tensor | None
    finished: bool


class MaskedCategorical(torch.distributions.Distribution):
    """Categorical distributions over the vocabulary, one per position of ``tokens.full``, with a position mask.

    Position t is the distribution of token t given the tokens before it (what :class:`LogProbs` holds).
    Masked positions (padding, the first token of each sequence, and whatever ``mask`` excludes) give
    ``padding_value`` from :meth:`log_prob` and :meth:`entropy`, so sums over positions count only the kept
    ones; :attr:`mask` says which those are.

    Args:
        logits: ``(B, T, V)`` logits.
        mask: ``(B, T)`` bool, True where the distribution is used.
        padding_value: What masked positions give.
    """

    arg_constraints: dict = {}
    has_enumerate_support = False

    def __init__(self, logits: torch.Tensor, mask: torch.Tensor, padding_value: float = 0.0):
        if mask.shape != logits.shape[:-1]:
            raise ValueError(f"mask of shape {tuple(mask.shape)} does not match logits {tuple(logits.shape)}")
        self.logits = logits.log_softmax(-1)
        self.mask = mask.to(torch.bool)
        self.padding_value = padding_value
        super().__init__(batch_shape=mask.shape, validate_args=False)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log-probabilities of ``value`` (``(B, T)`` token ids)."""
        lp = self.logits.gather(-1, value.long().clamp(0, self.logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        return torch.where(self.mask, lp, torch.full_like(lp, self.padding_value))

    def entropy(self) -> torch.Tensor:
        """Entropy per position."""
        p = self.logits.exp()
        ent = -(p * torch.where(p > 0, self.logits, torch.zeros_like(self.logits))).sum(-1)
        return torch.where(self.mask, ent, torch.full_like(ent, self.padding_value))

    def sample(self, sample_shape: torch.Size | tuple = ()) -> torch.Tensor:
        """Sample token ids per position (masked positions hold -1)."""
        probs = self.logits.exp().reshape(-1, self.logits.shape[-1])
        n = int(np.prod(sample_shape)) if sample_shape else 1
        draws = torch.multinomial(probs, n, replacement=True).T.reshape(*sample_shape, *self.mask.shape)
        return torch.where(self.mask, draws, torch.full_like(draws, -1))

    @property
    def mode(self) -> torch.Tensor:
        """Most likely token per position (masked positions hold -1)."""
        top = self.logits.argmax(-1)
        return torch.where(self.mask, top, torch.full_like(top, -1))


def _key(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def _strings(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, NonTensorData):
        return [value.data] if isinstance(value.data, str) else list(value.data)
    if isinstance(value, NonTensorStack):
        value = value.tolist()
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(f"{what}: expected text (a str or a list of str), got {type(value).__name__}")


class LLMWrapperBase(TensorDictModuleBase, abc.ABC):
    """A language-model policy over chats, as a tensordict module.

    Args:
        tokenizer: A fast Hugging Face tokenizer.
        template: Chat template name or object for history mode and assistant masks; default: the tokenizer's.
        input_mode: ``"history"``, ``"text"`` or ``"tokens"``.
        input_key: Where the input is read; default ``(input_mode, "prompt")`` when generating and
            ``(input_mode, "full")`` when scoring.
        attention_mask_key: Where a padded tokens-mode input's attention mask is read, when the input is a bare
            tensor rather than a :class:`~chatenv.containers.Tokens` (which carries its own lengths).
        generate: Sample responses (True) or score the given full sequences (False).
        generate_kwargs: Generation settings; see :class:`~wrappers.policies.settings.GenerationSettings`. When
            scoring, the sampling settings (temperature, top-k/p, min-p, min tokens) define the distribution
            whose log-probs are returned, so a scoring copy of a generator scores what it sampled.
        return_log_probs: Return log-probs of the generated tokens (default True; always True when scoring).
        raw_log_probs: Return the model's own log-probs (temperature 1, no filtering) instead of those of the
            distribution sampled from. Greedy decoding always reports the model's own log-probs.
        pad_output: Padded tensors (True) or nested jagged tensors holding exactly the sequences (False).
        num_samples: Responses per prompt; outputs then have batch shape ``(B, num_samples)``.
        inplace: ``True``: write outputs into the input tensordict (default without ``num_samples``);
            ``False``: write into a shallow copy; ``"empty"``: return only the outputs. With ``num_samples``
            outputs go to a new ``(B, num_samples)`` tensordict.
        history_key, text_key, tokens_key, masks_key, log_probs_key: Output keys of the containers
            (``None`` to skip one; tokens are always written).

    Outputs:
        ``tokens`` (:class:`~chatenv.containers.Tokens`), ``masks`` (:class:`~chatenv.containers.Masks`:
        attention and assistant masks), ``log_probs`` (:class:`~chatenv.containers.LogProbs`: position t is
        log p(x_t | x_<t); positions without a value are NaN), plus ``text`` (:class:`Text`) in text and history
        modes and ``history`` (:class:`ChatHistory`) in history mode.
    """

    backend: str = "base"

    def __init__(
        self,
        *,
        tokenizer: Any,
        template: Any = None,
        input_mode: InputMode = "history",
        input_key: Any = None,
        attention_mask_key: Any = "attention_mask",
        generate: bool = True,
        generate_kwargs: Mapping[str, Any] | None = None,
        return_log_probs: bool | None = None,
        raw_log_probs: bool = False,
        pad_output: bool = True,
        num_samples: int | None = None,
        inplace: bool | Literal["empty"] | None = None,
        history_key: Any = "history",
        text_key: Any = "text",
        tokens_key: Any = "tokens",
        masks_key: Any = "masks",
        log_probs_key: Any = "log_probs",
    ):
        super().__init__()
        if input_mode not in _MODES:
            raise ValueError(f"input_mode must be one of {_MODES}, got {input_mode!r}")
        if tokens_key is None:
            raise ValueError("tokens_key cannot be None: token ids are always returned")
        settings = normalize_generate_kwargs(generate_kwargs)
        if num_samples is not None:
            if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
                raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
            if "num_samples" in settings.explicit and settings.num_samples != num_samples:
                raise ValueError(
                    f"num_samples={num_samples} conflicts with generate_kwargs n/num_samples={settings.num_samples}"
                )
            settings = settings.with_overrides(num_samples=num_samples)
        elif "num_samples" in settings.explicit:
            num_samples = settings.num_samples
        if not generate and return_log_probs is False:
            raise ValueError("scoring (generate=False) returns log-probs only; return_log_probs=False leaves nothing")
        if num_samples is not None and not generate:
            raise ValueError("num_samples applies to generation; scoring takes the samples as its input")
        if inplace is None:
            inplace = num_samples is None
        if inplace not in (True, False, "empty"):
            raise ValueError(f"inplace must be True, False or 'empty', got {inplace!r}")
        if inplace is True and num_samples is not None:
            raise ValueError(
                "inplace=True cannot hold num_samples responses per prompt in the (B,) input; use inplace=False "
                "or 'empty' (outputs come in a new (B, num_samples) tensordict)"
            )
        self.tokenizer = tokenizer
        self.chat_tokenizer: ChatTokenizer = chat_tokenizer(tokenizer, template)
        self.template = template
        self.input_mode = input_mode
        self.generate = bool(generate)
        self.settings: GenerationSettings = settings
        self.num_samples = num_samples
        self.return_log_probs = True if return_log_probs is None else bool(return_log_probs)
        self.raw_log_probs = bool(raw_log_probs)
        self.pad_output = bool(pad_output)
        self.inplace = inplace
        self.attention_mask_key = _key(attention_mask_key)
        self.history_key = _key(history_key)
        self.text_key = _key(text_key)
        self.tokens_key = _key(tokens_key)
        self.masks_key = _key(masks_key)
        self.log_probs_key = _key(log_probs_key)
        self.input_key = _key(input_key) if input_key is not None else (input_mode, "prompt" if generate else "full")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token")
        self.pad_token_id = int(pad)
        stops = set(self.chat_tokenizer.end_of_turn_ids)
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        self.stop_ids: tuple[int, ...] = tuple(sorted(stops | set(settings.stop_token_ids)))
        self.in_keys = [self.input_key]
        outs = [self.tokens_key, self.masks_key]
        if self.return_log_probs:
            outs.append(self.log_probs_key)
        if input_mode in ("history", "text") and self.text_key is not None:
            outs.append(self.text_key)
        if input_mode == "history" and self.history_key is not None:
            outs.append(self.history_key)
        self.out_keys = [k for k in outs if k is not None]
        # what get_new_version needs: the arguments the user gave (defaults are recomputed per version)
        self._given: dict[str, Any] = {}
        self._generation_calls = 0

    # ------------------------------------------------------------------------------------ backends

    @abc.abstractmethod
    def _generate_ids(self, prompts: list[list[int]], settings: GenerationSettings) -> list[list[_Sample]]:
        """Sample ``settings.num_samples`` responses per prompt."""

    @abc.abstractmethod
    def _score_ids(self, seqs: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
        """Per sequence, ``(T,)`` float32 log p(x_t | x_<t) (NaN at 0), under :meth:`_scoring_distribution`."""

    def _full_logits(self, seqs: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
        """Per sequence, ``(T, V)`` logits of the distribution of each position (row 0 unused)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot return full-vocabulary distributions (get_dist); score log-probs with "
            "log_prob(), or use TransformersWrapper"
        )

    def _call_seed(self, seed: int) -> int:
        """The seed of this generation call: the given seed for the first call, then derived from it per call.

        A run is reproducible from its seed, and successive calls (turns of a rollout) draw fresh samples rather
        than repeating the first call's random numbers.
        """
        calls = self._generation_calls
        self._generation_calls += 1
        return seed if calls == 0 else (seed * 6364136223846793005 + calls * 1442695040888963407) % (2**63)

    @property
    def context_length(self) -> int | None:
        """Most tokens a sequence can hold (None if unknown)."""
        return None

    # --------------------------------------------------------------------------------- versions

    def _record(self, given: dict[str, Any]) -> None:
        self._given = {k: v for k, v in given.items() if v is not _UNSET}

    def get_new_version(self, **overrides: Any) -> LLMWrapperBase:
        """A copy of this policy with only the given settings changed, sharing the model.

        Settings that depend on others are recomputed rather than copied: the default input key follows
        ``generate`` and ``input_mode`` unless ``input_key`` was given explicitly. Generation settings are kept
        (a scoring copy scores the distribution its generator sampled from); ``generate_kwargs`` given here are
        merged into them.

        Example:
            ``scorer = policy.get_new_version(generate=False)`` reads ``(mode, "full")`` and returns log-probs.
        """
        given = dict(self._given)
        gen_kwargs = self.settings.as_kwargs()
        if "generate_kwargs" in overrides:
            gen_kwargs.update(normalize_generate_kwargs(overrides.pop("generate_kwargs")).as_kwargs())
        given.update(overrides)
        given["generate_kwargs"] = gen_kwargs
        if not given.get("generate", True):
            # a scoring version takes samples as input: per-prompt sample counts do not apply
            given.pop("num_samples", None)
            gen_kwargs.pop("num_samples", None)
            if self.num_samples is not None and "inplace" not in overrides:
                given.pop("inplace", None)
        return self._new_version(given)

    @abc.abstractmethod
    def _new_version(self, given: dict[str, Any]) -> LLMWrapperBase:
        """Build a sibling sharing this one's engine/model with ``given`` constructor arguments."""

    # --------------------------------------------------------------------------------- calling

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Generate or score for every row of ``tensordict`` (batch shape ``()`` or ``(B,)``)."""
        if tensordict.batch_dims > 1:
            raise ValueError(
                f"expected a tensordict of batch shape () or (B,), got {tuple(tensordict.batch_size)}; "
                "reshape(-1) it first"
            )
        single = tensordict.batch_dims == 0
        td = tensordict.unsqueeze(0) if single else tensordict
        rows = self._read(td)
        if self.generate:
            outputs = self._generated_outputs(rows)
        else:
            outputs = self._scored_outputs(rows)
        batch = outputs.pop("_batch")
        if self.num_samples is not None:
            target: TensorDictBase = TensorDict(batch_size=batch)
        elif self.inplace is True:
            target = tensordict
        elif self.inplace == "empty":
            target = tensordict.empty()
        else:
            target = tensordict.copy()
        for key, value in outputs.items():
            if key is None:
                continue
            if single and self.num_samples is None:
                value = value[0]
            target.set(key, value)
        return target

    def log_prob(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Score the full sequences of ``tensordict`` (its ``log_probs`` entry holds the result).

        When ``tensordict`` holds :class:`~chatenv.containers.Tokens` (e.g. the output of a generation), those
        exact ids are scored, whatever the input mode: a generated reply is never decoded and re-encoded.
        """
        overrides: dict[str, Any] = {}
        if self.generate:
            overrides["generate"] = False
        if self.input_mode != "tokens" and isinstance(tensordict.get(self.tokens_key, None), Tokens):
            overrides.update(
                input_mode="tokens",
                input_key=(self.tokens_key, "full") if isinstance(self.tokens_key, str) else (*self.tokens_key, "full"),
            )
        scorer = self.get_new_version(**overrides) if overrides else self
        return scorer(tensordict)

    def get_dist(
        self,
        tensordict: TensorDictBase,
        mask: Literal["assistant", "response", "attention"] | torch.Tensor = "assistant",
        padding_value: float = 0.0,
    ) -> MaskedCategorical:
        """Per-position distributions over the vocabulary for the full sequences of ``tensordict``.

        Args:
            tensordict: Holds the full sequences (as for scoring) at ``(input_mode, "full")``.
            mask: Which positions to keep: the assistant's tokens, the response tokens, every real token
                (``"attention"``), or a ``(B, T)`` bool tensor in the padded layout of ``tokens.full``. The first
                token of each sequence (no distribution) is always masked.
            padding_value: What masked positions give from ``log_prob`` / ``entropy``.

        Returns:
            A :class:`MaskedCategorical` aligned with the padded ``tokens.full`` of :meth:`log_prob`'s output.
        """
        scorer = (
            self if not self.generate and self.pad_output else self.get_new_version(generate=False, pad_output=True)
        )
        td = tensordict.unsqueeze(0) if tensordict.batch_dims == 0 else tensordict
        rows = scorer._read(td)
        tokens = scorer._tokens([r.ids[: r.split] for r in rows], [r.ids[r.split :] for r in rows])
        masks = Masks.from_tokens(tokens, [torch.tensor(r.assistant, dtype=torch.bool) for r in rows])
        logits = scorer._full_logits([r.ids for r in rows], [r.split for r in rows])
        attention = masks.all_attention_mask
        out = torch.zeros(*attention.shape, logits[0].shape[-1], dtype=logits[0].dtype)
        out[attention] = torch.cat(logits)
        first = torch.zeros_like(attention)
        first[torch.arange(len(rows)), attention.long().argmax(-1)] = True
        if isinstance(mask, torch.Tensor):
            if mask.shape != attention.shape:
                raise ValueError(
                    f"mask of shape {tuple(mask.shape)} does not match tokens.full {tuple(attention.shape)}"
                )
            keep = mask.to(torch.bool) & attention
        elif mask == "assistant":
            keep = masks.all_assistant_mask
        elif mask == "response":
            width = tokens.prompt.shape[-1]
            keep = attention.clone()
            keep[:, :width] = False
        elif mask == "attention":
            keep = attention
        else:
            raise ValueError(f"mask must be 'assistant', 'response', 'attention' or a bool tensor, got {mask!r}")
        return MaskedCategorical(out, keep & ~first, padding_value=padding_value)

    def act(self, observations: Any) -> tuple[Any, TensorDictBase]:
        """Generate actions for env observations, without building tensordicts by hand.

        Args:
            observations: One observation or a batch (list) of them, as the env returns them: in history mode
                a list of message dicts per observation, in text mode the prompt text, in tokens mode the prompt
                ids (a list, array or tensor of ints).

        Returns:
            ``(actions, tensordict)``: the actions the env accepts (history: the reply message dict; text: the
            reply text; tokens: the generated ids as an int64 numpy array), one per observation (a list of
            ``num_samples`` per observation with ``num_samples``), and the output tensordict with tokens, masks
            and log-probs. A single observation gives a single action.
        """
        if not self.generate:
            raise ValueError("act() generates actions; this policy scores (generate=False)")
        single, batch = self._observation_batch(observations)
        td = TensorDict(batch_size=[len(batch)])
        key = self.input_key
        if self.input_mode == "history":
            td.set(key, History.from_chats(batch))
        elif self.input_mode == "text":
            td.set(key, NonTensorStack.from_list(batch))
        else:
            rows = [torch.as_tensor(np.asarray(o), dtype=torch.long).reshape(-1) for o in batch]
            if isinstance(key, tuple) and len(key) == 2 and key[1] == "prompt":
                td.set(key[0], Tokens.from_sequences(rows, padded=True, pad_value=self.pad_token_id))
            else:
                td.set(key, torch.nested.as_nested_tensor(rows, layout=torch.jagged))
        out = self(td)
        tokens = out.get(self.tokens_key)
        flat = tokens.reshape(-1) if self.pad_output and self.num_samples is not None else tokens
        if self.num_samples is not None and not self.pad_output:
            responses = [r for b in range(tokens.batch_size[0]) for r in tokens[b].unpadded("response")]
        else:
            responses = flat.unpadded("response")
        if self.input_mode == "tokens":
            actions: list = [r.numpy().astype(np.int64) for r in responses]
        elif self.input_mode == "text":
            actions = [self.chat_tokenizer.decode(r) for r in responses]
        else:
            actions = [self.chat_tokenizer.parse_response(r)[0] for r in responses]
        if self.num_samples is not None:
            n = self.num_samples
            actions = [actions[i : i + n] for i in range(0, len(actions), n)]
        return (actions[0] if single else actions), out

    def _observation_batch(self, observations: Any) -> tuple[bool, list]:
        mode = self.input_mode
        if mode == "history":
            if isinstance(observations, History):
                chats = observations.to_chats()
                return observations.batch_dims == 1, [chats] if observations.batch_dims == 1 else chats
            if (
                isinstance(observations, Sequence)
                and observations
                and all(isinstance(m, Mapping) for m in observations)
            ):
                return True, [list(observations)]
            if isinstance(observations, Sequence) and all(isinstance(c, Sequence) for c in observations):
                return False, [list(c) for c in observations]
            raise TypeError("history mode: expected a chat (a list of message dicts) or a list of chats")
        if mode == "text":
            if isinstance(observations, str):
                return True, [observations]
            return False, _strings(observations, "text mode observations")
        if isinstance(observations, torch.Tensor) and observations.dim() == 1:
            return True, [observations]
        if isinstance(observations, np.ndarray) and observations.ndim == 1:
            return True, [observations]
        if (
            isinstance(observations, Sequence)
            and observations
            and all(isinstance(x, (int, np.integer)) for x in observations)
        ):
            return True, [observations]
        if isinstance(observations, (Sequence, np.ndarray, torch.Tensor)):
            return False, list(observations)
        raise TypeError(f"tokens mode: expected token ids or a list of them, got {type(observations).__name__}")

    # --------------------------------------------------------------------------------- reading

    def _read(self, td: TensorDictBase) -> list[_Row]:
        key = self.input_key
        if key not in td.keys(include_nested=True, leaves_only=False):
            raise KeyError(
                f"input key {key!r} not found (input_mode={self.input_mode!r}, generate={self.generate}); keys "
                f"present: {sorted(map(str, td.keys(include_nested=True)))}. Pass input_key=... if it lives elsewhere"
            )
        if self.input_mode == "history":
            rows = self._read_history(td.get(key))
        elif self.input_mode == "text":
            rows = self._read_text(td, td.get(key))
        else:
            rows = self._read_tokens(td, key)
        if len(rows) != td.batch_size[0]:
            raise ValueError(f"read {len(rows)} inputs for a batch of {td.batch_size[0]}")
        limit = self.context_length
        vocab = self._vocab_limit
        for b, r in enumerate(rows):
            if not r.ids:
                raise ValueError(f"row {b}: empty input; a prompt needs at least one token")
            if min(r.ids) < 0 or max(r.ids) >= vocab:
                bad = next(i for i in r.ids if i < 0 or i >= vocab)
                raise ValueError(f"row {b}: token id {bad} is outside the vocabulary [0, {vocab})")
            need = len(r.ids) + (self.settings.max_new_tokens if self.generate else 0)
            if limit is not None and need > limit:
                raise ValueError(
                    f"row {b}: {len(r.ids)} input tokens"
                    + (f" + max_new_tokens={self.settings.max_new_tokens}" if self.generate else "")
                    + f" exceed the model's context length {limit}; shorten the chat or lower max_new_tokens"
                )
        return rows

    def _vocab_size(self) -> int:
        return len(self.tokenizer)

    @functools.cached_property
    def _vocab_limit(self) -> int:
        return max(len(self.tokenizer), self._vocab_size())

    def _read_history(self, value: Any) -> list[_Row]:
        if not isinstance(value, History):
            raise TypeError(f"history mode: expected a History at {self.input_key!r}, got {type(value).__name__}")
        if value.batch_dims != 2:
            raise ValueError(f"history mode: expected a History of shape (B, messages), got {tuple(value.shape)}")
        ct = self.chat_tokenizer
        rows = []
        for chat in value.to_chats():
            chat = [m for m in chat if m is not None]
            if self.generate:
                enc = ct.encode(chat, add_generation_prompt=True)
                rows.append(_Row(enc.ids.tolist(), enc.assistant_mask.tolist(), len(enc.ids), enc.text, chat))
                continue
            if not chat or chat[-1]["role"] != "assistant":
                enc = ct.encode(chat)
                rows.append(_Row(enc.ids.tolist(), enc.assistant_mask.tolist(), len(enc.ids), enc.text, chat))
                continue
            # the last assistant message is the response: its ids end where generation would have ended (after
            # the end-of-turn token, or after the content of a cut-off message), without trailing markup
            head = ct.encode(chat[:-1], add_generation_prompt=True)
            last = chat[-1]
            if last.get("is_complete", True):
                enc = ct.encode([{k: v for k, v in m.items() if k != "is_complete"} for m in chat])
                end = int(enc.assistant_mask.nonzero()[-1]) + 1
                ids, mask = enc.ids[:end].tolist(), enc.assistant_mask[:end].tolist()
            else:
                content = ct._plain.encode(last["content"], add_special_tokens=False).ids
                ids = head.ids.tolist() + content
                mask = head.assistant_mask.tolist() + [True] * len(content)
            if ids[: len(head.ids)] != head.ids.tolist():
                raise ValueError(
                    "history mode: the chat's prompt does not tokenize to a prefix of the full chat; score it in "
                    "tokens mode instead"
                )
            rows.append(_Row(ids, mask, len(head.ids), ct.decode(ids), chat))
        return rows

    def _encode_text(self, text: str) -> list[int]:
        return self.chat_tokenizer._markup.encode(text, add_special_tokens=False).ids

    def _text_assistant(self, text: str, ids: list[int]) -> list[bool]:
        """Assistant mask of rendered chat text: from the template's parse, when it reproduces the same ids."""
        try:
            chat = self.chat_tokenizer.template.parse(text)
        except ValueError:
            return [False] * len(ids)
        open_turn = bool(chat) and chat[-1].get("is_complete") is False
        head = [{k: v for k, v in m.items() if k != "is_complete"} for m in (chat[:-1] if open_turn else chat)]
        try:
            enc = self.chat_tokenizer.encode(head, add_generation_prompt=open_turn)
        except ValueError:
            return [False] * len(ids)
        n = len(enc.ids)
        if enc.ids.tolist() == ids[:n]:
            return enc.assistant_mask.tolist() + (
                [True] * (len(ids) - n) if open_turn and chat[-1]["role"] == "assistant" else [False] * (len(ids) - n)
            )
        return [False] * len(ids)

    def _read_text(self, td: TensorDictBase, value: Any) -> list[_Row]:
        texts = _strings(value, f"text mode input {self.input_key!r}")
        rows = []
        prompts: list[str] | None = None
        if not self.generate and isinstance(self.input_key, tuple) and self.input_key[-1] == "full":
            pkey = (*self.input_key[:-1], "prompt")
            if pkey in td.keys(include_nested=True):
                prompts = _strings(td.get(pkey), f"text mode prompt {pkey!r}")
        for b, text in enumerate(texts):
            if prompts is not None and text.startswith(prompts[b]):
                head = self._encode_text(prompts[b])
                ids = head + self._encode_text(text[len(prompts[b]) :])
                split = len(head)
            else:
                ids = self._encode_text(text)
                split = len(ids)
            rows.append(_Row(ids, self._text_assistant(text, ids), split if not self.generate else len(ids), text))
        return rows

    def _read_tokens(self, td: TensorDictBase, key: Any) -> list[_Row]:
        container = None
        part = None
        if isinstance(key, tuple) and len(key) >= 2 and key[-1] in ("prompt", "full"):
            maybe = td.get(key[:-1] if len(key) > 2 else key[0], None)
            if isinstance(maybe, Tokens):
                container, part = maybe, key[-1]
        if container is not None:
            if container.batch_dims != 1:
                raise ValueError(f"expected Tokens of batch shape (B,), got {tuple(container.batch_size)}")
            if part == "prompt":
                if not container.has("prompt"):
                    raise ValueError(f"{key!r} holds no prompt")
                seqs = [p.tolist() for p in container.unpadded("prompt")]
                splits = [len(s) for s in seqs]
            else:
                seqs = [s.tolist() for s in container.unpadded("full")]
                splits = container.prompt_length.tolist() if container.has("prompt") else [len(s) for s in seqs]
        else:
            seqs = self._bare_token_rows(td, td.get(key))
            splits = [len(s) for s in seqs]
        assistant = self._given_assistant(td, seqs)
        return [_Row(s, a, sp if not self.generate else len(s)) for s, a, sp in zip(seqs, assistant, splits)]

    def _given_assistant(self, td: TensorDictBase, seqs: list[list[int]]) -> list[list[bool]]:
        """The prompt's assistant mask from the input's ``masks`` entry when it describes these ids."""
        default = [[False] * len(s) for s in seqs]
        masks = td.get(self.masks_key, None) if self.masks_key is not None else None
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

    def _bare_token_rows(self, td: TensorDictBase, value: Any) -> list[list[int]]:
        if isinstance(value, torch.Tensor) and value.is_nested:
            return [v.tolist() for v in value.unbind()]
        if isinstance(value, (list, tuple)):
            return [torch.as_tensor(v).reshape(-1).tolist() for v in value]
        if not isinstance(value, torch.Tensor) or value.dim() != 2:
            raise TypeError(
                f"tokens mode: expected Tokens, a (B, T) tensor, a nested tensor or a list of id tensors at "
                f"{self.input_key!r}, got {type(value).__name__}"
            )
        if value.is_floating_point():
            raise TypeError(f"tokens mode: token ids must be integers, got {value.dtype}")
        mask = td.get(self.attention_mask_key, None)
        if mask is not None:
            if mask.shape != value.shape:
                raise ValueError(f"attention mask {tuple(mask.shape)} does not match the ids {tuple(value.shape)}")
            return [row[m.bool()].tolist() for row, m in zip(value, mask)]
        edges = torch.cat([value[:, :1], value[:, -1:]], dim=1)
        if (edges == self.pad_token_id).any():
            raise ValueError(
                f"tokens mode: a padded (B, T) id tensor without an attention mask is ambiguous (the pad id "
                f"{self.pad_token_id} is a real token for this tokenizer); put the ids in a chatenv Tokens container, "
                f"pass a nested tensor or a list, or give the mask at {self.attention_mask_key!r}"
            )
        return [row.tolist() for row in value]

    # --------------------------------------------------------------------------------- writing

    def _tokens(self, prompts: list, responses: list) -> Tokens:
        p = [torch.as_tensor(x, dtype=torch.long) for x in prompts]
        r = [torch.as_tensor(x, dtype=torch.long) for x in responses]
        return Tokens.from_sequences(p, r, padded=self.pad_output, pad_value=self.pad_token_id)

    def _group(self, build, n_rows: int) -> Any:
        """Build a container over all rows, shaped (B,) or (B, num_samples)."""
        n = self.num_samples
        if n is None:
            return build(slice(0, n_rows))
        if self.pad_output:
            return build(slice(0, n_rows)).reshape(n_rows // n, n)
        return lazy_stack([build(slice(b, b + n)) for b in range(0, n_rows, n)])

    def _generated_outputs(self, rows: list[_Row]) -> dict[Any, Any]:
        settings = self.settings
        samples = self._generate_ids([r.ids for r in rows], settings)
        n = settings.num_samples
        flat_rows = [r for r in rows for _ in range(n)]
        flat = [s for per_prompt in samples for s in per_prompt]
        if len(flat) != len(flat_rows):
            raise RuntimeError(f"the backend returned {len(flat)} samples for {len(rows)} prompts x {n}")
        prompts = [r.ids for r in flat_rows]
        responses = [s.ids for s in flat]

        built: dict[tuple[int, int], Tokens] = {}

        def tokens(sl: slice) -> Tokens:
            # built once per slice: the masks below describe the same containers
            key = (sl.start, sl.stop)
            if key not in built:
                built[key] = self._tokens(prompts[sl], responses[sl])
            return built[key]

        def masks(sl: slice) -> Masks:
            assist = [
                torch.tensor(r.assistant + [True] * len(s.ids), dtype=torch.bool)
                for r, s in zip(flat_rows[sl], flat[sl])
            ]
            return Masks.from_tokens(tokens(sl), assist)

        def log_probs(sl: slice) -> LogProbs:
            p = [torch.full((len(r.ids),), math.nan) for r in flat_rows[sl]]
            return LogProbs.from_sequences(p, [s.log_probs for s in flat[sl]], padded=self.pad_output)

        out: dict[Any, Any] = {"_batch": (len(rows),) if self.num_samples is None else (len(rows), n)}
        out[self.tokens_key] = self._group(tokens, len(flat))
        if self.masks_key is not None:
            out[self.masks_key] = self._group(masks, len(flat))
        if self.return_log_probs and self.log_probs_key is not None:
            out[self.log_probs_key] = self._group(log_probs, len(flat))
        if self.input_mode in ("history", "text") and self.text_key is not None:
            ptext = [r.text for r in flat_rows]
            rtext = [self.chat_tokenizer.decode(s.ids) for s in flat]
            out[self.text_key] = self._reshape(
                Text(
                    prompt=NonTensorStack.from_list(ptext),
                    response=NonTensorStack.from_list(rtext),
                    full=NonTensorStack.from_list([p + r for p, r in zip(ptext, rtext)]),
                    batch_size=[len(flat)],
                ),
                len(rows),
            )
        if self.input_mode == "history" and self.history_key is not None:
            replies = [self.chat_tokenizer.parse_response(s.ids) for s in flat]
            prompt_chats = [r.chat for r in flat_rows]
            out[self.history_key] = self._reshape(
                ChatHistory(
                    prompt=History.from_chats(prompt_chats),
                    response=History.from_chats(replies),
                    full=History.from_chats([c + rep for c, rep in zip(prompt_chats, replies)]),
                    batch_size=[len(flat)],
                ),
                len(rows),
            )
        return out

    def _reshape(self, container: Any, n_prompts: int) -> Any:
        return container if self.num_samples is None else container.reshape(n_prompts, self.num_samples)

    def _scored_outputs(self, rows: list[_Row]) -> dict[Any, Any]:
        splits = [r.split for r in rows]
        lps = self._score_ids([r.ids for r in rows], splits)
        prompts = [r.ids[: r.split] for r in rows]
        responses = [r.ids[r.split :] for r in rows]
        tokens = self._tokens(prompts, responses)
        out: dict[Any, Any] = {"_batch": (len(rows),), self.tokens_key: tokens}
        if self.masks_key is not None:
            out[self.masks_key] = Masks.from_tokens(tokens, [torch.tensor(r.assistant, dtype=torch.bool) for r in rows])
        if self.log_probs_key is not None:
            out[self.log_probs_key] = LogProbs.from_sequences(
                [lp[:s] for lp, s in zip(lps, splits)], [lp[s:] for lp, s in zip(lps, splits)], padded=self.pad_output
            )
        return out

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"backend={self.backend!r}, input_mode={self.input_mode!r}, generate={self.generate}, "
            f"input_key={self.input_key!r}, pad_output={self.pad_output}, num_samples={self.num_samples}"
        )
