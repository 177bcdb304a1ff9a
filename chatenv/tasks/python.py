"""Problems solved by running code: :class:`PythonTask` and the process-wide :func:`shared_sandbox`."""

from __future__ import annotations

import atexit
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from chatenv.tasks.tool_task import ANSWER_FORMAT, ToolTask
from chatenv.tools.base import PerEpisode

__all__ = ["PythonTask", "shared_sandbox"]

_SANDBOX: dict[str, Any] = {}
_SANDBOX_LOCK = threading.Lock()


def shared_sandbox() -> Any:
    """The process-wide :class:`~chatenv.tools.sandbox.PythonSandbox` of :class:`PythonTask` envs.

    Started on first use (2 workers, 10 s per call, 512 MiB each), closed at exit, replaced if closed.
    """
    from chatenv.tools.sandbox import PythonSandbox

    with _SANDBOX_LOCK:
        sandbox = _SANDBOX.get("sandbox")
        if sandbox is None or getattr(sandbox, "closed", False):
            sandbox = _SANDBOX["sandbox"] = PythonSandbox(workers=2, timeout=10.0, memory_mb=512)
            atexit.register(sandbox.close)
        return sandbox


def _prime_sum(rng: np.random.Generator) -> tuple[str, int]:
    n = int(rng.integers(2_000, 50_001))
    sieve = bytearray([0, 0]) + bytearray([1]) * (n - 2)
    for p in range(2, math.isqrt(n - 1) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytearray(len(range(p * p, n, p)))
    return f"What is the sum of all prime numbers below {n}?", sum(i for i, flag in enumerate(sieve) if flag)


def _divisible(rng: np.random.Generator) -> tuple[str, int]:
    a, b = (int(x) for x in rng.choice(np.arange(3, 30), size=2, replace=False))
    lo = int(rng.integers(1, 5_000))
    hi = lo + int(rng.integers(10_000, 1_000_000))
    na, nb, nab = (hi // m - (lo - 1) // m for m in (a, b, math.lcm(a, b)))  # multiples of m in [lo, hi]
    return f"How many integers from {lo} to {hi} (inclusive) are divisible by {a} or by {b}?", na + nb - nab


def _digit_sum(rng: np.random.Generator) -> tuple[str, int]:
    base, exp = int(rng.integers(2, 10)), int(rng.integers(100, 501))
    return f"What is the sum of the decimal digits of {base}**{exp}?", sum(int(c) for c in str(base**exp))


def _fib_mod(rng: np.random.Generator) -> tuple[str, int]:
    n, m = int(rng.integers(200, 5_001)), int(rng.integers(1_000, 100_000))
    a, b = 0, 1
    for _ in range(n):
        a, b = b, (a + b) % m
    return f"Let F(0) = 0, F(1) = 1 and F(k) = F(k-1) + F(k-2). What is F({n}) mod {m}?", a


def _collatz(rng: np.random.Generator) -> tuple[str, int]:
    start = n = int(rng.integers(1_000, 1_000_000))
    steps = 0
    while n != 1:
        n, steps = (n // 2 if n % 2 == 0 else 3 * n + 1), steps + 1
    rule = "halve the number if it is even, or replace it by 3n + 1 if it is odd"
    return f"Starting from {start}, repeatedly {rule}. How many steps does it take to reach 1?", steps


_PYTHON_PROBLEMS: dict[str, Callable[[np.random.Generator], tuple[str, int]]] = dict(
    prime_sum=_prime_sum, divisible=_divisible, digit_sum=_digit_sum, fibonacci_mod=_fib_mod, collatz=_collatz
)


class PythonTask(ToolTask):
    """Problems whose answer is found by running code, with a sandboxed ``python`` tool.

    The task computes the reference itself; the model's code runs in :func:`shared_sandbox` (own folder per episode).

    Args:
        kinds: Problem kinds (default: all of prime_sum, divisible, digit_sum, fibonacci_mod, collatz).
        timeout: Seconds per ``python`` call (default: the sandbox's 10 s).
        sandbox: The :class:`~chatenv.tools.sandbox.PythonSandbox` that runs the code (default:
            :func:`shared_sandbox`, kernel-isolated; pass ``PythonSandbox(isolation="none")`` yourself where
            namespaces are unavailable and the code is trusted).
        **kwargs: :class:`ToolTask` arguments (``reward_fn``, ``system_prompt``, ``max_turns``).
    """

    description = "Procedural problems solved by running code in a sandboxed python tool; exact answer."
    system_prompt = (
        "You can run Python code with the python tool; it returns what the code prints. Write a short program that "
        "computes the answer and prints it, read the output, then reply with the exact number. " + ANSWER_FORMAT
    )

    def __init__(
        self, kinds: Sequence[str] | None = None, timeout: float | None = None, sandbox: Any = None, **kwargs: Any
    ):
        super().__init__(**kwargs)
        kinds = list(_PYTHON_PROBLEMS) if kinds is None else list(kinds)
        if not kinds or any(k not in _PYTHON_PROBLEMS for k in kinds):
            raise ValueError(f"kinds must be a non-empty list of {sorted(_PYTHON_PROBLEMS)}, got {kinds}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.kinds = kinds

        if sandbox is not None:
            from chatenv.tools.sandbox import PythonSandbox

            if not isinstance(sandbox, PythonSandbox):
                raise TypeError(f"sandbox must be a PythonSandbox, got {type(sandbox).__name__}")

        def python_session() -> Any:
            return (sandbox or shared_sandbox()).session(timeout=timeout)

        self.tools = [PerEpisode(python_session)]

    def problem(self, rng: np.random.Generator) -> tuple[str, Any, dict[str, Any]]:  # noqa: D102
        kind = self.kinds[int(rng.integers(len(self.kinds)))]
        question, answer = _PYTHON_PROBLEMS[kind](rng)
        return f"{question} {ANSWER_FORMAT}", answer, {"kind": kind}
