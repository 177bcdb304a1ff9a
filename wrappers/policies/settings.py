"""One generation vocabulary for every backend.

Users write ``generate_kwargs`` once; :func:`normalize_generate_kwargs` checks them and maps synonyms from the
Hugging Face and vLLM vocabularies onto one canonical name each. Backends translate the canonical settings
into their own calls, and reject the few settings they cannot honour instead of dropping them.
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

__all__ = ["MIN_TEMPERATURE", "GenerationSettings", "normalize_generate_kwargs"]

# Dividing logits by a temperature this small overflows low-precision logits to inf (NaN after softmax) and
# makes sampling numerically greedy anyway: below it, ask for greedy decoding explicitly.
MIN_TEMPERATURE = 1e-4

# synonym -> canonical name
_SYNONYMS = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "n": "num_samples",
    "num_return_sequences": "num_samples",
    "stop_strings": "stop",
}


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
        )

    def as_kwargs(self) -> dict[str, Any]:
        """The settings the user gave, by canonical name (what :meth:`with_overrides` starts from)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in self.explicit}

    def with_overrides(self, **kwargs: Any) -> GenerationSettings:
        """A copy with some settings changed (checked like the constructor's)."""
        return normalize_generate_kwargs({**self.as_kwargs(), **kwargs})

    def without(self, name: str) -> GenerationSettings:
        """A copy with setting ``name`` back at its default (and no longer explicit)."""
        default = next(f.default for f in fields(self) if f.name == name)
        return replace(self, **{name: default}, explicit=self.explicit - {name})


_NAMES = [f.name for f in fields(GenerationSettings) if f.name != "explicit"]


# ------------------------------------------------------------------------------------ per-name checks


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        # a whole float (2.0) is that int; 2.5 is refused, never truncated
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TypeError(f"generate_kwargs[{name!r}] must be an int, got {value!r}")
    value = int(value)
    if value < low:
        raise ValueError(f"generate_kwargs[{name!r}] must be >= {low}, got {value}")
    return value


def _float(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"generate_kwargs[{name!r}] must be a number, got {value!r}")
    value = float(value)
    bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
    if not math.isfinite(value):
        raise ValueError(f"generate_kwargs[{name!r}] must be a finite number in {bound}, got {value}")
    if value < low or value > high or (low_open and value == low):
        raise ValueError(f"generate_kwargs[{name!r}] must be in {bound}, got {value}")
    return value


def _temperature(name: str, value: Any) -> float:
    value = _float(name, value, 0.0)
    if 0.0 < value < MIN_TEMPERATURE:
        raise ValueError(
            f"generate_kwargs[{name!r}]={value} is too small to sample with (logits / temperature overflow to "
            f"inf/NaN); use temperature=0 for greedy decoding, or a temperature >= {MIN_TEMPERATURE}"
        )
    return value


def _top_k(name: str, value: Any) -> int:
    if value is None or (not isinstance(value, bool) and value == -1):
        return 0
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
        raise ValueError(f"generate_kwargs[{name!r}] must be >= 0 (0 or -1: no top-k filter), got {value}")
    return _int(name, value, 0)


def _stop(name: str, value: Any) -> tuple[str, ...]:
    value = [value] if isinstance(value, str) else ([] if value is None else value)
    if not all(isinstance(s, str) and s for s in value):
        raise TypeError(
            f"generate_kwargs[{name!r}] must be a non-empty str or a list of them, got {value!r} (an empty stop string "
            "would match before any token)"
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
        raise TypeError(f"generate_kwargs[{name!r}] must be a list of token ids, got {value!r}")
    return tuple(_int(name, _as_index(v), 0) for v in value)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"generate_kwargs[{name!r}] must be a bool, got {value!r}")
    return value


def _seed(name: str, value: Any) -> int | None:
    return None if value is None else _int(name, value, 0)


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
}
assert set(_CHECKS) == set(_NAMES), "every generation setting needs a check"


# ------------------------------------------------------------------------------------ normalization


def _canonical(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Map synonyms to canonical names; unknown names and one setting given twice differently raise."""
    canon: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in kwargs.items():
        name = _SYNONYMS.get(key, key)
        if name not in _CHECKS:
            known = sorted(set(_NAMES) | set(_SYNONYMS) | {"do_sample"})
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known settings: {', '.join(known)}"
            raise TypeError(f"unknown generation setting {key!r}{hint}")
        if name in canon and canon[name] != value:
            raise ValueError(
                f"generate_kwargs sets {name!r} twice with different values: {spelled[name]}={canon[name]!r} and "
                f"{key}={value!r}; keep one"
            )
        canon[name] = value
        spelled[name] = key
    return canon


def _apply_do_sample(canon: dict[str, Any], do_sample: Any) -> None:
    """Fold Hugging Face's ``do_sample`` into the temperature (``False``: greedy, i.e. temperature 0)."""
    if do_sample is None:
        return
    if not isinstance(do_sample, bool):
        raise TypeError(f"generate_kwargs['do_sample'] must be a bool, got {do_sample!r}")
    temperature = canon.get("temperature")
    if not do_sample:
        if temperature not in (None, 0, 0.0):
            raise ValueError(f"do_sample=False (greedy) conflicts with temperature={temperature!r}; drop one of them")
        canon["temperature"] = 0.0
    elif temperature in (0, 0.0):
        raise ValueError("do_sample=True conflicts with temperature=0 (greedy); drop one of them")


def normalize_generate_kwargs(kwargs: Mapping[str, Any] | None) -> GenerationSettings:
    """Check generation settings and return them under canonical names.

    Accepts the canonical names of :class:`GenerationSettings` and the synonyms ``max_tokens``, ``min_tokens``,
    ``n`` / ``num_return_sequences`` and ``stop_strings``, plus ``do_sample`` (``False`` means greedy).

    Raises:
        TypeError: For a value of the wrong type, or an unknown key (with the closest known name).
        ValueError: For a value out of range (a temperature in ``(0, MIN_TEMPERATURE)`` included), or two names
            for one setting with different values.

    Example:
        >>> normalize_generate_kwargs({"max_tokens": 8, "n": 2}).num_samples
        2
    """
    kwargs = dict(kwargs or {})
    do_sample = kwargs.pop("do_sample", None)
    canon = _canonical(kwargs)
    _apply_do_sample(canon, do_sample)
    out = {name: _CHECKS[name](name, value) for name, value in canon.items()}
    low = out.get("min_new_tokens", 0)
    high = out.get("max_new_tokens", GenerationSettings.max_new_tokens)
    if low > high:
        raise ValueError(f"min_new_tokens={low} exceeds max_new_tokens={high}")
    return replace(GenerationSettings(**out), explicit=frozenset(out))
