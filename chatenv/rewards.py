r"""Reward functions for chat tasks: answer extraction, matching, format checks, weighted combinations.

Every reward function takes the assistant's reply text and the task's reference and returns a float. A
malformed reply (no answer found, unparsable number) scores low; it never raises.

Tool-calling tasks (:class:`chatenv.tasks.ToolTask`) hand their reward function a :class:`ToolReply`: the reply text as
a ``str`` that also carries the episode's tool use (``.tool_stats``), so text rewards work unchanged and
:func:`tool_successes`, :func:`used_tool` and :func:`tool_errors` can score the tool use (0 for a plain ``str``).

Example:
    >>> reward = combine({"correct": (numeric_match, 1.0), "format": (format_reward, 0.1)})
    >>> reward("So the result is <answer>42</answer>.", 42)
    (1.1, {'correct': 1.0, 'format': 1.0})
    >>> extract_answer(r"the answer is \boxed{\frac{1}{2}}")
    '\\frac{1}{2}'
    >>> from chatenv.tools import ToolStats
    >>> reply = ToolReply("<answer>42</answer>", ToolStats(calls=3, errors=1))
    >>> with_tools = combine({"correct": (numeric_match, 1), "tool": (used_tool, 0.5), "errors": (tool_errors, -0.25)})
    >>> with_tools(reply, 42)
    (1.25, {'correct': 1.0, 'tool': 1.0, 'errors': 1.0})
    >>> with_tools("<answer>42</answer>", 42)  # a plain str: no tool use
    (1.0, {'correct': 1.0, 'tool': 0.0, 'errors': 0.0})
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatenv.tools.runner import ToolStats

__all__ = [
    "RewardFn",
    "ToolReply",
    "combine",
    "exact_match",
    "extract_answer",
    "format_reward",
    "numeric_match",
    "parse_number",
    "tool_errors",
    "tool_successes",
    "used_tool",
]

RewardFn = Callable[[str, Any], float]

_OPEN, _CLOSE = "<answer>", "</answer>"
_DEFAULT_FORMAT = r"<answer>.+?</answer>"
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")


def _boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def _last_tag(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` pair (case-insensitive), in one linear pass."""
    lower = text.lower()
    close = lower.rfind(_CLOSE)
    if close < 0:
        return None
    open_ = lower.rfind(_OPEN, 0, close)
    return None if open_ < 0 else text[open_ + len(_OPEN) : close]


def extract_answer(text: str, method: str = "auto") -> str | None:
    r"""The answer in a reply.

    Args:
        text: The reply.
        method: ``"tags"`` (the last ``<answer>...</answer>``), ``"boxed"`` (the last ``\boxed{...}``),
            ``"last_number"`` (the last number in the text), or ``"auto"`` (tags, then boxed, then last number).
            Nested tags give the innermost last pair. Linear in the length of the text.

    Returns:
        The stripped answer text, or None when there is none.
    """
    if not isinstance(text, str):
        return None
    if method not in ("auto", "tags", "boxed", "last_number"):
        raise ValueError(f"method must be 'auto', 'tags', 'boxed' or 'last_number', got {method!r}")
    if method in ("auto", "tags"):
        tag = _last_tag(text)
        if tag is not None:
            return tag.strip()
        if method == "tags":
            return None
    if method in ("auto", "boxed"):
        boxed = _boxed(text)
        if boxed is not None:
            return boxed.strip()
        if method == "boxed":
            return None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: Any) -> float | None:
    r"""A number from text (``"1,234"``, ``"-3.5"``, ``"$12"``, ``"\frac{1}{2}"``), or None."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float)):
        return float(text)
    if not isinstance(text, str):
        return None
    s = text.strip().rstrip(".").replace("$", "").replace("\\!", "").strip()
    frac = re.fullmatch(r"\\d?frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if frac:
        den = int(frac.group(2))
        return int(frac.group(1)) / den if den else None
    found = _NUMBER.fullmatch(s) or _NUMBER.search(s)
    if not found:
        return None
    try:
        return float(found.group(0).replace(",", ""))
    except ValueError:
        return None


def exact_match(reply: str, reference: Any, *, method: str = "auto", case_sensitive: bool = False) -> float:
    """1.0 if the extracted answer equals the reference (whitespace-normalised), else 0.0."""
    answer = extract_answer(reply, method)
    if answer is None or reference is None:
        return 0.0
    a, b = " ".join(answer.split()), " ".join(str(reference).split())
    if not case_sensitive:
        a, b = a.lower(), b.lower()
    return float(a == b)


def numeric_match(reply: str, reference: Any, *, method: str = "auto", rel_tol: float = 1e-6) -> float:
    """1.0 if the extracted answer is numerically equal to the reference, else 0.0."""
    got = parse_number(extract_answer(reply, method))
    want = parse_number(reference)
    if got is None or want is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=rel_tol, abs_tol=rel_tol))


def format_reward(reply: str, reference: Any = None, *, pattern: str = _DEFAULT_FORMAT) -> float:
    """1.0 if the reply contains ``pattern`` (default: a non-empty ``<answer>`` tag), else 0.0."""
    if not isinstance(reply, str):
        return 0.0
    if pattern == _DEFAULT_FORMAT:  # linear: the earliest opening tag has the most closing tags after it
        start = reply.find(_OPEN)
        return float(start >= 0 and reply.find(_CLOSE, start + len(_OPEN) + 1) >= 0)
    return float(re.search(pattern, reply, re.S) is not None)


def combine(components: Mapping[str, tuple[RewardFn, float]]) -> Callable[[str, Any], tuple[float, dict[str, float]]]:
    """A weighted sum of reward functions that also reports each component.

    Args:
        components: ``name -> (reward_fn, weight)``.

    Returns:
        ``fn(reply, reference) -> (total, {name: unweighted value})``.
    """
    items = list(components.items())
    for name, value in items:
        if not (isinstance(value, tuple) and len(value) == 2 and callable(value[0])):
            raise TypeError(f"component {name!r} must be a (reward_fn, weight) pair, got {value!r}")

    def reward(reply: str, reference: Any) -> tuple[float, dict[str, float]]:
        parts = {name: float(fn(reply, reference)) for name, (fn, _) in items}
        return sum(parts[name] * float(w) for name, (_, w) in items), parts

    return reward


# ----------------------------------------------------------------------------------------------- tool use


class ToolReply(str):
    """The assistant's final reply text, carrying the episode's tool use for reward functions.

    A ``str`` in every respect (text rewards such as :func:`numeric_match` take it as they are); its
    :attr:`tool_stats` is the :class:`~chatenv.tools.ToolStats` of the episode so far (calls, errors by kind).

    Args:
        text: The reply's text.
        tool_stats: The episode's tool statistics (None: no tools were available).
    """

    tool_stats: ToolStats | None

    def __new__(cls, text: str, tool_stats: ToolStats | None = None) -> ToolReply:  # noqa: D102
        if not isinstance(text, str):
            raise TypeError(f"ToolReply text must be a str, got {type(text).__name__}")
        obj = super().__new__(cls, text)
        obj.tool_stats = tool_stats
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (ToolReply, (str(self), self.tool_stats))

    def __repr__(self) -> str:
        return f"ToolReply({str(self)!r}, tool_stats={self.tool_stats!r})"


def _tool_count(reply: Any, name: str) -> float:
    stats = getattr(reply, "tool_stats", None) if isinstance(reply, str) else None
    return 0.0 if stats is None else float(getattr(stats, name))


def tool_successes(reply: str, reference: Any = None) -> float:
    """Tool calls of the episode that returned a result (0.0 for a plain ``str`` reply)."""
    return _tool_count(reply, "successes")


def tool_errors(reply: str, reference: Any = None) -> float:
    """Tool calls of the episode that failed, of any kind (0.0 for a plain ``str`` reply); weigh it negatively."""
    return _tool_count(reply, "errors")


def used_tool(reply: str, reference: Any = None) -> float:
    """1.0 if at least one tool call of the episode returned a result, else 0.0 (a bounded "used the tool" bonus)."""
    return float(_tool_count(reply, "successes") > 0)
