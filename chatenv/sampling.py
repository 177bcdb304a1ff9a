"""Sampling settings: one value type, validated once, for every backend and every edge.

Users write ``generate_kwargs`` once; :func:`normalize_generate_kwargs` checks them and maps synonyms from the
Hugging Face, vLLM and OpenAI vocabularies onto one canonical name each, giving a :class:`GenerationSettings`.
Every edge maps its own vocabulary to it (the policy wrappers' ``generate_kwargs``, a chat-completions request in
:mod:`chatenv.serve.request`, TRL's arguments, the CLI's flags) and words a refusal with the name its caller used
(:meth:`SettingError.describe`). Backends translate the canonical settings into their own calls, and reject the few
settings they cannot honour instead of dropping them.
"""

from __future__ import annotations

import difflib
import functools
import math
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from chatenv.errors import ChatEnvError

__all__ = [
    "MAX_TOP_LOGPROBS",
    "MIN_TEMPERATURE",
    "GenerationSettings",
    "SettingError",
    "SettingTypeError",
    "SettingValueError",
    "normalize_generate_kwargs",
]

# Dividing logits by a temperature this small overflows low-precision logits to inf (NaN after softmax) and
# makes sampling numerically greedy anyway: below it, ask for greedy decoding explicitly.
MIN_TEMPERATURE = 1e-4

#: the most alternatives per token ``top_logprobs`` may ask for (OpenAI's limit)
MAX_TOP_LOGPROBS = 20

# synonym -> canonical name
_SYNONYMS = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "n": "num_samples",
    "num_return_sequences": "num_samples",
    "stop_strings": "stop",
}


class SettingError(ChatEnvError):
    """A generation setting refused: which one, and what is wrong with it (with the values that would do).

    Raised as :class:`SettingTypeError` (a ``TypeError``) or :class:`SettingValueError` (a ``ValueError``).

    Args:
        problem: What is wrong, worded to follow the setting's name (``"must be >= 1, got 0"``); for a refusal that
            names no single value (``key=None``), the whole message.
        setting: The canonical name of the setting at fault (None: the refusal is not about a known setting).
        key: The name the value was given under (default: ``setting``); the message names it as
            ``generate_kwargs[key]``.

    Attributes:
        setting: As given.
        key: As given.
        problem: As given.
    """

    def __init__(self, problem: str, *, setting: str | None, key: str | None = None):
        self.setting, self.key, self.problem = setting, key or setting, problem
        super().__init__(self.describe(f"generate_kwargs[{self.key!r}]"))

    def describe(self, name: str) -> str:
        """The message with the setting called ``name``: how the caller's own vocabulary spells it.

        Example:
            >>> SettingValueError("must be >= 1, got 0", setting="max_new_tokens").describe("--max-new-tokens")
            '--max-new-tokens must be >= 1, got 0'
        """
        return f"{name} {self.problem}" if self.key is not None else self.problem

    def renamed(self, name: str) -> SettingError:
        """The same refusal (same class), its message naming the setting ``name``: an argument's, a flag's."""
        error = type(self)(self.problem, setting=self.setting, key=self.key)
        error.args = (self.describe(name),)
        return error


class SettingTypeError(SettingError, TypeError):
    """A generation setting of the wrong type, or an unknown one."""


class SettingValueError(SettingError, ValueError):
    """A generation setting out of range, or settings that contradict each other."""


@dataclass(frozen=True)
class GenerationSettings:
    """Canonical generation settings.

    Attributes:
        max_new_tokens: Most tokens generated per response.
        min_new_tokens: End-of-turn tokens are forbidden before this many tokens.
        temperature: Sampling temperature; 0 means greedy decoding (otherwise at least ``MIN_TEMPERATURE``).
        top_p: Nucleus sampling mass (1.0: off).
        top_k: Keep the k most likely tokens (0: off).
        min_p: Drop tokens below ``min_p`` times the top probability (0.0: off).
        repetition_penalty: Penalty on tokens already in the sequence, prompt included (1.0: off).
        presence_penalty: Additive penalty on tokens already generated (0.0: off; vLLM only).
        frequency_penalty: Penalty proportional to counts of generated tokens (0.0: off; vLLM only).
        num_samples: Responses per prompt.
        stop: Strings that end a response (the string stays in the response).
        stop_token_ids: Extra token ids that end a response, besides the end-of-turn and EOS tokens.
        ignore_eos: Keep generating after end-of-turn / EOS tokens (until ``max_new_tokens``).
        seed: Seed for sampling: a policy's sequence of calls is reproducible from it (each call derives its own
            seed from it and the call count, so successive calls draw fresh samples).
        top_logprobs: How many of the most likely tokens to report with each generated token, with their log-probs
            under the distribution reported for the generated tokens (0: none; at most ``MAX_TOP_LOGPROBS``).
        grammar: Constrained decoding: an EBNF grammar (xgrammar's dialect) every reply must match, then end
            (:mod:`chatenv.templates.forced_calls` builds one for a forced tool call). Tokens the grammar forbids
            are removed from the distribution before the temperature and filters; the generated tokens' log-probs
            are those of that restricted, renormalized distribution (see the policy wrappers). None: free sampling.
        explicit: The names the user set (the others hold defaults).
    """

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_samples: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs: int = 0
    grammar: str | None = None
    explicit: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (temperature 0)."""
        return self.temperature == 0.0

    @property
    def reshapes_distribution(self) -> bool:
        """Whether sampling draws from something else than the model's own distribution."""
        return not self.greedy and (
            self.temperature != 1.0
            or self.top_p < 1.0
            or self.top_k > 0
            or self.min_p > 0.0
            or self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_new_tokens > 0
            or self.grammar is not None
        )

    def as_kwargs(self) -> dict[str, Any]:
        """The settings the user gave (or that differ from the defaults), by canonical name.

        What :meth:`with_overrides` starts from; an instance built directly (``GenerationSettings(top_k=5)``) has
        no ``explicit`` names, and its values that differ from the defaults count as given.
        """
        out = {}
        for f in fields(self):
            if f.name == "explicit":
                continue
            value = getattr(self, f.name)
            if f.name in self.explicit or value != f.default:
                out[f.name] = value
        return out

    def with_overrides(self, **kwargs: Any) -> GenerationSettings:
        """A copy with some settings changed (checked like the constructor's)."""
        return normalize_generate_kwargs({**self.as_kwargs(), **kwargs})

    def without(self, name: str) -> GenerationSettings:
        """A copy with setting ``name`` back at its default (and no longer explicit)."""
        default: Any = getattr(type(self)(), name)
        return replace(self, **{name: default}, explicit=self.explicit - {name})


_NAMES = [f.name for f in fields(GenerationSettings) if f.name != "explicit"]


# ------------------------------------------------------------------------------------ per-name checks


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        # a whole float (2.0) is that int; 2.5 is refused, never truncated
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise SettingTypeError(f"must be an int >= {low}, got {value!r}", setting=name)
    number = int(value)
    if number < low:
        raise SettingValueError(f"must be >= {low}, got {number}", setting=name)
    return number


def _float(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False) -> float:
    bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingTypeError(f"must be a number in {bound}, got {value!r}", setting=name)
    number = float(value)
    if not math.isfinite(number):
        raise SettingValueError(f"must be a finite number in {bound}, got {number}", setting=name)
    if number < low or number > high or (low_open and number == low):
        raise SettingValueError(f"must be in {bound}, got {number}", setting=name)
    return number


def _temperature(name: str, value: Any) -> float:
    number = _float(name, value, 0.0)
    if 0.0 < number < MIN_TEMPERATURE:
        raise SettingValueError(
            f"is too small to sample with ({number}: logits / temperature overflow to inf/NaN); use temperature=0 "
            f"for greedy decoding, or a temperature >= {MIN_TEMPERATURE}",
            setting=name,
        )
    return number


def _top_k(name: str, value: Any) -> int:
    if value is None or (not isinstance(value, bool) and value == -1):
        return 0
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        raise SettingValueError(f"must be >= 0 (0 or -1: no top-k filter), got {value}", setting=name)
    return _int(name, value, 0)


def _stop(name: str, value: Any) -> tuple[str, ...]:
    value = [value] if isinstance(value, str) else ([] if value is None else value)
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, Iterable):
        raise SettingTypeError(f"must be a non-empty str or a list of them, got {value!r}", setting=name)
    value = list(value)
    if not all(isinstance(s, str) and s for s in value):
        raise SettingTypeError(
            f"must be a non-empty str or a list of them, got {value!r} (an empty stop string would match before any "
            "token)",
            setting=name,
        )
    return tuple(value)


def _as_index(value: Any) -> Any:
    """An integer-like value (numpy int, 0-d integer tensor) as an int; anything else unchanged (to be refused)."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise SettingTypeError(f"must be a list of token ids (ints >= 0), got {value!r}", setting=name)
    return tuple(_int(name, _as_index(v), 0) for v in value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SettingTypeError(f"must be a bool (True or False), got {value!r}", setting=name)
    return value


def _seed(name: str, value: Any) -> int | None:
    return None if value is None else _int(name, value, 0)


def _top_logprobs(name: str, value: Any) -> int:
    number = _int(name, 0 if value is None else value, 0)
    if number > MAX_TOP_LOGPROBS:
        raise SettingValueError(f"must be in [0, {MAX_TOP_LOGPROBS}], got {number}", setting=name)
    return number


def _grammar(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise SettingTypeError(f"must be an EBNF grammar (a non-empty str) or None, got {value!r}", setting=name)
    return value


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "max_new_tokens": functools.partial(_int, low=1),
    "min_new_tokens": functools.partial(_int, low=0),
    "num_samples": functools.partial(_int, low=1),
    "temperature": _temperature,
    "top_p": functools.partial(_float, low=0.0, high=1.0, low_open=True),
    "top_k": _top_k,
    "min_p": functools.partial(_float, low=0.0, high=1.0),
    "repetition_penalty": functools.partial(_float, low=0.0, low_open=True),
    "presence_penalty": functools.partial(_float, low=-2.0, high=2.0),
    "frequency_penalty": functools.partial(_float, low=-2.0, high=2.0),
    "stop": _stop,
    "stop_token_ids": _token_ids,
    "ignore_eos": _bool,
    "seed": _seed,
    "top_logprobs": _top_logprobs,
    "grammar": _grammar,
}
assert set(_CHECKS) == set(_NAMES), "every generation setting needs a check"


# ------------------------------------------------------------------------------------ normalization


def _canonical(kwargs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Map synonyms to canonical names (and each to the key it was given under); unknown or doubled names raise."""
    canon: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in kwargs.items():
        name = _SYNONYMS.get(key, key)
        if name not in _CHECKS:
            known = sorted(set(_NAMES) | set(_SYNONYMS) | {"do_sample"})
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known settings: {', '.join(known)}"
            raise SettingTypeError(f"unknown generation setting {key!r}{hint}", setting=None)
        if name in canon and canon[name] != value:
            raise SettingValueError(
                f"generate_kwargs sets {name!r} twice with different values: {spelled[name]}={canon[name]!r} and "
                f"{key}={value!r}; keep one",
                setting=None,
            )
        canon[name] = value
        spelled[name] = key
    return canon, spelled


def _apply_do_sample(canon: dict[str, Any], do_sample: Any) -> None:
    """Fold Hugging Face's ``do_sample`` into the temperature (``False``: greedy, i.e. temperature 0)."""
    if do_sample is None:
        return
    if not isinstance(do_sample, bool):
        raise SettingTypeError(f"generate_kwargs['do_sample'] must be a bool, got {do_sample!r}", setting=None)
    temperature = canon.get("temperature")
    if not do_sample:
        if temperature not in (None, 0, 0.0):
            raise SettingValueError(
                f"do_sample=False (greedy) conflicts with temperature={temperature!r}; drop one of them", setting=None
            )
        canon["temperature"] = 0.0
    elif temperature in (0, 0.0):
        raise SettingValueError("do_sample=True conflicts with temperature=0 (greedy); drop one of them", setting=None)


def _checked(canon: dict[str, Any], spelled: Mapping[str, str]) -> dict[str, Any]:
    """Each value checked; a refusal names the setting as the caller spelled it."""
    out = {}
    for name, value in canon.items():
        try:
            out[name] = _CHECKS[name](name, value)
        except SettingError as e:
            raise type(e)(e.problem, setting=name, key=spelled.get(name, name)) from None
    return out


def normalize_generate_kwargs(
    kwargs: Mapping[str, Any] | GenerationSettings | None, *, budget_elsewhere: bool = False
) -> GenerationSettings:
    """Check generation settings and return them under canonical names.

    Accepts the canonical names of :class:`GenerationSettings` and the synonyms ``max_tokens``, ``min_tokens``,
    ``n`` / ``num_return_sequences`` and ``stop_strings``, plus ``do_sample`` (``False`` means greedy). Settings
    already checked (a :class:`GenerationSettings`) are returned as they are.

    Args:
        kwargs: The settings (None: every default).
        budget_elsewhere: The caller sets the reply budget itself (an env's ``max_new_tokens``, a server's): when
            ``max_new_tokens`` is not given, ``min_new_tokens`` is not bounded by its default (the settings then
            hold ``max_new_tokens = max(default, min_new_tokens)``, not explicit).

    Raises:
        SettingTypeError: For a value of the wrong type, or an unknown key (with the closest known name).
        SettingValueError: For a value out of range (a temperature in ``(0, MIN_TEMPERATURE)`` included), or two
            names for one setting with different values.

    Example:
        >>> normalize_generate_kwargs({"max_tokens": 8, "n": 2}).num_samples
        2
    """
    if isinstance(kwargs, GenerationSettings):
        return kwargs
    kwargs = dict(kwargs or {})
    do_sample = kwargs.pop("do_sample", None)
    canon, spelled = _canonical(kwargs)
    _apply_do_sample(canon, do_sample)
    out = _checked(canon, spelled)
    low = out.get("min_new_tokens", 0)
    default = GenerationSettings.max_new_tokens
    high = out.get("max_new_tokens", max(default, low) if budget_elsewhere else default)
    if low > high:
        raise SettingValueError(
            f"({low}) exceeds {spelled.get('max_new_tokens', 'max_new_tokens')}={high}, the most tokens a reply may "
            "have; lower it or raise the budget",
            setting="min_new_tokens",
            key=spelled.get("min_new_tokens"),
        )
    settings = replace(GenerationSettings(**out), explicit=frozenset(out))
    return settings if high == settings.max_new_tokens else replace(settings, max_new_tokens=high)
