"""A token-step policy for :class:`~chatenv.envs.TokenEnv`: one token per env per call, with a KV cache.

Stepping a token-level env with a plain forward per step re-reads the whole context each time (O(T²) over an
episode). :class:`TokenStepPolicy` keeps the model's key/value cache across calls, batched over a vector of envs:
each call feeds only the tokens each env's observation gained since the last call (its previous action, or the
task's messages and the next header after a finished reply), so a step costs about one incremental forward.

It samples from the distribution :func:`~wrappers.policies.logits.process_logits` defines, the one the policy
wrappers generate from and score, so its log-probs equal a :class:`~wrappers.policies.TransformersWrapper`'s
scoring log-probs of the same tokens under the same settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from chatenv.ids import check_id_dtype, check_vocab, token_id_array, token_ids
from chatenv.padding import tokenizer_pad_id
from chatenv.sampling import GenerationSettings, normalize_generate_kwargs
from wrappers.policies.logits import process_logits, reports_processed, seen_tokens

__all__ = ["TokenStepPolicy"]

# a cache wider than this many times its longest live row (dead entries of rebuilt rows, padding between chunks)
# is rebuilt from the observations: memory stays proportional to the live tokens, and the rebuilds cost a
# constant factor of the tokens fed
_COMPACT_FACTOR = 2

# settings a token step cannot honour: where a reply ends is the env's decision (TokenEnv ends it at its
# end-of-turn ids, and truncates at its own max_new_tokens), and one call draws one token per observation
_REFUSED = {
    "stop": "stop strings",
    "stop_token_ids": "extra stop ids",
    "ignore_eos": "ignore_eos",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


# the settings a token step honours, readable as attributes of the policy (policy.temperature, ...)
_HONOURED = frozenset({"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "min_new_tokens", "seed"})


def _settings(
    settings: GenerationSettings | Mapping[str, Any] | None, keywords: Mapping[str, Any]
) -> GenerationSettings:
    """``settings`` with ``keywords`` over them, checked once (``max_new_tokens`` is the env's, never taken here)."""
    given = normalize_generate_kwargs(
        {**(settings if isinstance(settings, Mapping) else {}), **keywords}, budget_elsewhere=True
    )
    if "max_new_tokens" in given.explicit:
        raise ValueError(
            f"TokenStepPolicy does not bound replies (got max_new_tokens={given.max_new_tokens}): the env does "
            "(TokenEnv's max_new_tokens); drop the setting"
        )
    base = settings.without("max_new_tokens").as_kwargs() if isinstance(settings, GenerationSettings) else {}
    out = normalize_generate_kwargs({**base, **given.as_kwargs()}, budget_elsewhere=True)
    _check_supported(out)
    return out


def _check_supported(settings: GenerationSettings) -> None:
    defaults = GenerationSettings()
    for name, what in _REFUSED.items():
        if getattr(settings, name) != getattr(defaults, name):
            raise ValueError(
                f"TokenStepPolicy cannot honour {what} ({name}={getattr(settings, name)!r}): it draws one token per "
                "observation and the env decides where a reply ends (TokenEnv ends it at its end-of-turn ids and "
                "truncates at its max_new_tokens); drop the setting"
            )
    if settings.num_samples != 1:
        raise ValueError(
            f"TokenStepPolicy draws one token per observation, got num_samples={settings.num_samples}; step "
            "num_samples envs instead"
        )


class TokenStepPolicy:
    """Samples the next token for each observation, reusing the KV cache between calls.

    Args:
        model: A transformers causal LM.
        tokenizer: Its tokenizer (for the pad id, and the end-of-turn ids when ``end_ids`` is not given).
        settings: Sampling settings: a :class:`~chatenv.sampling.GenerationSettings` (a policy's, whose
            ``max_new_tokens`` is ignored) or ``generate_kwargs`` (default: every default). Honoured: ``temperature``
            (0: greedy), ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` (on tokens already in the
            observation, prompt included), ``min_new_tokens`` and ``seed`` (of the sampling generator), each readable
            as an attribute of the policy. ``min_new_tokens`` forbids the end ids for the first tokens of each reply:
            those this policy sampled for a row since its observation last grew by something else than the previous
            action (a reset, or the task's messages and a new assistant header). The other settings raise.
        end_ids: The ids ``min_new_tokens`` forbids; default (with ``min_new_tokens``): what ends a reply,
            :attr:`ChatTokenizer.stop_ids <chatenv.tokenization.ChatTokenizer.stop_ids>` (the end-of-turn ids of
            the tokenizer's chat template, then its EOS id).
        raw_log_probs: Report the model's own log-probs instead of those of the distribution sampled from
            (greedy decoding always reports the model's own).
        **generate_kwargs: Settings by name, over ``settings`` (``temperature=0.7, seed=0``).

    Raises:
        SettingError: For a setting out of range (:mod:`chatenv.sampling`).
        ValueError: For a setting a token step cannot honour (stop strings and extra stop ids, ``ignore_eos``,
            ``num_samples``, presence and frequency penalties, ``max_new_tokens``).

    :meth:`act` takes a batch of observations (int64 id arrays). A row continues when its observation is the
    previous one followed by the previous action (and whatever the env appended after it): this is decided in
    O(1) from the stored length, the previous last id and the action, and only the new tokens are fed. Any other
    row (a reset, another episode) is rebuilt alone from its observation, within the same forward pass; a new
    batch size rebuilds every row. Call :meth:`reset` when feeding observations that are not continuations but
    could pass for them. A call that raises leaves the policy as it was (its cache is rebuilt on the next call).

    Example:
        >>> from chatenv import TokenEnv, load_default_model
        >>> model, tokenizer = load_default_model()
        >>> env = TokenEnv("arithmetic", tokenizer=tokenizer)
        >>> obs, _ = env.reset(seed=0)
        >>> policy = TokenStepPolicy(model, tokenizer, temperature=0.7, min_new_tokens=1, seed=0)
        >>> actions, log_probs = policy.act([obs])
        >>> actions.shape, bool(actions[0] in env.chat_tokenizer.end_of_turn_ids)
        ((1,), False)
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        settings: GenerationSettings | Mapping[str, Any] | None = None,
        *,
        end_ids: Sequence[int] | None = None,
        raw_log_probs: bool = False,
        **generate_kwargs: Any,
    ):
        self.settings = _settings(settings, generate_kwargs)
        self.model = model
        self.tokenizer = tokenizer
        self.raw_log_probs = bool(raw_log_probs)
        self.pad_token_id = tokenizer_pad_id(tokenizer)
        if end_ids is None:
            end_ids = _default_end_ids(tokenizer) if self.settings.min_new_tokens else ()
        self.end_ids: tuple[int, ...] = _checked_end_ids(end_ids, model, tokenizer)
        self.generator = torch.Generator(device=next(model.parameters()).device)
        if self.settings.seed is not None:
            self.generator.manual_seed(self.settings.seed)
        self.reset()

    @classmethod
    def from_wrapper(cls, policy: Any) -> TokenStepPolicy:
        """The token-step version of a :class:`~wrappers.policies.TransformersWrapper`: same model, same sampling.

        Every sampling setting carries over (temperature, top-k, top-p, min-p, repetition penalty, min tokens with
        the wrapper's stop ids, seed, ``raw_log_probs``). ``max_new_tokens`` is the env's (``TokenEnv``'s own
        budget); settings a token step cannot honour (stop strings and extra stop ids, ``ignore_eos``,
        ``num_samples``, presence and frequency penalties) raise instead of being dropped.

        Raises:
            TypeError: If ``policy`` has no transformers model (e.g. a vLLM policy).
            ValueError: For a setting a token step cannot honour.
        """
        model = getattr(policy, "model", None)
        if model is None or not hasattr(model, "config"):
            raise TypeError(
                f"from_wrapper needs a policy over a transformers model (TransformersWrapper), got "
                f"{type(policy).__name__}"
            )
        return cls(
            model, policy.tokenizer, policy.settings, end_ids=policy.stop_ids, raw_log_probs=policy.raw_log_probs
        )

    def __getattr__(self, name: str) -> Any:
        """The honoured settings as attributes (``policy.temperature``, ``policy.top_k``, ...)."""
        settings = self.__dict__.get("settings")
        if name in _HONOURED and settings is not None:
            return getattr(settings, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def reset(self) -> None:
        """Forget the cache (the next call rebuilds it) and the replies in progress."""
        self._lens: list[int] = []  # per row, how many ids its last observation had (and the cache holds)
        self._lasts: list[int] = []  # per row, the last id of that observation
        self._actions: list[int] = []
        self._counts: list[int] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None  # (B, L) bool: the cache's live positions

    @property
    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def act(self, observations: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
        """Next token and its log-prob for each observation: ``(actions (B,), log_probs (B,))``.

        Args:
            observations: A batch of observations (a list of 1-D integer id arrays, or a ``(B, T)`` array); one
                observation goes in a list of one.

        Raises:
            TypeError: For something else than a batch of 1-D integer id sequences (float ids are never rounded).
            ValueError: For an empty batch or observation, ids outside the model's vocabulary, or an observation
                longer than the model's context. A refused or failed call leaves the policy as it was.
        """
        rows = _read_batch(observations)
        self._check(rows)
        grown = self._grown(rows)
        counts = [n + 1 if g == 1 else 0 for g, n in zip(grown, self._counts)] if grown else [0] * len(rows)
        try:
            logits, cache, mask = self._forward(rows, grown)
            actions, log_probs = self._sample(logits, rows, counts)
        except BaseException:
            # the forward may have appended to the shared cache: drop it rather than keep ids no row holds
            self._cache, self._mask = None, None
            raise
        self._cache, self._mask, self._counts = cache, mask, counts
        self._lens, self._lasts = [len(r) for r in rows], [int(r[-1]) for r in rows]
        self._actions = actions.tolist()
        return actions.cpu().numpy(), log_probs.cpu().numpy()

    def _check(self, rows: list[np.ndarray]) -> None:
        config = self.model.config.get_text_config()
        vocab, limit = int(config.vocab_size), getattr(config, "max_position_embeddings", None)
        for b, r in enumerate(rows):
            if not len(r):
                raise ValueError(f"observation {b} is empty; token ids are needed to predict the next one")
            check_vocab(r, vocab, f"observation {b}", owner="the model")
            if limit is not None and len(r) >= limit:
                raise ValueError(
                    f"observation {b} has {len(r)} tokens; the model's context holds {limit} (the next token needs "
                    f"at most {limit - 1} before it)"
                )

    def _grown(self, rows: list[np.ndarray]) -> list[int] | None:
        """Per row, how many ids it gained since the last call if it continues that row's observation, else 0.

        A row continues when it is longer than before and holds the previous last id and then the previous action
        where they belong (O(1) per row). None when the batch size changed (nothing continues).
        """
        if len(rows) != len(self._lens):
            return None
        return [
            len(r) - n if len(r) > n and r[n - 1] == last and r[n] == a else 0
            for r, n, last, a in zip(rows, self._lens, self._lasts, self._actions)
        ]

    def _forward(self, rows: list[np.ndarray], grown: list[int] | None) -> tuple[torch.Tensor, Any, torch.Tensor]:
        """Feed each row's new tokens; ``(logits of each row's last token, the cache, its live mask)``.

        Rows that continue feed their new ids after the cache; the others feed their whole observation, their old
        cache entries masked out. The cache is rebuilt from scratch when no row continues or when dead entries and
        padding make it too wide. Nothing of this object is changed here except the cache's contents.
        """
        keep = self._cache is not None and grown is not None and any(grown)
        if keep:
            live = self._mask.clone()
            live[[b for b, g in enumerate(grown) if not g]] = False
            chunks = [r[len(r) - g :] if g else r for r, g in zip(rows, grown)]
            keep = live.shape[1] <= _COMPACT_FACTOR * max(len(r) for r in rows)
        if not keep:
            live, chunks = None, rows
        width = max(len(c) for c in chunks)
        ids = torch.full((len(chunks), width), self.pad_token_id, dtype=torch.long)
        chunk_mask = torch.zeros((len(chunks), width), dtype=torch.bool)
        for b, c in enumerate(chunks):
            ids[b, width - len(c) :] = torch.tensor(c, dtype=torch.long)
            chunk_mask[b, width - len(c) :] = True
        mask = torch.cat([live, chunk_mask], dim=1) if keep else chunk_mask
        # positions count live tokens only, so padding and dead entries (left or between chunks) do not shift them
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -width:]
        device = self._device
        with torch.inference_mode():
            out = self.model(
                input_ids=ids.to(device),
                attention_mask=mask.long().to(device),
                position_ids=positions.to(device),
                past_key_values=self._cache if keep else None,
                use_cache=True,
            )
        return out.logits[:, -1].float(), out.past_key_values, mask

    def _sample(
        self, logits: torch.Tensor, rows: list[np.ndarray], counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw from the processed ``(B, V)`` logits; log-probs of the reported distribution."""
        s = self.settings
        seen = seen_tokens(rows, logits.shape[-1], logits.device) if s.repetition_penalty != 1.0 else None
        new = torch.tensor(counts, dtype=torch.long) if s.min_new_tokens else None
        processed = process_logits(logits, s, stop_ids=self.end_ids, new_tokens=new, seen=seen)
        if s.greedy:
            actions = processed.argmax(-1)
        else:
            actions = torch.multinomial(processed.softmax(-1), 1, generator=self.generator).squeeze(-1)
        reported = processed if reports_processed(s, self.raw_log_probs) else logits
        return actions, reported.log_softmax(-1).gather(-1, actions[:, None]).squeeze(-1)


def _read_batch(observations: Any) -> list[np.ndarray]:
    """A batch of observations as int64 id arrays, checked (see :func:`chatenv.ids.token_id_array`)."""
    if isinstance(observations, (torch.Tensor, np.ndarray)):
        check_id_dtype(observations, "TokenStepPolicy.act")
        if observations.ndim != 2:
            raise TypeError(
                f"TokenStepPolicy.act takes a batch of observations: a list of id arrays or a (B, T) array, got shape "
                f"{tuple(observations.shape)}; pass one observation as act([obs])"
            )
    elif not isinstance(observations, Sequence) or isinstance(observations, (str, bytes)):
        raise TypeError(
            f"TokenStepPolicy.act takes a batch (a list) of token id observations, got {type(observations).__name__}"
        )
    elif observations and all(isinstance(o, (int, np.integer)) for o in observations):
        raise TypeError(
            "TokenStepPolicy.act takes a batch of observations, got one flat list of ids; pass one observation as "
            "act([obs])"
        )
    if len(observations) == 0:
        raise ValueError("TokenStepPolicy.act got an empty batch; give at least one observation")
    return [token_id_array(o, f"observation {b}") for b, o in enumerate(observations)]


def _checked_end_ids(end_ids: Sequence[int], model: Any, tokenizer: Any) -> tuple[int, ...]:
    """The end ids, refused when the model's vocabulary is smaller than the tokenizer's or does not hold them."""
    vocab = int(model.config.get_text_config().vocab_size)
    if vocab < len(tokenizer):
        raise ValueError(
            f"the model's vocabulary has {vocab} ids (config.vocab_size) but the tokenizer has {len(tokenizer)} "
            "tokens; use the model's own tokenizer, or resize the model with "
            "model.resize_token_embeddings(len(tokenizer))"
        )
    return tuple(token_ids(list(end_ids), "end_ids", vocab_size=vocab, owner="the model"))


def _default_end_ids(tokenizer: Any) -> tuple[int, ...]:
    """What ends a reply: :attr:`ChatTokenizer.stop_ids <chatenv.tokenization.ChatTokenizer.stop_ids>`."""
    from chatenv.tokenization import chat_tokenizer

    return chat_tokenizer(tokenizer).stop_ids
