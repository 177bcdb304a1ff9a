"""Task registration: names for tasks (``ChatEnv(task="name")``) and Gymnasium env ids (``gymnasium.make(id)``).

:func:`register` is the one way in, Gymnasium style: a task is registered under a name with its factory (a
:class:`~chatenv.tasks.Task` subclass, a function, or a lazy ``"module:attr"`` string imported when the task is
first made, so registering costs no import), optionally with an env id that ``gymnasium.make`` builds and
``chatenv envs`` lists. A name or an env id taken by something else is refused unless ``overwrite=True``; the
same factory again (a module imported twice) is fine. :func:`get_task` makes a task from a name, e.g. after
``chatenv.register("my_task", "my_pkg.tasks:MyTask", env_id="me/MyTask-v0")`` both ``ChatEnv("my_task")`` and
``gymnasium.make("me/MyTask-v0")`` make ``my_pkg.tasks.MyTask()`` (imported then).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import parse_env_id

from chatenv.tasks.base import Task

__all__ = ["ENVS", "Factory", "get_task", "register"]

#: a task factory: called with the task's keyword arguments; or ``"module:attr"``, imported when first made
Factory = Callable[..., Task] | str

_TASKS: dict[str, Factory] = {}
_ENVS: dict[str, tuple[str, str]] = {}
#: env id -> (task name, one-line description): every env id registered through :func:`register` (read-only)
ENVS: Mapping[str, tuple[str, str]] = MappingProxyType(_ENVS)

_ENTRY_POINTS = {False: "chatenv.envs.chat_env:ChatEnv", True: "chatenv.envs.token_env:TokenEnv"}


def register(
    name: str,
    factory: Factory | None = None,
    *,
    env_id: str | None = None,
    description: str = "",
    token_level: bool = False,
    overwrite: bool = False,
) -> None:
    """Register a task under ``name`` (for ``ChatEnv(task=name)``), and optionally a Gymnasium env id for it.

    Args:
        name: The task's name.
        factory: Called with the ``task_kwargs`` to make the task (a :class:`~chatenv.tasks.Task` subclass or a
            function); or ``"module:attr"``, imported when the task is first made. None: the factory already
            registered under ``name`` (to add an env id for a registered task).
        env_id: A Gymnasium id (``"namespace/Name-v0"``) made by ``gymnasium.make(env_id, **env_kwargs)`` as a
            :class:`~chatenv.envs.ChatEnv` (or :class:`~chatenv.envs.TokenEnv`) of this task, and listed by
            ``chatenv envs``.
        description: One line for ``chatenv envs`` (with ``env_id``; default: the factory's ``description``).
        token_level: The env id makes a :class:`~chatenv.envs.TokenEnv` (one step per token), not a ``ChatEnv``.
        overwrite: Replace a task or env id already registered to something else.

    Raises:
        ValueError: For an empty name, a malformed ``"module:attr"`` or env id, no factory for a new name, or a
            name or env id taken by something else without ``overwrite=True`` (nothing is registered then).
        TypeError: For a factory that is neither callable nor a string, or a non-string env id or description.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a task name must be a non-empty string, got {name!r}")
    factory = _checked_factory(name, factory, overwrite)
    if env_id is None:
        if description or token_level:
            raise ValueError("description and token_level describe an env id: pass env_id=... too")
        _TASKS[name] = factory
        return
    entry = _checked_env_id(env_id, name, bool(token_level), overwrite)
    if not isinstance(description, str):
        raise TypeError(f"description must be a str, got {type(description).__name__}")
    _TASKS[name] = factory
    if env_id in gym.registry:  # the same registration again, or overwrite=True: replaced without gym's warning
        del gym.registry[env_id]
    gym.register(id=env_id, entry_point=entry, kwargs={"task": name})
    _ENVS[env_id] = (name, description or _describe(name, factory))


def _checked_factory(name: str, factory: Factory | None, overwrite: bool) -> Factory:
    """The factory to register under ``name``, checked against what is registered there."""
    if factory is None:
        if name not in _TASKS:
            raise ValueError(
                f"task {name!r} is not registered: give its factory (a Task subclass, a function or 'module:attr')"
            )
        return _TASKS[name]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        if not module or not attr:
            raise ValueError(f"a lazy task factory is 'module:attr', got {factory!r}")
    elif not callable(factory):
        raise TypeError(f"a task factory must be callable or 'module:attr', got {type(factory).__name__}")
    if name in _TASKS and not overwrite and _factory_id(_TASKS[name]) != _factory_id(factory):
        raise ValueError(
            f"task {name!r} is already registered (to {_TASKS[name]!r}); pick another name, or pass overwrite=True "
            "to replace it"
        )
    return factory


def _checked_env_id(env_id: str, name: str, token_level: bool, overwrite: bool) -> str:
    """The entry point of ``env_id``, checked against what Gymnasium has under that id."""
    if not isinstance(env_id, str):
        raise TypeError(f"env_id must be a str, got {type(env_id).__name__}")
    try:
        parse_env_id(env_id)
    except gym.error.Error as e:
        raise ValueError(str(e)) from None
    entry = _ENTRY_POINTS[token_level]
    spec = gym.registry.get(env_id)
    if spec is not None and not overwrite and (spec.entry_point, spec.kwargs) != (entry, {"task": name}):
        there = (
            f"task {_ENVS[env_id][0]!r}, entry point {spec.entry_point!r}"
            if env_id in _ENVS
            else f"entry point {spec.entry_point!r}"
        )
        raise ValueError(
            f"env id {env_id!r} is already registered (to {there}); pick another id (or version, e.g. '-v1'), or "
            "pass overwrite=True to replace it"
        )
    return entry


def _factory_id(factory: Factory) -> Any:
    """What makes two registrations the same: module and name (``"m:a"`` is the same as ``m.a``), else the object.

    A name is only trusted where it is importable: lambdas and functions or classes defined inside functions
    (``<lambda>``, ``<locals>`` in their qualified name) are the same only as the very same object.
    """
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        return (module, attr)
    qualname = getattr(factory, "__qualname__", None)
    if not isinstance(qualname, str) or "<" in qualname:
        return id(factory)
    return (getattr(factory, "__module__", None), qualname)


def _describe(name: str, factory: Factory) -> str:
    """A line for ``chatenv envs`` without importing anything: the factory's ``description``, else its name."""
    described = "" if isinstance(factory, str) else getattr(factory, "description", "")
    return described if isinstance(described, str) and described else f"task {name!r}"


def _factory(name: str) -> Callable[..., Task]:
    """The factory registered under ``name``, importing a lazy ``"module:attr"`` one."""
    factory = _TASKS[name]
    if not isinstance(factory, str):
        return factory
    module, _, attr = factory.partition(":")
    try:
        loaded = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"task {name!r} is registered as {factory!r}, which cannot be loaded: {e}; fix the entry, or register "
            "the task again with overwrite=True"
        ) from e
    if not callable(loaded):
        raise ValueError(
            f"task {name!r} is registered as {factory!r}, which is a {type(loaded).__name__}, not callable"
        )
    return loaded  # type: ignore[no-any-return]


def get_task(task: str | Task, **kwargs: Any) -> Task:
    """A task object from a registered name (made with ``kwargs``) or an instance (returned as it is).

    Raises:
        ValueError: For an unknown name (with the closest one), a lazy entry that cannot be loaded, or ``kwargs``
            with a task instance.
    """
    if isinstance(task, Task):
        if kwargs:
            raise ValueError("task_kwargs apply to a task given by name, not to a Task instance")
        return task
    if task not in _TASKS:
        close = difflib.get_close_matches(str(task), list(_TASKS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown task {task!r}{hint} (known: {', '.join(sorted(_TASKS))})")
    return _factory(task)(**kwargs)
