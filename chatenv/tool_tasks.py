"""Tasks that need tools: a calculator, a sandboxed Python interpreter, a search engine over fictional documents.

A :class:`ToolTask` ships its ``tools`` and scores only the final reply, the first without tool calls (the env
answers calls with ``tool`` messages). Its reward function gets a :class:`~chatenv.rewards.ToolReply`, the text
carrying the episode's tool use, for :func:`~chatenv.rewards.used_tool`, :func:`~chatenv.rewards.tool_errors`.

Built-ins, all offline and drawn from the env's seed:

- :class:`CalculatorArithmeticTask` (``"calculator_arithmetic"``): products of 3-4 digit numbers and multi-step
  expressions, with a safe :func:`calculator` tool.
- :class:`PythonTask` (``"python_problems"``): problems whose answer is computed by running code (prime sums,
  divisor counts, digit sums, Fibonacci residues, Collatz lengths), with the sandboxed ``python`` tool.
- :class:`RetrievalTask` (``"retrieval"``): questions about fictional countries, answered by searching a small
  document store made for each episode (:class:`DocumentStore`: ``search`` and ``read`` tools).
"""

from __future__ import annotations

import abc
import ast
import atexit
import math
import operator
import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from chatenv.rewards import ToolReply, combine, exact_match, extract_answer, numeric_match, used_tool
from chatenv.tasks import RewardError, Task, TaskResponse, TaskStart, register_task
from chatenv.tools.base import PerEpisode
from chatenv.tools.runner import Toolbox, ToolStats

__all__ = ["CalculatorArithmeticTask", "DocumentStore", "PythonTask", "RetrievalTask", "ToolTask", "calculator"]
__all__ += ["shared_sandbox"]

_ANSWER = "Give the final answer in <answer></answer> tags."


def _exact_number(reply: str, reference: Any) -> float:
    return numeric_match(reply, reference, rel_tol=0.0)  # no tolerance: big integers must be exact


class ToolTask(Task):
    """A task solved with tools: the final reply (the first without tool calls) is scored and ends the episode.

    Subclasses implement :meth:`problem`, set ``tools`` (functions, :class:`~chatenv.tools.Tool` and
    :class:`~chatenv.tools.PerEpisode` objects, or a :class:`~chatenv.tools.Toolbox`) and ``match``.

    Args:
        reward_fn: ``fn(reply, answer) -> float`` or ``-> (total, components)`` (as :func:`~chatenv.rewards.combine`
            returns). ``reply`` is a :class:`~chatenv.rewards.ToolReply`. Default: ``correct`` (weight 1) and
            ``used_tool`` (weight 0, reported only).
        system_prompt: The system message (default: the task's, which tells the model to use its tools).
        max_turns: Replies per episode, tool-calling ones included (default: the task's ``default_max_turns``).
    """

    tools: Sequence[Any] | Toolbox = ()
    uses_tool_stats = True
    default_max_turns: int | None = 5
    system_prompt = "Use your tools to find the answer. " + _ANSWER
    match: Callable[[str, Any], float] = staticmethod(_exact_number)

    def __init__(
        self,
        reward_fn: Callable[[str, Any], Any] | None = None,
        system_prompt: str | None = None,
        max_turns: int | None = None,
    ):
        if reward_fn is not None and not callable(reward_fn):
            raise TypeError(f"reward_fn must be a function fn(reply, answer), got {type(reward_fn).__name__}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise TypeError(f"system_prompt must be a str, got {type(system_prompt).__name__}")
        if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"max_turns must be an int >= 1, got {max_turns!r}")
        self.reward_fn = reward_fn or combine({"correct": (type(self).match, 1.0), "used_tool": (used_tool, 0.0)})
        if system_prompt is not None:
            self.system_prompt = system_prompt
        if max_turns is not None:
            self.default_max_turns = max_turns

    @abc.abstractmethod
    def problem(self, rng: np.random.Generator) -> tuple[str, Any, dict[str, Any]]:
        """Draw a problem: ``(question, answer, extra state)``."""

    def reset(self, rng: np.random.Generator) -> TaskStart:
        """A system message, the question, and ``{"answer": ..., **extra}`` as the state."""
        question, answer, extra = self.problem(rng)
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": question}]
        return TaskStart(messages, {**extra, "answer": answer})

    def state_for(self, messages: list[dict[str, Any]], options: Mapping[str, Any]) -> Any:
        """For a given chat: ``options["answer"]`` is the reference."""
        return {"answer": options.get("answer")}

    def respond(self, messages: list[dict[str, Any]], state: Any, tool_stats: ToolStats | None = None) -> TaskResponse:
        """Score the final reply (it made no tool calls) against ``state["answer"]``; the episode ends.

        Raises:
            RewardError: If the reward function raises or returns something that is not a reward.
        """
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("respond() expects the chat to end with the assistant's reply")
        text = messages[-1].get("content") or ""
        stats = tool_stats if tool_stats is not None else ToolStats()
        total, parts = self._score(ToolReply(text, stats), state.get("answer"))
        return TaskResponse(total, True, [], parts, {"answer": state.get("answer"), "extracted": extract_answer(text)})

    def _score(self, reply: ToolReply, answer: Any) -> tuple[float, dict[str, float]]:
        name = type(self).__name__
        try:
            value = self.reward_fn(reply, answer)
        except Exception as e:
            raise RewardError(f"{name} reward_fn raised {type(e).__name__}: {e} (reply {str(reply)[:200]!r})") from e
        try:
            if isinstance(value, tuple):
                total, parts = value
                return float(total), {str(k): float(v) for k, v in dict(parts).items()}
            return float(value), {"reward": float(value)}
        except (TypeError, ValueError) as e:
            raise RewardError(
                f"{name} reward_fn must return a float or (total, {{name: value}}), got {value!r:.80}"
            ) from e


# ----------------------------------------------------------------------------------------------- calculator

_BINARY: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_BINARY |= {ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION = 500
_MAX_EXPONENT = 1000
_MAX_DIGITS = 100  # results of more than 100 digits (or floats over 1e100) are refused


def _checked(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    if abs(value) >= 10**_MAX_DIGITS:
        raise ValueError(f"the result has more than {_MAX_DIGITS} digits; the calculator refuses numbers that large")
    return value


def _power(base: Any, exp: Any) -> Any:
    if abs(exp) > _MAX_EXPONENT:
        raise ValueError(f"exponent {exp} is too large (at most {_MAX_EXPONENT} in absolute value)")
    if base != 0 and abs(base) != 1 and exp > 0 and exp * math.log10(abs(base)) > _MAX_DIGITS:
        raise ValueError(f"{base} ** {exp} has more than {_MAX_DIGITS} digits; the calculator refuses such numbers")
    if base == 0 and exp < 0:
        raise ValueError("zero cannot be raised to a negative power")
    result = base**exp
    if isinstance(result, complex):
        raise ValueError("a negative number to a fractional power is not a real number")
    return result


def _evaluate(node: ast.AST) -> Any:
    """The value of an arithmetic expression tree: numbers, + - * / // % **, unary + and -; nothing else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("'^' is not a power here; write powers with '**' (e.g. 2 ** 10)")
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    allowed = "only numbers, parentheses and + - * / // % ** are allowed (no names, calls, commas or strings)"
    raise ValueError(f"unsupported element {what!r}: {allowed}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Supports numbers, parentheses and the operators + - * / // % ** (e.g. "(1234 + 56) * 789 // 7").

    Args:
        expression: The arithmetic expression to evaluate, e.g. "4821 * 7390 - 15".
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip().replace("×", "*").replace("÷", "/")
    if not text:
        raise ValueError("the expression is empty")
    if len(text) > _MAX_EXPRESSION:
        raise ValueError(f"the expression is {len(text)} characters long; at most {_MAX_EXPRESSION} are allowed")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"cannot read {text!r} as an arithmetic expression ({getattr(e, 'msg', e)})") from None
    try:
        value = _evaluate(tree.body)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


_CALC_FORMS = ("{a} * {b}", "{a} * {b} - {c} * {d}", "({a} + {b}) * ({hi} - {lo})", "{a} * {b} * {k}")
_CALC_FORMS += ("{qk} / {k} + {a} * {b}",)


def _calc_problem(rng: np.random.Generator) -> tuple[str, int]:
    a, b, c, d = (int(x) for x in rng.integers(100, 10_000, size=4))
    k, q = int(rng.integers(12, 100)), int(rng.integers(1_000, 100_000))
    form = _CALC_FORMS[int(rng.integers(len(_CALC_FORMS)))]
    expr = form.format(a=a, b=b, c=c, d=d, hi=max(c, d), lo=min(c, d), k=k, qk=q * k)
    return expr, int(calculator(expr))


class CalculatorArithmeticTask(ToolTask):
    """Arithmetic too long to do reliably in one's head (3-4 digit products, multi-step expressions).

    Tool: :func:`calculator`. The exact integer answer is expected in ``<answer></answer>`` (``correct`` is 1
    only for the exact value).
    """

    description = "Multi-digit arithmetic with a calculator tool; exact answer in <answer> tags."
    tools = (calculator,)
    default_max_turns = 4
    system_prompt = (
        "You are a careful assistant with a calculator tool. Do not compute in your head: call the calculator "
        "with the whole expression, read its result, then reply with the exact number. " + _ANSWER
    )

    def problem(self, rng: np.random.Generator) -> tuple[str, Any, dict[str, Any]]:  # noqa: D102
        expr, answer = _calc_problem(rng)
        return f"Compute {expr}. {_ANSWER}", answer, {"expression": expr}


# ----------------------------------------------------------------------------------------------- python

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
        "computes the answer and prints it, read the output, then reply with the exact number. " + _ANSWER
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
        return f"{question} {_ANSWER}", answer, {"kind": kind}


# ----------------------------------------------------------------------------------------------- retrieval

_WORD = re.compile(r"[a-z0-9]+")
_STOP = frozenset("a an and are as at by for from how in is it of on or the to was what when which who whose".split())


def _terms(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in _STOP]


class DocumentStore:
    """Documents searched by term overlap (BM25): the ``search`` and ``read`` tools of one episode.

    Args:
        documents: ``{doc_id: text}``.
        top_k: Results per search.
        snippet_chars: Characters of each result's text shown by ``search``.
    """

    def __init__(self, documents: Mapping[str, str], top_k: int = 3, snippet_chars: int = 300):
        if not isinstance(documents, Mapping):
            raise TypeError(f"documents must be a dict of doc_id -> text, got {type(documents).__name__}")
        self._docs = {str(k): str(v) for k, v in documents.items()}
        self._top_k, self._snippet = int(top_k), int(snippet_chars)
        self._terms = {k: _terms(v) for k, v in self._docs.items()}
        n = len(self._docs)
        df = Counter(w for words in self._terms.values() for w in set(words))
        self._idf = {w: math.log(1 + (n - c + 0.5) / (c + 0.5)) for w, c in df.items()}
        self._avg = sum(map(len, self._terms.values())) / n if n else 0.0

    def _score(self, doc_id: str, query: list[str]) -> float:  # BM25 with k1 = 1.2, b = 0.75
        words = self._terms[doc_id]
        norm = 1.2 * (0.25 + 0.75 * len(words) / (self._avg or 1.0))
        return sum(self._idf.get(q, 0.0) * 2.2 * words.count(q) / (words.count(q) + norm) for q in set(query))

    def search(self, query: str) -> str:
        """Search the document collection and return the best-matching documents with their ids.

        Args:
            query: Words to look for, e.g. a name or a topic.
        """
        if not isinstance(query, str):
            raise ValueError(f"query must be a string, got {type(query).__name__}")
        words = _terms(query)
        if not words:
            raise ValueError(f"the query {query!r} has no searchable words; search for a name or a topic")
        scored = sorted(((self._score(k, words), k) for k in self._docs), key=lambda s: (-s[0], s[1]))
        hits = [(s, k) for s, k in scored[: self._top_k] if s > 0]
        if not hits:
            return f"No documents match {query!r}."
        return "\n".join(f"[{k}] {self._docs[k][: self._snippet]}" for _, k in hits)

    def read(self, doc_id: str) -> str:
        """Return the full text of a document.

        Args:
            doc_id: The document's id as shown by search, e.g. "doc-3".
        """
        key = str(doc_id).strip().strip("[]")
        if key not in self._docs:
            raise ValueError(f"there is no document {doc_id!r}; use an id that search returned (like 'doc-0')")
        return self._docs[key]


_SYLLABLES = "ka vel tra osk mir dun sel qua bro zen lor phi tan ur esh gal ny rho vik ad om ter lu ban cor fen".split()
_GOODS = "amber copper silk salt timber wool glass tin saffron pearls indigo marble honey flax cobalt ivory".split()


def _word(rng: np.random.Generator, parts: int) -> str:
    return "".join(_SYLLABLES[int(i)] for i in rng.integers(len(_SYLLABLES), size=parts))


def _countries(rng: np.random.Generator, n: int) -> list[dict[str, str]]:
    """``n`` fictional countries with distinct names, capitals and currencies."""
    seen: set[str] = set()
    out = []
    while len(out) < n:
        c = {
            "name": _word(rng, 3).capitalize() + ("a", "ia", "or", "and")[int(rng.integers(4))],
            "capital": _word(rng, 2).capitalize() + ("", "en", "is")[int(rng.integers(3))],
            "founded": str(int(rng.integers(1100, 1900))),
            "currency": _word(rng, 2),
            "export": _GOODS[int(rng.integers(len(_GOODS)))],
        }
        names = {c["name"].lower(), c["capital"].lower(), c["currency"]}
        if len(names) == 3 and not names & seen:
            seen |= names
            out.append(c)
    return out


def _documents(rng: np.random.Generator, countries: list[dict[str, str]]) -> dict[str, str]:
    """One document per country and one per capital city, in a random order."""
    texts = []
    for c in countries:
        texts.append(
            f"{c['name']} is a small inland nation. It was founded in {c['founded']}. The capital of {c['name']} is "
            f"{c['capital']}. Its currency is the {c['currency']}, and its chief export is {c['export']}."
        )
        texts.append(
            f"{c['capital']} is a walled city on a wide river, home to an old market and a university. "
            f"{c['capital']} is the capital of {c['name']}."
        )
    order = rng.permutation(len(texts))
    return {f"doc-{i}": texts[int(k)] for i, k in enumerate(order)}


#: question kind -> (question, the country's fact that answers it)
_QUESTIONS = {
    "capital": ("What is the capital of {name}?", "capital"),
    "founded": ("In what year was {name} founded?", "founded"),
    "currency": ("What is the currency of {name} called?", "currency"),
    "export": ("What is the chief export of {name}?", "export"),
    "capital_export": ("What is the chief export of the country whose capital is {capital}?", "export"),
}


class RetrievalTask(ToolTask):
    """Questions about fictional countries, answered by searching the episode's own document store.

    Each episode makes a new world from the seed (``countries`` countries, a document for each and for each
    capital), so the model cannot know the answers: it must ``search`` (and may ``read``) the documents. Answers
    are checked by exact match (case and whitespace ignored). The documents are part of the episode's state, and
    its tools are built from that state, so one task object can serve many envs.

    Args:
        countries: Countries per world.
        top_k: Results per search.
        facts: Question kinds (default: all of ``"capital"``, ``"founded"``, ``"currency"``, ``"export"`` and the
            two-step ``"capital_export"``).
        **kwargs: :class:`ToolTask` arguments (``reward_fn``, ``system_prompt``, ``max_turns``).
    """

    description = "Questions about fictional countries answered with a search tool over a generated document store."
    match = staticmethod(exact_match)
    system_prompt = (
        "You answer questions about places you have never heard of. Use the search tool to find documents about "
        "them (and read to see a whole document), then reply with the answer word taken from the documents. " + _ANSWER
    )

    def __init__(self, countries: int = 6, top_k: int = 3, facts: Sequence[str] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        if isinstance(countries, bool) or not isinstance(countries, int) or not 1 <= countries <= 50:
            raise ValueError(f"countries must be an int in [1, 50], got {countries!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
        self.facts = list(_QUESTIONS) if facts is None else list(facts)
        if not self.facts or any(f not in _QUESTIONS for f in self.facts):
            raise ValueError(f"facts must be a non-empty list of {list(_QUESTIONS)}, got {self.facts}")
        self.countries, self.top_k = countries, top_k

        def document_store(state: Any) -> DocumentStore:
            return DocumentStore((state or {}).get("documents", {}), top_k=self.top_k)

        self.tools = [PerEpisode(document_store, pass_state=True)]

    def problem(self, rng: np.random.Generator) -> tuple[str, Any, dict[str, Any]]:  # noqa: D102
        world = _countries(rng, self.countries)
        documents = _documents(rng, world)
        country = world[int(rng.integers(len(world)))]
        fact = self.facts[int(rng.integers(len(self.facts)))]
        question, key = _QUESTIONS[fact]
        answer = country[key]
        sources = sorted(k for k, v in documents.items() if country["name"] in v and answer.lower() in _terms(v))
        extra = {"fact": fact, "sources": sources, "documents": documents}
        return f"{question.format(**country)} {_ANSWER}", answer, extra

    def state_for(self, messages: list[dict[str, Any]], options: Mapping[str, Any]) -> Any:
        """For a given chat: ``options["answer"]``, and ``options["documents"]`` (default: none) to search."""
        documents = options.get("documents", {})
        if not isinstance(documents, Mapping):
            raise TypeError(f"options['documents'] must be a dict of doc_id -> text, got {type(documents).__name__}")
        return {"answer": options.get("answer"), "documents": {str(k): str(v) for k, v in documents.items()}}


register_task("calculator_arithmetic", CalculatorArithmeticTask)
register_task("python_problems", PythonTask)
register_task("retrieval", RetrievalTask)
