"""Tasks: what a chat env talks about, and how replies are rewarded; their names (:func:`register`).

The protocol (:mod:`~chatenv.tasks.base`): a :class:`Task` draws the opening messages and a hidden state with the
env's random generator, then answers each assistant turn through :meth:`Task.respond` (a :class:`TaskResponse`:
reward, done, messages to add). Registration (:mod:`~chatenv.tasks.registry`): :func:`register` names a task
(and optionally a Gymnasium env id) from a factory or a lazy ``"module:attr"``; :func:`get_task` makes one.

Built-ins, all offline and drawn from the env's seed, registered by name:

- ``"arithmetic"``: :class:`ArithmeticTask`; ``"guess_number"``: :class:`GuessNumberTask`; ``"dataset"``:
  :class:`DatasetTask` (a list or JSONL file of records; a built-in QA set by default).
- Tool tasks (:class:`ToolTask`: the first reply without tool calls is scored and ends the episode):
  ``"calculator_arithmetic"``: :class:`CalculatorArithmeticTask` (a safe :func:`calculator` tool);
  ``"python_problems"``: :class:`PythonTask` (the sandboxed ``python`` tool, :func:`shared_sandbox`);
  ``"retrieval"``: :class:`RetrievalTask` (``search``/``read`` tools over a :class:`DocumentStore` made for each
  episode).
- ``"reasoning_gym"``: :class:`chatenv.integrations.reasoning_gym.ReasoningGymTask`, imported when first made.
"""

from chatenv.tasks.arithmetic import ArithmeticTask
from chatenv.tasks.base import RewardError, Task, TaskResponse, TaskStart
from chatenv.tasks.calculator import CalculatorArithmeticTask, calculator
from chatenv.tasks.dataset import DatasetTask
from chatenv.tasks.guess_number import GuessNumberTask
from chatenv.tasks.python import PythonTask, shared_sandbox
from chatenv.tasks.registry import get_task, register
from chatenv.tasks.retrieval import DocumentStore, RetrievalTask
from chatenv.tasks.tool_task import ToolTask

__all__ = [
    "ArithmeticTask",
    "CalculatorArithmeticTask",
    "DatasetTask",
    "DocumentStore",
    "GuessNumberTask",
    "PythonTask",
    "RetrievalTask",
    "RewardError",
    "Task",
    "TaskResponse",
    "TaskStart",
    "ToolTask",
    "calculator",
    "get_task",
    "register",
    "shared_sandbox",
]

register("arithmetic", "chatenv.tasks.arithmetic:ArithmeticTask")
register("guess_number", "chatenv.tasks.guess_number:GuessNumberTask")
register("dataset", "chatenv.tasks.dataset:DatasetTask")
register("calculator_arithmetic", "chatenv.tasks.calculator:CalculatorArithmeticTask")
register("python_problems", "chatenv.tasks.python:PythonTask")
register("retrieval", "chatenv.tasks.retrieval:RetrievalTask")
register("reasoning_gym", "chatenv.integrations.reasoning_gym:ReasoningGymTask")
