"""Every option of a policy wrapper, in one frozen, validated value.

A :class:`PolicyConfig` is checked once, when it is built (:meth:`PolicyConfig.from_arguments` for the
constructor arguments of a wrapper, or ``dataclasses.replace`` for a changed copy). A wrapper reads its options
from its config only, so a new version of a policy (:meth:`PolicyConfig.evolve`) cannot lose one.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import numpy as np

from chatenv.modes import MODES
from chatenv.sampling import GenerationSettings, normalize_generate_kwargs

__all__ = ["InputMode", "PolicyConfig"]

# the names of chatenv.modes.MODES, for type checkers
InputMode = Literal["history", "text", "tokens"]

_KEY_FIELDS = ("input_key", "attention_mask_key", "history_key", "text_key", "tokens_key", "masks_key", "log_probs_key")


def _key(key: Any) -> Any:
    """A nested tensordict key as a tuple (lists are accepted for convenience)."""
    return tuple(key) if isinstance(key, list) else key


@dataclass(frozen=True)
class PolicyConfig:
    """The options of a policy wrapper (see :class:`~wrappers.policies.base.LLMWrapperBase` for their meaning).

    Attributes:
        input_mode: ``"history"``, ``"text"`` or ``"tokens"``.
        input_key: The input key given explicitly, or None for the default (see :attr:`resolved_input_key`).
        generate: Sample responses (True) or score the given full sequences (False).
        settings: Generation settings; when scoring they define the distribution whose log-probs are returned.
        return_log_probs: Return log-probs (always True when scoring).
        raw_log_probs: Report the model's own log-probs instead of those of the distribution sampled from.
        pad_output: Padded tensors (True) or nested jagged tensors (False).
        num_samples: Responses per prompt, or None for one response and outputs of batch shape ``(B,)``. The
            source of truth: ``settings.num_samples`` is kept equal to it.
        inplace: ``True``, ``False``, ``"empty"``, or None for the default (see :attr:`resolved_inplace`).
        template: Chat template name or object, or None for the tokenizer's own.
        attention_mask_key: Where a bare padded tokens-mode input's attention mask is read.
        history_key: Output key of the :class:`~chatenv.containers.ChatHistory` (None: not written).
        text_key: Output key of the :class:`~chatenv.containers.Text` (None: not written).
        tokens_key: Output key of the :class:`~chatenv.containers.Tokens` (always written).
        masks_key: Output key of the :class:`~chatenv.containers.Masks` (None: not written).
        log_probs_key: Output key of the :class:`~chatenv.containers.LogProbs` (None: not written).
        requires_grad: Scoring (``generate=False`` calls, :meth:`log_prob`, :meth:`get_dist`) keeps the autograd
            graph, so a loss built on its log-probs or distributions trains the model. Generation never keeps one.
            Default False: scoring runs under ``torch.inference_mode()``.

    Example:
        >>> config = PolicyConfig.from_arguments(generate_kwargs={"n": 2, "temperature": 0.7})
        >>> config.num_samples, config.resolved_input_key, config.resolved_inplace
        (2, ('history', 'prompt'), False)
        >>> scorer = config.evolve(generate=False)
        >>> scorer.num_samples, scorer.resolved_input_key, scorer.settings.temperature
        (None, ('history', 'full'), 0.7)
    """

    input_mode: InputMode = "history"
    input_key: Any = None
    generate: bool = True
    settings: GenerationSettings = field(default_factory=GenerationSettings)
    return_log_probs: bool = True
    raw_log_probs: bool = False
    pad_output: bool = True
    num_samples: int | None = None
    inplace: bool | Literal["empty"] | None = None
    template: Any = None
    attention_mask_key: Any = "attention_mask"
    history_key: Any = "history"
    text_key: Any = "text"
    tokens_key: Any = "tokens"
    masks_key: Any = "masks"
    log_probs_key: Any = "log_probs"
    requires_grad: bool = False

    def __post_init__(self) -> None:
        for name in _KEY_FIELDS:
            object.__setattr__(self, name, _key(getattr(self, name)))
        for name in ("generate", "return_log_probs", "raw_log_probs", "pad_output", "requires_grad"):
            object.__setattr__(self, name, _flag(name, getattr(self, name)))
        _check_mode_and_keys(self)
        _check_num_samples(self.num_samples)
        if self.num_samples is not None:
            object.__setattr__(self, "num_samples", int(self.num_samples))
        _check_scoring(self)
        _check_inplace(self)
        object.__setattr__(self, "settings", _synced(self.settings, self.num_samples))

    @classmethod
    def from_arguments(
        cls,
        *,
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
        requires_grad: bool = False,
    ) -> PolicyConfig:
        """The config of a wrapper's constructor arguments (``generate_kwargs`` normalized, ``n`` reconciled).

        Raises:
            ValueError: For an invalid or contradictory option, with the value and the fix.
            TypeError: For an unknown generation setting.
        """
        settings = normalize_generate_kwargs(generate_kwargs)
        if not generate and return_log_probs is False:
            raise ValueError("scoring (generate=False) returns log-probs only; return_log_probs=False leaves nothing")
        return cls(
            input_mode=input_mode,
            input_key=input_key,
            generate=generate,
            settings=settings,
            return_log_probs=True if return_log_probs is None else return_log_probs,
            raw_log_probs=raw_log_probs,
            pad_output=pad_output,
            num_samples=_merge_num_samples(num_samples, settings),
            inplace=inplace,
            template=template,
            attention_mask_key=attention_mask_key,
            history_key=history_key,
            text_key=text_key,
            tokens_key=tokens_key,
            masks_key=masks_key,
            log_probs_key=log_probs_key,
            requires_grad=requires_grad,
        )

    # ------------------------------------------------------------------------------------ derived values

    @property
    def resolved_input_key(self) -> Any:
        """Where the input is read: the explicit key, else ``(input_mode, "prompt" | "full")`` (generate | score)."""
        if self.input_key is not None:
            return self.input_key
        return (self.input_mode, "prompt" if self.generate else "full")

    @property
    def resolved_inplace(self) -> bool | Literal["empty"]:
        """Where outputs go: the explicit choice, else in place unless ``num_samples`` reshapes the batch."""
        return self.num_samples is None if self.inplace is None else self.inplace

    @property
    def out_keys(self) -> list[Any]:
        """The keys a call writes."""
        keys = [self.tokens_key, self.masks_key]
        if self.return_log_probs:
            keys.append(self.log_probs_key)
        if self.input_mode in ("history", "text"):
            keys.append(self.text_key)
        if self.input_mode == "history":
            keys.append(self.history_key)
        return [k for k in keys if k is not None]

    # ------------------------------------------------------------------------------------ versions

    @staticmethod
    def option_names() -> frozenset[str]:
        """The names :meth:`evolve` takes (the wrapper constructor's options, ``generate_kwargs`` included)."""
        return _OPTIONS

    def evolve(self, **overrides: Any) -> PolicyConfig:
        """A copy with the given options changed and the options that depend on them re-derived.

        ``overrides`` take the names of the wrapper constructor (``generate_kwargs`` included). Re-derived:

        - the input key, unless it was given explicitly, follows ``generate`` and ``input_mode``;
        - ``generate_kwargs`` are merged into the current settings (``n`` / ``num_samples`` among them sets
          :attr:`num_samples`);
        - a scoring version (``generate=False``) drops the inherited ``num_samples`` (scoring takes the samples as
          its input), the ``inplace`` choice that came with it, and returns log-probs.

        Raises:
            TypeError: For an unknown option (with the closest known name).
        """
        changes = dict(overrides)
        _check_names(changes)
        if "generate_kwargs" in changes:
            extra = normalize_generate_kwargs(changes.pop("generate_kwargs"))
            changes["settings"] = self.settings.with_overrides(**extra.as_kwargs())
            if "num_samples" in extra.explicit:
                changes["num_samples"] = _merge_num_samples(changes.get("num_samples"), extra)
        if not changes.get("generate", self.generate):
            self._scoring_changes(changes, asked=set(changes))
        return replace(self, **changes)

    def _scoring_changes(self, changes: dict[str, Any], asked: set[str]) -> None:
        """What a scoring version changes besides the options in ``asked``."""
        if "num_samples" not in asked:
            changes["num_samples"] = None
            changes["settings"] = changes.get("settings", self.settings).without("num_samples")
            if self.num_samples is not None and "inplace" not in asked:
                changes["inplace"] = None
        if "return_log_probs" not in asked:
            changes["return_log_probs"] = True


_FIELDS = frozenset(f.name for f in fields(PolicyConfig))
_OPTIONS = (_FIELDS - {"settings"}) | {"generate_kwargs"}


# ------------------------------------------------------------------------------------ checks


def _check_names(changes: Mapping[str, Any]) -> None:
    for name in changes:
        if name not in _OPTIONS:
            close = difflib.get_close_matches(name, sorted(_OPTIONS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; options: {', '.join(sorted(_OPTIONS))}"
            raise TypeError(f"unknown policy option {name!r}{hint}")


def _check_mode_and_keys(config: PolicyConfig) -> None:
    if not isinstance(config.input_mode, str) or config.input_mode not in MODES:
        raise ValueError(f"input_mode must be one of {tuple(MODES)}, got {config.input_mode!r}")
    if config.tokens_key is None:
        raise ValueError("tokens_key cannot be None: token ids are always returned")
    if not isinstance(config.settings, GenerationSettings):
        raise TypeError(f"settings must be GenerationSettings, got {type(config.settings).__name__}")


def _flag(name: str, value: Any) -> bool:
    """A bool option: True/False only (a truthy string such as ``"no"`` is refused, not read as True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def _check_num_samples(num_samples: Any) -> None:
    if num_samples is None:
        return
    if isinstance(num_samples, (bool, np.bool_)) or not isinstance(num_samples, (int, np.integer)):
        raise TypeError(f"num_samples must be a positive int, got {num_samples!r} ({type(num_samples).__name__})")
    if num_samples < 1:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")


def _check_scoring(config: PolicyConfig) -> None:
    if config.generate:
        return
    if not config.return_log_probs:
        raise ValueError("scoring (generate=False) returns log-probs only; return_log_probs=False leaves nothing")
    if config.num_samples is not None:
        raise ValueError("num_samples applies to generation; scoring takes the samples as its input")
    if config.settings.grammar is not None:
        raise ValueError(
            "scoring does not apply a grammar (generate_kwargs['grammar']): a constrained generation reports its "
            "log-probs as it generates; score without the grammar for the model's own distribution"
        )


def _check_inplace(config: PolicyConfig) -> None:
    if config.inplace not in (None, True, False, "empty"):
        raise ValueError(f"inplace must be True, False or 'empty', got {config.inplace!r}")
    if config.inplace is True and config.num_samples is not None:
        raise ValueError(
            "inplace=True cannot hold num_samples responses per prompt in the (B,) input; use inplace=False "
            "or 'empty' (outputs come in a new (B, num_samples) tensordict)"
        )


def _merge_num_samples(num_samples: int | None, settings: GenerationSettings) -> int | None:
    """``num_samples`` given as an argument and/or as ``n`` in the generation settings: one value, or an error."""
    _check_num_samples(num_samples)
    if "num_samples" not in settings.explicit:
        return num_samples
    if num_samples is not None and settings.num_samples != num_samples:
        raise ValueError(
            f"num_samples={num_samples} conflicts with generate_kwargs n/num_samples={settings.num_samples}"
        )
    return settings.num_samples


def _synced(settings: GenerationSettings, num_samples: int | None) -> GenerationSettings:
    """``settings`` with their sample count equal to ``num_samples`` (explicit exactly when it is set)."""
    if num_samples is None:
        return settings.without("num_samples") if "num_samples" in settings.explicit else settings
    if settings.num_samples == num_samples and "num_samples" in settings.explicit:
        return settings
    return replace(settings, num_samples=num_samples, explicit=settings.explicit | {"num_samples"})


class FromConfig:
    """A read-only policy attribute, read from the policy's :class:`PolicyConfig` (``source``: the field's name)."""

    def __init__(self, source: str | None = None):
        self.source = source

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.source = self.source or name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj.config, self.source)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(
            f"{self.name} is read-only; make a policy with it changed with policy.get_new_version({self.name}=...)"
        )


# names a user may try to set on a policy that are not read-only views of the config: generation settings and
# the constructor's generate_kwargs
_OPTION_ATTRIBUTES = frozenset(
    {"config", "generate_kwargs"} | {f.name for f in fields(GenerationSettings)} - {"explicit", "num_samples"}
)


def refuse_option_attribute(owner: str, name: str) -> None:
    """Refuse setting option ``name`` as an attribute of a policy of class ``owner`` (it would change nothing).

    Raises:
        AttributeError: Naming the ``get_new_version`` call that makes a policy with the option changed.
    """
    if name not in _OPTION_ATTRIBUTES:
        return
    if name == "config":
        hint = "option=..."
    elif name == "generate_kwargs":
        hint = "generate_kwargs={...}"
    else:
        hint = f"generate_kwargs={{{name!r}: ...}}"
    raise AttributeError(
        f"{name} is not a settable attribute of {owner}: options live in the policy's frozen config; make a policy "
        f"with it changed with policy.get_new_version({hint})"
    )
