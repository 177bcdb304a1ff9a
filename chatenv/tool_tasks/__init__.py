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

from chatenv.tool_tasks.base import ToolTask
from chatenv.tool_tasks.calculator import CalculatorArithmeticTask, calculator
from chatenv.tool_tasks.python import PythonTask, shared_sandbox
from chatenv.tool_tasks.retrieval import DocumentStore, RetrievalTask

__all__ = [
    "CalculatorArithmeticTask",
    "DocumentStore",
    "PythonTask",
    "RetrievalTask",
    "ToolTask",
    "calculator",
    "shared_sandbox",
]
