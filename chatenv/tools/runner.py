"""Running the assistant's tool calls for an env: budgets, timeouts, output caps and the failure policy.

A :class:`Toolbox` is what an env is given: the tools and the rules. Each episode opens a :class:`ToolSession`
(per-episode tool objects are created then), which runs the calls of one reply in order
(:meth:`ToolSession.run`) and returns a :class:`ToolTurn`: one ``tool`` message per call, answering its
``tool_call_id``, and the counts. Nothing is counted until the env commits the turn.

Failures never lose the episode. A malformed call (``parse``), an unknown tool (``unknown_tool``), arguments
that do not fit the schema (``arguments``), a tool that raises (``raised``), a call over its time (``timeout``)
and a call over a budget (``budget``) each give, by the failure policy of that kind:

- ``"feedback"`` (default): a ``tool`` message starting with ``Error:`` that says what was wrong; the episode
  goes on;
- ``"terminate"``: the same message, and the episode ends (terminated) after this turn;
- ``"raise"``: :class:`~chatenv.errors.ToolCallError`, and the env is left as it was before the step.

Output longer than ``max_output_chars`` is cut with an explicit marker and counted (``truncated``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chatenv.errors import ToolCallError
from chatenv.templates.tool_calls import MalformedCall, ToolCall
from chatenv.tools.base import PerEpisode, Tool, as_tool, check_tool_names
from chatenv.tools.loop import background_loop

__all__ = ["ERROR_KINDS", "ToolResult", "ToolSession", "ToolStats", "ToolTurn", "Toolbox"]

ERROR_KINDS = ("parse", "unknown_tool", "arguments", "raised", "timeout", "budget")
_POLICIES = ("feedback", "terminate", "raise")
_UNRENDERABLE = re.compile("[\ufdd0-\ufdd3\ud800-\udfff]")
# a started call: its index in the reply, the call, its tool, its future, when it started
_Pending = tuple[int, ToolCall, Tool, concurrent.futures.Future[Any], float]


@dataclass(frozen=True)
class ToolResult:
    """The outcome of one call: the message content, and the error kind if it failed."""

    call_id: str
    name: str
    content: str
    error: str | None = None
    truncated: bool = False
    seconds: float = 0.0

    def message(self) -> dict[str, Any]:
        """The ``tool`` message answering the call."""
        msg = {"role": "tool", "content": self.content, "tool_call_id": self.call_id}
        if self.name:
            msg["name"] = self.name
        return msg


@dataclass
class ToolTurn:
    """The results of one reply's calls, in call order, and whether the failure policy ends the episode."""

    results: list[ToolResult]
    terminate: bool = False

    @property
    def messages(self) -> list[dict[str, Any]]:
        """One ``tool`` message per call."""
        return [r.message() for r in self.results]

    def counts(self) -> dict[str, Any]:
        """``{"calls", "errors", "truncated", "error_kinds": {kind: n}}`` for this turn."""
        kinds: dict[str, int] = {}
        for r in self.results:
            if r.error:
                kinds[r.error] = kinds.get(r.error, 0) + 1
        return {
            "calls": len(self.results),
            "errors": sum(kinds.values()),
            "truncated": sum(r.truncated for r in self.results),
            "error_kinds": kinds,
        }


@dataclass(frozen=True)
class ToolStats:
    """Tool use of an episode so far: calls made, calls that failed (by kind), outputs cut."""

    calls: int = 0
    errors: int = 0
    truncated: int = 0
    error_kinds: Mapping[str, int] = field(default_factory=dict)

    @property
    def successes(self) -> int:
        """Calls that returned a result."""
        return self.calls - self.errors

    def plus(self, turn: ToolTurn) -> ToolStats:
        """These stats with ``turn`` counted."""
        c = turn.counts()
        kinds = dict(self.error_kinds)
        for k, n in c["error_kinds"].items():
            kinds[k] = kinds.get(k, 0) + n
        return ToolStats(self.calls + c["calls"], self.errors + c["errors"], self.truncated + c["truncated"], kinds)


def _policy_map(on_error: str | Mapping[str, str]) -> dict[str, str]:
    if isinstance(on_error, str):
        on_error = {"default": on_error}
    if not isinstance(on_error, Mapping):
        raise TypeError(f"on_error must be a str or a dict of kind -> policy, got {type(on_error).__name__}")
    default = on_error.get("default", "feedback")
    out = {}
    for kind, policy in {**dict.fromkeys(ERROR_KINDS, default), **on_error}.items():
        if kind != "default" and kind not in ERROR_KINDS:
            raise ValueError(f"unknown tool error kind {kind!r} in on_error (kinds: {', '.join(ERROR_KINDS)})")
        if policy not in _POLICIES:
            raise ValueError(f"on_error policy for {kind!r} must be one of {_POLICIES}, got {policy!r}")
        out[kind] = policy
    out.pop("default", None)
    return out


def _positive(name: str, value: Any, *, integer: bool) -> Any:
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or value <= 0:
        raise ValueError(f"{name} must be a positive {'int' if integer else 'number'}, got {value!r}")
    return value


class Toolbox:
    """Tools for an env and the rules for calling them.

    Args:
        tools: Functions, :class:`~chatenv.tools.base.Tool` objects and
            :class:`~chatenv.tools.base.PerEpisode` factories (fresh objects each episode).
        on_error: ``"feedback"``, ``"terminate"`` or ``"raise"``, or a dict ``{kind: policy}`` (with an optional
            ``"default"``) over the kinds in :data:`ERROR_KINDS`.
        timeout: Seconds a call may take (a tool's own ``timeout`` wins). An async call is cancelled when its time
            runs out; a sync function cannot be stopped from outside and is left to finish on its daemon thread
            (use the process sandbox for code that must be killed).
        max_calls_per_turn: Calls of one reply that run; later ones get a ``budget`` error.
        max_calls_per_episode: Calls of an episode that run; later ones get a ``budget`` error.
        max_output_chars: Longer outputs are cut, with a marker saying how much was cut.
    """

    def __init__(
        self,
        tools: Sequence[Any] = (),
        *,
        on_error: str | Mapping[str, str] = "feedback",
        timeout: float = 30.0,
        max_calls_per_turn: int = 8,
        max_calls_per_episode: int = 64,
        max_output_chars: int = 8000,
    ):
        if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
            raise TypeError(
                f"tools must be a list of functions, Tool or PerEpisode objects, got {type(tools).__name__}"
            )
        self.static = [as_tool(t) for t in tools if not isinstance(t, PerEpisode)]
        self.per_episode = [t for t in tools if isinstance(t, PerEpisode)]
        self.policies = _policy_map(on_error)
        self.on_error = on_error
        self.timeout = float(_positive("timeout", timeout, integer=False))
        self.max_calls_per_turn = _positive("max_calls_per_turn", max_calls_per_turn, integer=True)
        self.max_calls_per_episode = _positive("max_calls_per_episode", max_calls_per_episode, integer=True)
        self.max_output_chars = _positive("max_output_chars", max_output_chars, integer=True)
        self._schemas: list[Mapping[str, Any]] | None = None

    def with_tools(self, tools: Sequence[Any]) -> Toolbox:
        """A toolbox with the same rules and ``tools`` added before these ones."""
        return Toolbox(
            [*tools, *self.static, *self.per_episode],
            on_error=self.on_error,
            timeout=self.timeout,
            max_calls_per_turn=self.max_calls_per_turn,
            max_calls_per_episode=self.max_calls_per_episode,
            max_output_chars=self.max_output_chars,
        )

    def schemas(self) -> list[Mapping[str, Any]]:
        """The tools' schemas, as the prompt shows them (checked for unique names once)."""
        if self._schemas is None:
            schemas = [t.schema for t in self.static] + [s for p in self.per_episode for s in p.schemas()]
            names = [s["function"]["name"] for s in schemas]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"tool names must be unique; {dup} appear more than once")
            self._schemas = schemas
        return list(self._schemas)

    def open(self, state: Any = None) -> ToolSession:
        """A session for a new episode with this task state (per-episode tool objects are created now)."""
        return ToolSession(self, state)

    def __repr__(self) -> str:
        names = [s["function"]["name"] for s in self.schemas()]
        return f"Toolbox({names}, on_error={self.on_error!r}, timeout={self.timeout})"


class ToolSession:
    """The tools of one episode, and their use so far (:attr:`stats`)."""

    def __init__(self, box: Toolbox, state: Any = None):
        self.box = box
        self.objects: list[Any] = []
        tools = list(box.static)
        for factory in box.per_episode:
            obj, made = factory.create(state)
            self.objects.append(obj)
            tools.extend(made)
        check_tool_names(tools)
        self.tools: dict[str, Tool] = {t.name: t for t in tools}
        self.stats = ToolStats()
        self.closed = False

    def run(self, items: Sequence[ToolCall | MalformedCall]) -> ToolTurn:
        """Run the calls of one reply in order (concurrent tools side by side); count nothing yet.

        Raises:
            ToolCallError: For a failure whose policy is ``"raise"``.
        """
        if self.closed:
            raise RuntimeError("this episode's tools were closed; reset the env to start a new episode")
        results: list[ToolResult | None] = [None] * len(items)
        pending: list[_Pending] = []
        for k, item in enumerate(items):
            admitted = self._admit(k, item)
            if isinstance(admitted, ToolResult):
                self._flush(pending, results)
                results[k] = self._checked(admitted)
                continue
            call, tool = admitted
            if not tool.concurrent:
                self._flush(pending, results)
            pending.append((k, call, tool, _start(tool, call.arguments), time.monotonic()))
            if not tool.concurrent:
                self._flush(pending, results)
        self._flush(pending, results)
        done = [r for r in results if r is not None]
        return ToolTurn(done, terminate=any(r.error and self.box.policies[r.error] == "terminate" for r in done))

    def fork(self) -> ToolSession:
        """An independent session at the same point, with the same use so far.

        Each per-episode object is copied (:meth:`PerEpisode.fork`); static tools are shared (no episode state).

        Raises:
            TypeError: If a per-episode object cannot be copied.
            RuntimeError: If this session is closed.
        """
        if self.closed:
            raise RuntimeError("this episode's tools were closed; fork an episode in progress")
        new = object.__new__(ToolSession)
        new.box, new.stats, new.closed = self.box, self.stats, False
        new.objects, tools = [], list(self.box.static)
        try:
            for factory, obj in zip(self.box.per_episode, self.objects):
                copied, made = factory.fork(obj)
                new.objects.append(copied)
                tools.extend(made)
        except BaseException:
            new.close()
            raise
        new.tools = {t.name: t for t in tools}
        return new

    def commit(self, turn: ToolTurn) -> None:
        """Count a committed turn's calls."""
        self.stats = self.stats.plus(turn)

    def close(self) -> None:
        """Close the episode's tool objects (their ``close()``); safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for obj in self.objects:
            close = getattr(obj, "close", None)
            if not callable(close):
                continue
            try:
                close()
            except Exception as e:  # a tool object that fails to close must not break the env's reset or close
                warnings.warn(f"closing the episode's {type(obj).__name__} failed: {_describe(e)}", stacklevel=2)

    # ------------------------------------------------------------------------------------------ internals

    def _admit(self, k: int, item: ToolCall | MalformedCall) -> tuple[ToolCall, Tool] | ToolResult:
        """The call and the tool to run it with, or the error result for a call that must not run."""
        if isinstance(item, MalformedCall):
            return _error(item.id, "", "parse", f"the tool call could not be read: {item.reason}")
        if k >= self.box.max_calls_per_turn:
            why = f"at most {self.box.max_calls_per_turn} tool calls run per reply; this call was not run"
            return _error(item.id, item.name, "budget", why)
        if self.stats.calls + k >= self.box.max_calls_per_episode:
            why = f"the episode's budget of {self.box.max_calls_per_episode} tool calls is spent; this call was not run"
            return _error(item.id, item.name, "budget", why)
        tool = self.tools.get(item.name)
        if tool is None:  # the message carries no name: the model's string is not a tool's name
            known = ", ".join(sorted(self.tools)) or "none"
            return _error(item.id, "", "unknown_tool", f"there is no tool named {item.name!r:.80} (tools: {known})")
        mismatch = tool.check_arguments(item.arguments)
        if mismatch is not None:
            return _error(item.id, item.name, "arguments", f"bad arguments for {item.name!r}: {mismatch}")
        return item, tool

    def _flush(self, pending: list[_Pending], results: list[ToolResult | None]) -> None:
        """Wait for the started calls, in call order."""
        for k, call, tool, future, started in pending:
            limit = tool.timeout if tool.timeout is not None else self.box.timeout
            results[k] = self._checked(self._finish(call, future, started, limit))
        pending.clear()

    def _finish(
        self, call: ToolCall, future: concurrent.futures.Future[Any], started: float, limit: float
    ) -> ToolResult:
        try:
            value = future.result(max(0.0, started + limit - time.monotonic()))
        except (concurrent.futures.TimeoutError, TimeoutError) as e:
            future.cancel()
            detail = str(e) if isinstance(e, TimeoutError) and str(e) else f"no result within {limit:g} s"
            return _error(call.id, call.name, "timeout", f"{call.name!r} timed out: {detail}")
        except concurrent.futures.CancelledError:
            return _error(call.id, call.name, "timeout", f"{call.name!r} was cancelled")
        except (Exception, SystemExit) as e:  # a tool's own failure becomes a message the model can read
            return _error(call.id, call.name, "raised", f"{call.name!r} raised {_describe(e)}")
        try:
            text, truncated = self._text(value)
        except Exception as e:  # e.g. a result whose str() raises
            return _error(
                call.id, call.name, "raised", f"{call.name!r} returned a value that is not text: {_describe(e)}"
            )
        return ToolResult(call.id, call.name, text, None, truncated, time.monotonic() - started)

    def _checked(self, result: ToolResult) -> ToolResult:
        if result.error and self.box.policies[result.error] == "raise":
            raise ToolCallError(result.error, result.content, call_id=result.call_id, tool=result.name)
        return result

    def _text(self, value: Any) -> tuple[str, bool]:
        """A tool's return value as message text: strings as they are, other values as JSON; capped."""
        if isinstance(value, str):
            text = value
        elif value is None:
            text = ""
        elif isinstance(value, bytes):
            text = value.decode("utf-8", errors="replace")
        else:
            text = json.dumps(value, ensure_ascii=False, default=str)
        # lone surrogates and the renderer's reserved characters cannot go into a message: shown as U+FFFD
        text = _UNRENDERABLE.sub("\ufffd", text)
        cap = self.box.max_output_chars
        if len(text) <= cap:
            return text, False
        return text[:cap] + f"\n[output truncated: {len(text) - cap} of {len(text)} characters not shown]", True


def _error(call_id: str, name: str, kind: str, detail: str) -> ToolResult:
    return ToolResult(call_id, name, f"Error: {detail}", kind)


def _describe(e: BaseException) -> str:
    try:
        text = str(e)
    except Exception:  # an exception whose str() fails still gets reported
        text = "<no message>"
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _start(tool: Tool, arguments: Mapping[str, Any]) -> concurrent.futures.Future[Any]:
    """Start a call: an async tool on the background loop, a sync one on its own daemon thread."""
    if tool.is_async:
        return asyncio.run_coroutine_threadsafe(_await(tool, arguments), background_loop())
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def call() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(tool.fn(**arguments))
        except BaseException as e:  # handed to the waiting step, which reports it
            future.set_exception(e)

    threading.Thread(target=call, name=f"chatenv-tool-{tool.name}", daemon=True).start()
    return future


async def _await(tool: Tool, arguments: Mapping[str, Any]) -> Any:
    return await tool.fn(**arguments)
