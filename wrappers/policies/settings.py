"""One generation vocabulary for every backend.

Users write ``generate_kwargs`` once; :func:`normalize_generate_kwargs` checks them and maps synonyms from the
Hugging Face and vLLM vocabularies onto one canonical name each. Backends translate the canonical settings
into their own calls, and reject the few settings they cannot honour instead of dropping them.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = ["GenerationSettings", "normalize_generate_kwargs"]

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
        temperature: Sampling temperature; 0 means greedy decoding.
        top_p: Nucleus sampling mass (1.0: off).
        top_k: Keep the k most likely tokens (0: off).
        min_p: Drop tokens below ``min_p`` times the top probability (0.0: off).
        repetition_penalty: Penalty on tokens already in the sequence (1.0: off).
        presence_penalty: Additive penalty on tokens already generated (0.0: off; vLLM only).
        frequency_penalty: Penalty proportional to counts of generated tokens (0.0: off; vLLM only).
        num_samples: Responses per prompt.
        stop: Strings that end a response (the string stays in the response).
        stop_token_ids: Extra token ids that end a response, besides the end-of-turn and EOS tokens.
        ignore_eos: Keep generating after end-of-turn / EOS tokens (until ``max_new_tokens``).
        seed: Seed for sampling: a policy's sequence of calls is reproducible from it (each call derives its own
            seed from it and the call count, so successive calls draw fresh samples).
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
        """The settings the user gave, by canonical name (for :meth:`get_new_version`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name in self.explicit}

    def with_overrides(self, **kwargs: Any) -> GenerationSettings:
        """A copy with some settings changed (checked like the constructor's)."""
        return normalize_generate_kwargs({**self.as_kwargs(), **kwargs})


_NAMES = [f.name for f in fields(GenerationSettings) if f.name != "explicit"]


def _int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise TypeError(f"generate_kwargs[{name!r}] must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"generate_kwargs[{name!r}] must be >= {low}, got {value}")
    return value


def _float(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"generate_kwargs[{name!r}] must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ValueError(f"generate_kwargs[{name!r}] must be in {bound}, got {value}")
    return value


def normalize_generate_kwargs(kwargs: Mapping[str, Any] | None) -> GenerationSettings:
    """Check generation settings and return them under canonical names.

    Accepts the canonical names of :class:`GenerationSettings` and the synonyms ``max_tokens``, ``min_tokens``,
    ``n`` / ``num_return_sequences`` and ``stop_strings``, plus ``do_sample`` (``False`` means greedy).

    Raises:
        TypeError: For a value of the wrong type, or an unknown key (with the closest known name).
        ValueError: For a value out of range, or two names for one setting with different values.

    Example:
        >>> normalize_generate_kwargs({"max_tokens": 8, "n": 2}).num_samples
        2
    """
    kwargs = dict(kwargs or {})
    canon: dict[str, Any] = {}
    given: dict[str, str] = {}
    do_sample = kwargs.pop("do_sample", None)
    for key, value in kwargs.items():
        name = _SYNONYMS.get(key, key)
        if name not in _NAMES:
            known = sorted(set(_NAMES) | set(_SYNONYMS) | {"do_sample"})
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known settings: {', '.join(known)}"
            raise TypeError(f"unknown generation setting {key!r}{hint}")
        if name in canon and canon[name] != value:
            raise ValueError(
                f"generate_kwargs sets {name!r} twice with different values: {given[name]}={canon[name]!r} and "
                f"{key}={value!r}; keep one"
            )
        canon[name] = value
        given[name] = key
    if do_sample is not None:
        if not isinstance(do_sample, bool):
            raise TypeError(f"generate_kwargs['do_sample'] must be a bool, got {do_sample!r}")
        if not do_sample:
            if canon.get("temperature", 0.0) not in (0, 0.0):
                raise ValueError(
                    f"do_sample=False (greedy) conflicts with temperature={canon['temperature']!r}; drop one of them"
                )
            canon["temperature"] = 0.0
        elif canon.get("temperature") in (0, 0.0):
            raise ValueError("do_sample=True conflicts with temperature=0 (greedy); drop one of them")
    out: dict[str, Any] = {}
    for name, value in canon.items():
        if name in ("max_new_tokens", "num_samples"):
            out[name] = _int(name, value, 1)
        elif name == "min_new_tokens":
            out[name] = _int(name, value, 0)
        elif name == "top_k":
            out[name] = 0 if value in (-1, None) else _int(name, value, 0)
        elif name == "temperature":
            out[name] = _float(name, value, 0.0)
        elif name == "top_p":
            out[name] = _float(name, value, 0.0, 1.0, low_open=True)
        elif name == "min_p":
            out[name] = _float(name, value, 0.0, 1.0)
        elif name == "repetition_penalty":
            out[name] = _float(name, value, 0.0, low_open=True)
        elif name in ("presence_penalty", "frequency_penalty"):
            out[name] = _float(name, value, -2.0, 2.0)
        elif name == "stop":
            value = [value] if isinstance(value, str) else value
            if value is None:
                value = []
            if not all(isinstance(s, str) and s for s in value):
                raise TypeError(f"generate_kwargs['stop'] must be a non-empty str or a list of them, got {value!r}")
            out[name] = tuple(value)
        elif name == "stop_token_ids":
            value = [] if value is None else list(value)
            out[name] = tuple(_int(name, int(v) if hasattr(v, "__index__") else v, 0) for v in value)
        elif name == "ignore_eos":
            if not isinstance(value, bool):
                raise TypeError(f"generate_kwargs['ignore_eos'] must be a bool, got {value!r}")
            out[name] = value
        elif name == "seed":
            out[name] = None if value is None else _int(name, value, 0)
    if out.get("min_new_tokens", 0) > out.get("max_new_tokens", GenerationSettings.max_new_tokens):
        raise ValueError(
            f"min_new_tokens={out['min_new_tokens']} exceeds max_new_tokens="
            f"{out.get('max_new_tokens', GenerationSettings.max_new_tokens)}"
        )
    return replace(GenerationSettings(**out), explicit=frozenset(out))
