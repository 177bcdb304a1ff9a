"""Tools: Python callables the assistant can call, each with the JSON schema the model is shown.

A :class:`Tool` is a name, a JSON schema (OpenAI ``{"type": "function", "function": {...}}`` form, derived from the
signature and Google-style docstring with :func:`transformers.utils.get_json_schema`) and a sync or async
callable. :func:`as_tool` turns a plain function into one; :class:`PerEpisode` wraps a factory whose object is
created fresh at every reset (a scratch file system, a counter, a sandbox session): its public methods with
docstrings become the episode's tools.

Example:
    >>> def add(a: int, b: int) -> int:
    ...     '''Add two integers.
    ...
    ...     Args:
    ...         a: The first number.
    ...         b: The second number.
    ...     '''
    ...     return a + b
    >>> t = as_tool(add)
    >>> t.name, t.schema["function"]["parameters"]["required"]
    ('add', ['a', 'b'])
    >>> t.check_arguments({"a": 1})
    "missing required argument 'b'"
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PerEpisode", "Tool", "as_tool", "check_tool_names", "method_tools"]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (dict,),
    "null": (type(None),),
}


@dataclass(frozen=True)
class Tool:
    """A callable tool and its schema.

    Attributes:
        name: The name the model calls it by.
        schema: The OpenAI-style function schema (``{"type": "function", "function": {"name", "description",
            "parameters"}}``), rendered into the prompt by tool-capable templates.
        fn: The callable, sync or ``async``; called with the call's arguments as keywords.
        concurrent: Whether calls of this tool may run at the same time as other concurrent calls of the same
            turn (results are still returned in call order).
        timeout: Seconds a call may take (None: the env's per-call timeout).
    """

    name: str
    schema: Mapping[str, Any]
    fn: Callable[..., Any]
    concurrent: bool = False
    timeout: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_async(self) -> bool:
        """Whether :attr:`fn` is a coroutine function."""
        return inspect.iscoroutinefunction(self.fn)

    @property
    def parameters(self) -> Mapping[str, Any]:
        """The JSON schema of the arguments (an ``object`` schema)."""
        return self.schema["function"].get("parameters") or {"type": "object", "properties": {}}

    def check_arguments(self, arguments: Any) -> str | None:
        """Why ``arguments`` do not fit the schema (missing, unknown or mistyped arguments), or None if they do.

        Checks the top level only: required names, unknown names (unless the schema allows additional
        properties), and JSON types of the given values.
        """
        if not isinstance(arguments, Mapping):
            return f"arguments must be a JSON object, got {type(arguments).__name__}"
        params = self.parameters
        props = params.get("properties") or {}
        for name in params.get("required") or []:
            if name not in arguments:
                return f"missing required argument {name!r}"
        for name, value in arguments.items():
            if name not in props:
                if params.get("additionalProperties", False) is not False:
                    continue
                known = ", ".join(props) or "none"
                return f"unknown argument {name!r} (arguments: {known})"
            wanted = props[name].get("type")
            if wanted is not None and not _type_ok(value, wanted):
                return f"argument {name!r} must be of type {wanted}, got {type(value).__name__} {value!r:.40}"
        return None


def _type_ok(value: Any, wanted: str | Sequence[str]) -> bool:
    names = [wanted] if isinstance(wanted, str) else list(wanted)
    for name in names:
        kinds = _JSON_TYPES.get(name)
        if kinds is None:
            return True  # a type this check does not know: let the tool decide
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, kinds):
            return True
    return False


def as_tool(obj: Any, *, name: str | None = None, concurrent: bool = False, timeout: float | None = None) -> Tool:
    """A :class:`Tool` from a function (or bound method), or ``obj`` itself if it already is one.

    The schema comes from the signature's type hints and the Google-style docstring (``Args:`` section), via
    :func:`transformers.utils.get_json_schema`.

    Raises:
        TypeError: If ``obj`` is not callable, or its signature or docstring cannot give a schema (every
            argument needs a type hint and an ``Args:`` entry).
    """
    if isinstance(obj, Tool):
        return obj
    if not callable(obj):
        raise TypeError(f"a tool must be a function, a bound method or a Tool, got {type(obj).__name__}")
    from transformers.utils.chat_template_utils import get_json_schema  # its defining module (not re-exported)

    try:
        schema = get_json_schema(obj)
    except Exception as e:  # transformers raises its own parsing errors and TypeError
        label = getattr(obj, "__qualname__", repr(obj))
        raise TypeError(
            f"cannot build a tool schema for {label}: {e}. Give every argument a type hint and describe it in a "
            "Google-style docstring ('Args:' section), or build a Tool(name, schema, fn) yourself"
        ) from e
    if name is not None:
        schema = {**schema, "function": {**schema["function"], "name": name}}
    return Tool(schema["function"]["name"], schema, obj, concurrent=concurrent, timeout=timeout)


def method_tools(obj: Any) -> list[Tool]:
    """Tools from an object's public methods that have docstrings (a per-episode tool object's interface).

    ``close`` is not a tool: it is called when the object's episode ends.

    Methods may set ``concurrent`` / ``timeout`` attributes (e.g. with a decorator) to pass them on.
    """
    tools = []
    for attr in sorted(dir(type(obj))):
        if attr.startswith("_") or attr == "close":  # close() ends the object's episode; it is not a tool
            continue
        member = getattr(obj, attr, None)
        if not inspect.ismethod(member) or not inspect.getdoc(member):
            continue
        tools.append(
            as_tool(
                member,
                concurrent=bool(getattr(member, "concurrent", False)),
                timeout=getattr(member, "timeout", None),
            )
        )
    if not tools:
        raise TypeError(
            f"{type(obj).__name__} has no public methods with docstrings; a per-episode tool object exposes its "
            "tools as documented public methods"
        )
    return tools


class PerEpisode:
    """Tools from an object made fresh for every episode, e.g. ``PerEpisode(ScratchFiles)``.

    Args:
        factory: Called at each reset; returns an object whose documented public methods are the tools (or a
            list of functions / :class:`Tool`). If the object has a ``close()`` method it is called when the episode
            ends or the env is reset or closed.
        pass_state: Call ``factory(state)`` with the episode's task state (e.g. the documents a search tool
            serves), so tools never depend on which episode a shared task object drew last. To read the tools'
            schemas it is called once with ``None``.
    """

    def __init__(self, factory: Callable[..., Any], *, pass_state: bool = False):
        if not callable(factory):
            raise TypeError(f"PerEpisode needs a factory (a class or function), got {type(factory).__name__}")
        self.factory = factory
        self.pass_state = bool(pass_state)
        self._schemas: list[Mapping[str, Any]] | None = None

    def create(self, state: Any = None) -> tuple[Any, list[Tool]]:
        """A new object (for an episode with this task state) and its tools (same schemas every episode)."""
        return self._tools(self.factory(state) if self.pass_state else self.factory())

    def fork(self, obj: Any) -> tuple[Any, list[Tool]]:
        """An independent copy of an episode's object and its tools, for a forked episode.

        The copy is ``copy.deepcopy(obj)``, which a class customises with ``__deepcopy__``.

        Raises:
            TypeError: If the object cannot be copied (it holds a lock, a socket, a process...): the message says to
                give its class a ``__deepcopy__`` that makes an independent copy.
        """
        try:
            copied = copy.deepcopy(obj)
        except Exception as e:
            raise TypeError(
                f"the episode's {type(obj).__name__} tool object cannot be forked ({type(e).__name__}: {e}); give "
                "its class a __deepcopy__(self, memo) that returns an independent copy (e.g. with its own files)"
            ) from e
        return self._tools(copied)

    def _tools(self, obj: Any) -> tuple[Any, list[Tool]]:
        tools = [as_tool(t) for t in obj] if isinstance(obj, (list, tuple)) else method_tools(obj)
        schemas = [t.schema for t in tools]
        if self._schemas is None:
            self._schemas = schemas
        elif schemas != self._schemas:
            raise ValueError(
                f"PerEpisode({getattr(self.factory, '__name__', self.factory)!r}) made tools with other schemas than "
                "in the first episode; the prompt shows the same tools in every episode"
            )
        return obj, tools

    def schemas(self) -> list[Mapping[str, Any]]:
        """The tools' schemas (one object is created and closed to read them, the first time)."""
        if self._schemas is None:
            obj, _ = self.create()
            close = getattr(obj, "close", None)
            if callable(close):
                close()
        return list(self._schemas or [])

    def __repr__(self) -> str:
        return f"PerEpisode({getattr(self.factory, '__name__', repr(self.factory))})"


def check_tool_names(tools: Sequence[Tool]) -> None:
    """Raise ValueError if two tools share a name (a call could not be routed)."""
    seen: dict[str, Tool] = {}
    for t in tools:
        if t.name in seen:
            raise ValueError(f"two tools are named {t.name!r}; tool names must be unique")
        seen[t.name] = t
