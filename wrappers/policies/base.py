"""The policy API shared by every backend.

:class:`LLMWrapperBase` turns tensordicts (or plain env observations, through :meth:`~LLMWrapperBase.act`)
into token ids, asks its backend to generate or score them, and writes the results into the
:mod:`chatenv.containers` so that ``prompt + response == full`` and masks and log-probs have the shape of
``tokens.full``. Its parts live in their own modules: options in :mod:`~wrappers.policies.config`, input readers
in :mod:`~wrappers.policies.inputs`, output assembly in :mod:`~wrappers.policies.outputs`, the sampling
distribution in :mod:`~wrappers.policies.logits` and :meth:`~LLMWrapperBase.get_dist`'s distributions in
:mod:`~wrappers.policies.distribution`. Backends (:class:`~wrappers.policies.TransformersWrapper`,
:class:`~wrappers.policies.VLLMWrapper`) implement four things only: generate ids, score ids, build a sibling
sharing their model for a new config, and (where the engine exposes them) full logits for
:meth:`~LLMWrapperBase.get_dist`.

Input modes:

- ``"history"``: chats as :class:`~chatenv.history.History`; prompts are rendered and tokenized with the chat
  template (exact assistant masks), responses are parsed back into messages.
- ``"text"``: rendered chat text; tokenized with special tokens recognised (text that spells the template's markup
  becomes markup).
- In both, an env's own token view given with the input (what :func:`chatenv.rollout` and ``act(...,
  token_views=...)`` pass) is used as is: generation starts after exactly the env's ids.
- ``"tokens"``: token ids, used verbatim; generated ids are returned verbatim (never decoded and re-encoded).
"""

from __future__ import annotations

import abc
import difflib
import functools
from collections.abc import Sequence
from typing import Any, Literal

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase

from chatenv.containers import Masks, Tokens
from chatenv.ids import token_ids
from chatenv.padding import tokenizer_pad_id
from chatenv.sampling import GenerationSettings
from chatenv.tokenization import ChatTokenizer, chat_tokenizer
from wrappers.policies.acting import ObservationActing
from wrappers.policies.config import FromConfig, PolicyConfig, refuse_option_attribute
from wrappers.policies.distribution import (
    MaskedCategorical,
    TorchRLDistributions,
    dist_positions,
    dist_request,
    masked_distribution,
)
from wrappers.policies.inputs import InputReader, Row, check_rows
from wrappers.policies.outputs import OutputWriter, Sample
from wrappers.policies.streaming import OnTokens, PolicyStream, streamed_generation

__all__ = ["LLMWrapperBase", "MaskedCategorical"]


class LLMWrapperBase(ObservationActing, TorchRLDistributions, TensorDictModuleBase, abc.ABC):
    """A language-model policy over chats, as a tensordict module.

    Backends take the options below as keyword arguments (see :meth:`PolicyConfig.from_arguments`) and expose
    each as a read-only attribute; :meth:`get_new_version` makes a copy with some of them changed.

    Args:
        tokenizer: A fast Hugging Face tokenizer.
        config: The policy's options:

            - ``template``: chat template name or object for history mode and assistant masks; default: the
              tokenizer's.
            - ``input_mode``: ``"history"``, ``"text"`` or ``"tokens"``.
            - ``input_key``: where the input is read; default ``(input_mode, "prompt")`` when generating and
              ``(input_mode, "full")`` when scoring.
            - ``attention_mask_key``: where a padded tokens-mode input's attention mask is read, when the input is
              a bare tensor rather than a :class:`~chatenv.containers.Tokens` (which carries its own lengths).
            - ``generate``: sample responses (True) or score the given full sequences (False).
            - ``generate_kwargs``: generation settings, see
              :class:`~chatenv.sampling.GenerationSettings`. When scoring, the sampling settings
              (temperature, top-k/p, min-p, min tokens, repetition penalty) define the distribution whose
              log-probs are returned, so a scoring copy of a generator scores what it sampled.
            - ``return_log_probs``: return log-probs of the generated tokens (default True; always True when
              scoring).
            - ``raw_log_probs``: return the model's own log-probs (temperature 1, no filtering) instead of those of
              the distribution sampled from. Greedy decoding always reports the model's own log-probs.
            - ``pad_output``: padded tensors (True) or nested jagged tensors holding exactly the sequences (False).
            - ``num_samples``: responses per prompt; outputs then have batch shape ``(B, num_samples)``.
            - ``inplace``: ``True``: write outputs into the input tensordict (default without ``num_samples``);
              ``False``: write into a shallow copy; ``"empty"``: return only the outputs. With ``num_samples``
              outputs go to a new ``(B, num_samples)`` tensordict.
            - ``history_key``, ``text_key``, ``tokens_key``, ``masks_key``, ``log_probs_key``: output keys of the
              containers (``None`` to skip one; tokens are always written).
            - ``requires_grad``: scoring keeps the autograd graph (backends with :attr:`differentiable` only).

    Outputs:
        ``tokens`` (:class:`~chatenv.containers.Tokens`), ``masks`` (:class:`~chatenv.containers.Masks`:
        attention and assistant masks), ``log_probs`` (:class:`~chatenv.containers.LogProbs`: position t is
        log p(x_t | x_<t); positions without a value are NaN), plus ``text`` (:class:`Text`) in text and history
        modes and ``history`` (:class:`ChatHistory`) in history mode.
    """

    backend: str = "base"
    # backend options (constructor arguments outside PolicyConfig) that get_new_version passes to _with_config
    version_options: tuple[str, ...] = ()
    # whether scoring can keep the autograd graph (requires_grad=True)
    differentiable: bool = False

    input_mode = FromConfig()
    input_key = FromConfig("resolved_input_key")
    generate = FromConfig()
    settings = FromConfig()
    return_log_probs = FromConfig()
    raw_log_probs = FromConfig()
    pad_output = FromConfig()
    num_samples = FromConfig()
    inplace = FromConfig("resolved_inplace")
    template = FromConfig()
    attention_mask_key = FromConfig()
    history_key = FromConfig()
    text_key = FromConfig()
    tokens_key = FromConfig()
    masks_key = FromConfig()
    log_probs_key = FromConfig()
    requires_grad = FromConfig()

    def __init__(self, *, tokenizer: Any, config: PolicyConfig):
        super().__init__()
        if not isinstance(config, PolicyConfig):
            raise TypeError(f"config must be a PolicyConfig, got {type(config).__name__}")
        if config.requires_grad and not self.differentiable:
            raise ValueError(
                f"{type(self).__name__} cannot keep an autograd graph (requires_grad=True); train through "
                "TransformersWrapper on the same weights"
            )
        self._config = config
        self._tokenizer = tokenizer
        self._chat_tokenizer = chat_tokenizer(tokenizer, config.template)
        self._pad_token_id = tokenizer_pad_id(tokenizer)
        # what ends a reply is the chat tokenizer's one definition; the user's extra stop ids come on top
        stops = self._chat_tokenizer.stop_ids
        self._stop_ids = stops + tuple(dict.fromkeys(i for i in config.settings.stop_token_ids if i not in stops))
        self._reader = InputReader(config, self._chat_tokenizer, self._pad_token_id)
        self._writer = OutputWriter(config, self._chat_tokenizer, self._pad_token_id)
        self.in_keys = [config.resolved_input_key]
        self.out_keys = config.out_keys
        self._generation_calls = 0

    @property
    def config(self) -> PolicyConfig:
        """Every option of this policy (frozen; change options with :meth:`get_new_version`)."""
        return self._config

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer."""
        return self._tokenizer

    @property
    def chat_tokenizer(self) -> ChatTokenizer:
        """The chat tokenizer (template rendering, assistant masks, reply parsing)."""
        return self._chat_tokenizer

    @property
    def pad_token_id(self) -> int:
        """The id padded token tensors are filled with (the tokenizer's pad id, else its EOS id)."""
        return self._pad_token_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a response: :attr:`ChatTokenizer.stop_ids` (end of turn, then EOS), then ``stop_token_ids``."""
        return self._stop_ids

    # ------------------------------------------------------------------------------------ backends

    @abc.abstractmethod
    def _generate_ids(
        self, prompts: list[list[int]], settings: GenerationSettings, on_tokens: OnTokens | None = None
    ) -> list[list[Sample]]:
        """Sample ``settings.num_samples`` responses per prompt; new tokens go to ``on_tokens`` as they come.

        See :mod:`wrappers.policies.streaming`; a backend that cannot stream may ignore ``on_tokens``.
        """

    @abc.abstractmethod
    def _score_ids(self, seqs: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
        """Per sequence, ``(T,)`` float32 log p(x_t | x_<t) (NaN at 0), under the reported distribution."""

    @abc.abstractmethod
    def _with_config(self, config: PolicyConfig, **options: Any) -> LLMWrapperBase:
        """A sibling sharing this one's model/engine, with ``config`` and the backend ``options`` given."""

    def _full_logits(self, seqs: list[list[int]], splits: list[int]) -> list[torch.Tensor]:
        """Per sequence, ``(T, V)`` logits of the distribution of each position (row 0 unused)."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot return full-vocabulary distributions (get_dist); score log-probs with "
            "log_prob(), or use TransformersWrapper"
        )

    def _vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def context_length(self) -> int | None:
        """Most tokens a sequence can hold (None if unknown)."""
        return None

    @functools.cached_property
    def _vocab_limit(self) -> int:
        return max(len(self.tokenizer), self._vocab_size())

    def _call_seed(self, seed: int) -> int:
        """The seed of this generation call: the given seed for the first call, then derived from it per call.

        A run is reproducible from its seed, and successive calls (turns of a rollout) draw fresh samples rather
        than repeating the first call's random numbers. Only calls that succeed count (:meth:`forward` counts
        them once their outputs are built): a refused or failed call leaves the sequence of seeds as it was.
        """
        calls = self._generation_calls
        return seed if calls == 0 else (seed * 6364136223846793005 + calls * 1442695040888963407) % (2**63)

    def _check_vocabulary(self) -> None:
        """Refuse a model whose vocabulary is smaller than the tokenizer's, and stop ids it does not have.

        Backends call this once their model is attached (at construction and for every new version).

        Raises:
            ValueError: Naming both sizes (and the fix), or the stop id outside the vocabulary.
        """
        model, tokenizer = self._vocab_size(), len(self.tokenizer)
        if model < tokenizer:
            raise ValueError(
                f"the model's vocabulary has {model} ids (config.vocab_size) but the tokenizer has {tokenizer} "
                "tokens: ids the tokenizer produces would index past the model's embeddings. Use the model's own "
                "tokenizer, or resize the model with model.resize_token_embeddings(len(tokenizer))"
            )
        for i in self.settings.stop_token_ids:
            if i >= self._vocab_limit:
                raise ValueError(
                    f"generate_kwargs['stop_token_ids'] holds {i}, outside the vocabulary [0, {self._vocab_limit}) of "
                    "the model and tokenizer"
                )

    # ------------------------------------------------------------------------------------ versions

    def get_new_version(self, **overrides: Any) -> LLMWrapperBase:
        """A copy of this policy with only the given options changed, sharing the model.

        Options that depend on others are re-derived rather than copied (see :meth:`PolicyConfig.evolve`): the
        default input key follows ``generate`` and ``input_mode`` unless ``input_key`` was given explicitly;
        generation settings are kept (a scoring copy scores the distribution its generator sampled from) and
        ``generate_kwargs`` given here are merged into them; a scoring copy drops ``num_samples``. Backend
        options (e.g. ``score_batch_size``) are kept unless given.

        Example:
            ``scorer = policy.get_new_version(generate=False)`` reads ``(mode, "full")`` and returns log-probs.

        Raises:
            TypeError: For an unknown option (with the closest known name) or generation setting.
            ValueError: For an invalid or contradictory value; this policy is left as it was.
        """
        known = sorted(PolicyConfig.option_names() | set(self.version_options))
        for name in overrides:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; options: {', '.join(known)}"
                raise TypeError(f"unknown policy option {name!r} for {type(self).__name__}.get_new_version{hint}")
        options = {name: overrides.pop(name) for name in self.version_options if name in overrides}
        return self._with_config(self.config.evolve(**overrides), **options)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_config" in self.__dict__:  # an option set as an attribute would change nothing: refuse it
            refuse_option_attribute(type(self).__name__, name)
        super().__setattr__(name, value)

    # ------------------------------------------------------------------------------------ calling

    def _rows(self, td: TensorDictBase) -> list[Row]:
        if td.batch_size[0] == 0:
            raise ValueError(
                f"empty batch: the input tensordict has batch shape {tuple(td.batch_size)}; give at least one row"
            )
        rows = self._reader.read(td)
        added = self.settings.max_new_tokens if self.generate else 0
        check_rows(rows, vocab=self._vocab_limit, context_length=self.context_length, max_new_tokens=added)
        return rows

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Generate or score for every row of ``tensordict`` (batch shape ``()`` or ``(B,)``).

        Raises:
            KeyError: If the input key is missing (naming the keys present).
            TypeError, ValueError: For an empty batch or an input the input mode cannot read (see
                :class:`~wrappers.policies.inputs.InputReader`); nothing is written to ``tensordict`` then.
        """
        if tensordict.batch_dims > 1:
            raise ValueError(
                f"expected a tensordict of batch shape () or (B,), got {tuple(tensordict.batch_size)}; "
                "reshape(-1) it first"
            )
        single = tensordict.batch_dims == 0
        rows = self._rows(tensordict.unsqueeze(0) if single else tensordict)
        if self.generate:
            batch, outputs = self._writer.generated(rows, self._generate_ids([r.ids for r in rows], self.settings))
            # the call succeeded: the next one derives its own seed (see _call_seed)
            self._generation_calls += 1
        else:
            lps = self._score_ids([r.ids for r in rows], [r.split for r in rows])
            batch, outputs = self._writer.scored(rows, lps)
        return self._place(tensordict, single, batch, outputs)

    def _place(self, tensordict: TensorDictBase, single: bool, batch: Any, outputs: dict[str, Any]) -> TensorDictBase:
        """The outputs written where ``inplace`` says (a new tensordict of batch ``batch`` with ``num_samples``)."""
        if self.num_samples is not None:
            target: TensorDictBase = TensorDict(batch_size=batch)
        elif self.inplace is True:
            target = tensordict
        elif self.inplace == "empty":
            target = tensordict.empty()
        else:
            target = tensordict.copy()
        for key, value in outputs.items():
            target.set(key, value[0] if single and self.num_samples is None else value)
        return target

    def stream(self, tensordict: TensorDictBase) -> PolicyStream:
        """Generate as :meth:`forward` does, reading the replies token by token while they are generated.

        The input is read and checked here, on the caller's thread (errors raise at once, before anything runs);
        the generation runs on a worker thread. Iterate the returned :class:`~wrappers.policies.streaming.PolicyStream`
        for :class:`~wrappers.policies.streaming.TokenDelta` s (for every row, its deltas joined are its reply's ids),
        then :meth:`~wrappers.policies.streaming.PolicyStream.result` gives what ``policy(tensordict)`` returns.

        Raises:
            ValueError: For a scoring policy, or an input the policy cannot read (as :meth:`forward`).
        """
        if not self.generate:
            raise ValueError("stream() generates; this policy scores (generate=False)")
        if tensordict.batch_dims > 1:
            raise ValueError(f"expected a tensordict of batch shape () or (B,), got {tuple(tensordict.batch_size)}")
        single = tensordict.batch_dims == 0
        rows = self._rows(tensordict.unsqueeze(0) if single else tensordict)

        def finish(samples: list[list[Sample]]) -> TensorDictBase:
            batch, outputs = self._writer.generated(rows, samples)
            self._generation_calls += 1  # the call succeeded: the next one derives its own seed
            return self._place(tensordict, single, batch, outputs)

        run = streamed_generation(self._generate_ids, [r.ids for r in rows], self.settings, finish)
        return PolicyStream(run, self.settings.num_samples)

    def score_sequences(
        self, sequences: Sequence[Sequence[int] | torch.Tensor], prompt_lengths: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Log-probs of raw id sequences under this policy's reported distribution (no tensordict involved).

        Args:
            sequences: Token id sequences (lists, arrays or 1-D tensors).
            prompt_lengths: Per sequence, how many leading ids are the prompt (where ``min_new_tokens`` starts
                counting); default: the whole sequence.

        Returns:
            Per sequence, a ``(T,)`` float32 tensor: position t is log p(x_t | x_<t); position 0 is NaN.

        Raises:
            ValueError: For empty sequences, ids outside the vocabulary, sequences longer than the context, or
                prompt lengths that do not fit.
        """
        seqs = [token_ids(s, f"sequence {b}") for b, s in enumerate(sequences)]
        if not seqs:
            return []
        splits = [len(s) for s in seqs] if prompt_lengths is None else [int(n) for n in prompt_lengths]
        if len(splits) != len(seqs) or any(not 0 <= n <= len(s) for n, s in zip(splits, seqs)):
            raise ValueError(f"prompt_lengths {splits} do not fit sequences of lengths {[len(s) for s in seqs]}")
        rows = [Row(s, [False] * len(s), n) for s, n in zip(seqs, splits)]
        check_rows(rows, vocab=self._vocab_limit, context_length=self.context_length)
        return self._score_ids(seqs, splits)

    def log_prob(self, tensordict: TensorDictBase) -> TensorDictBase:
        """Score the full sequences of ``tensordict`` (its ``log_probs`` entry holds the result).

        When ``tensordict`` holds :class:`~chatenv.containers.Tokens` (e.g. the output of a generation), those
        exact ids are scored, whatever the input mode: a generated reply is never decoded and re-encoded.
        """
        overrides: dict[str, Any] = {}
        if self.generate:
            overrides["generate"] = False
        if self.input_mode != "tokens" and isinstance(tensordict.get(self.tokens_key, None), Tokens):
            key = self.tokens_key
            overrides.update(input_mode="tokens", input_key=(key, "full") if isinstance(key, str) else (*key, "full"))
        scorer = self.get_new_version(**overrides) if overrides else self
        return scorer(tensordict)

    def get_dist(
        self,
        tensordict: TensorDictBase,
        mask: Literal["assistant", "response", "attention"] | torch.Tensor | None = None,
        padding_value: float | None = 0.0,
        *,
        mask_key: Any = None,
        padding_side: Literal["left", "right"] | None = None,
        **torchrl_options: Any,
    ) -> MaskedCategorical:
        """Per-position distributions over the vocabulary for the full sequences of ``tensordict``.

        Differentiable with respect to the model's parameters when the policy has ``requires_grad=True``.

        Args:
            tensordict: Holds the full sequences (as for scoring) at ``(input_mode, "full")``.
            mask: Which positions to keep: the assistant's tokens (default), the response tokens, every real token
                (``"attention"``), or a ``(B, T)`` bool tensor in the layout of the result. The first token of each
                sequence (no distribution) is always masked.
            padding_value: What masked positions give from ``log_prob`` / ``entropy`` (None: 0.0).
            mask_key: Instead of ``mask``: the key of such a bool tensor in ``tensordict``.
            padding_side: The result's layout: None: that of the input's padded ``tokens.full`` (prompts padded
                left, responses right); ``"left"`` / ``"right"``: each sequence flush right / left, as TorchRL pads
                nested sequences.
            **torchrl_options: TorchRL's ``get_dist`` keywords: ``logits_key`` and ``tensordict_out`` are accepted
                and unused (logits are computed, not read); ``as_padded_tensor``, ``as_nested_tensor`` and
                ``layout`` may only ask for the padded result this returns.

        Returns:
            A :class:`MaskedCategorical`; with the default layout, aligned with the padded ``tokens.full`` of the
            input (or of :meth:`log_prob`'s output).

        Raises:
            TypeError: For an unknown keyword.
            ValueError: For both ``mask`` and ``mask_key``, or options asking for a nested result.
        """
        mask = dist_request(tensordict, mask, mask_key, padding_side, torchrl_options)
        if self.generate or not self.pad_output:
            scorer = self.get_new_version(generate=False, pad_output=True)
            return scorer.get_dist(tensordict, mask, padding_value, padding_side=padding_side)
        rows = self._rows(tensordict.unsqueeze(0) if tensordict.batch_dims == 0 else tensordict)
        tokens = self._writer.tokens([r.ids[: r.split] for r in rows], [r.ids[r.split :] for r in rows])
        masks = Masks.from_tokens(tokens, [torch.tensor(r.assistant, dtype=torch.bool) for r in rows])
        positions = dist_positions(tensordict, self.input_key, masks.all_attention_mask, padding_side)
        logits = self._full_logits([r.ids for r in rows], [r.split for r in rows])
        pad = 0.0 if padding_value is None else padding_value
        return masked_distribution(tokens, masks, logits, "assistant" if mask is None else mask, pad, positions)

    def extra_repr(self) -> str:  # noqa: D102
        return (
            f"backend={self.backend!r}, input_mode={self.input_mode!r}, generate={self.generate}, "
            f"input_key={self.input_key!r}, pad_output={self.pad_output}, num_samples={self.num_samples}"
        )
