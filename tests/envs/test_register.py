"""chatenv.register: task names and Gymnasium env ids from factories or lazy "module:attr" entries.

A user's task registered with an env id is made by ``gymnasium.make`` and listed by ``chatenv envs``; a name or an
id taken by something else is refused unless ``overwrite=True``; a broken lazy entry names itself when made; and
the tasks package never imports the integrations (the reasoning-gym task is a lazy entry).
"""

import ast
import pathlib
import subprocess
import sys

import gymnasium as gym
import pytest

import chatenv
from chatenv import ArithmeticTask, ChatEnv, GuessNumberTask, TokenEnv
from chatenv.cli import main
from chatenv.envs import ENVS, is_token_level
from chatenv.tasks import registry

USER_MODULE = """
from chatenv.tasks import GuessNumberTask


class UserTask(GuessNumberTask):
    description = "A user's guessing game."
"""


@pytest.fixture
def registrations():
    """Whatever a test registers (tasks, env ids, Gymnasium specs) is undone after it."""
    tasks, envs, specs = dict(registry._TASKS), dict(registry._ENVS), dict(gym.registry)
    yield
    registry._TASKS.clear()
    registry._TASKS.update(tasks)
    registry._ENVS.clear()
    registry._ENVS.update(envs)
    gym.registry.clear()
    gym.registry.update(specs)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """An importable module ``user_tasks_mod`` with a task class ``UserTask`` (not imported yet)."""
    (tmp_path / "user_tasks_mod.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_tasks_mod"
    sys.modules.pop("user_tasks_mod", None)


def test_a_user_task_and_env_id_are_made_by_gymnasium_and_listed(
    registrations, user_module, tokenizer, capsys, tmp_path
):
    chatenv.register("user_guess", f"{user_module}:UserTask", env_id="user/Guess-v0", description="A user's game.")
    assert user_module not in sys.modules  # registering costs no import
    assert ENVS["user/Guess-v0"] == ("user_guess", "A user's game.")

    env = gym.make("user/Guess-v0", tokenizer=tokenizer, input_mode="history")
    assert type(env.unwrapped.task).__name__ == "UserTask" and user_module in sys.modules
    obs, _ = env.reset(seed=0)
    assert "Guess it!" in obs[-1]["content"]
    env.close()
    assert type(ChatEnv("user_guess", tokenizer=tokenizer).task).__name__ == "UserTask"

    # another env id for the registered task: one step per token
    chatenv.register("user_guess", env_id="user/TokenGuess-v0", token_level=True)
    token_env = gym.make("user/TokenGuess-v0", tokenizer=tokenizer)
    assert isinstance(token_env.unwrapped, TokenEnv)
    token_env.close()

    assert main(["envs"]) == 0
    listing = capsys.readouterr().out
    assert "chatenv/Arithmetic-v0" in listing
    assert any(line.split() == ["user/Guess-v0", "A", "user's", "game."] for line in listing.splitlines())
    assert "user/TokenGuess-v0" in listing and "task 'user_guess'" in listing  # no description: the task's name

    # a token-level id is token-level wherever the CLI asks, whatever its name
    assert is_token_level("user/TokenGuess-v0") and not is_token_level("user/Guess-v0")
    assert is_token_level("chatenv/TokenArithmetic-v0") and not is_token_level("chatenv/Chat-v0")
    assert main(["rollout", "--env", "user/TokenGuess-v0", "--episodes", "1", "--out", str(tmp_path / "run")]) != 0
    assert "runs turn-level envs" in capsys.readouterr().err
    with pytest.raises(KeyError, match="unknown env 'user/Nothing-v0'"):
        is_token_level("user/Nothing-v0")


def test_silent_overwrites_are_refused_and_overwrite_replaces(registrations, tokenizer):
    chatenv.register("user_arith", ArithmeticTask, env_id="user/Arith-v0")
    assert ENVS["user/Arith-v0"] == ("user_arith", ArithmeticTask.description)
    # the same factory again (a class or its "module:attr", a module imported twice): fine
    chatenv.register("user_arith", ArithmeticTask, env_id="user/Arith-v0")
    chatenv.register("user_arith", "chatenv.tasks.arithmetic:ArithmeticTask")
    chatenv.register("arithmetic", ArithmeticTask)

    with pytest.raises(
        ValueError, match=r"task 'user_arith' is already registered \(to .*ArithmeticTask.*overwrite=True"
    ):
        chatenv.register("user_arith", GuessNumberTask)
    with pytest.raises(ValueError, match="env id 'user/Arith-v0' is already registered .*task 'user_arith'"):
        chatenv.register("user_guess", GuessNumberTask, env_id="user/Arith-v0")
    assert "user_guess" not in registry._TASKS  # a refused registration registers nothing
    with pytest.raises(ValueError, match="env id 'chatenv/Arithmetic-v0' is already registered"):
        chatenv.register("user_arith", env_id="chatenv/Arithmetic-v0")
    with pytest.raises(ValueError, match="'user/Arith-v0' is already registered .*overwrite=True"):
        chatenv.register("user_arith", env_id="user/Arith-v0", token_level=True)  # another entry point
    with pytest.raises(ValueError, match="'CartPole-v1' is already registered .*entry point"):
        chatenv.register("user_arith", env_id="CartPole-v1")  # not ours: named by its entry point
    assert gym.spec("chatenv/Arithmetic-v0").kwargs == {"task": "arithmetic"}

    chatenv.register("user_arith", GuessNumberTask, overwrite=True)
    assert isinstance(ChatEnv("user_arith", tokenizer=tokenizer).task, GuessNumberTask)
    chatenv.register("user_other", ArithmeticTask, env_id="user/Arith-v0", description="Replaced.", overwrite=True)
    assert ENVS["user/Arith-v0"] == ("user_other", "Replaced.")
    env = gym.make("user/Arith-v0", tokenizer=tokenizer)
    assert isinstance(env.unwrapped.task, ArithmeticTask)
    env.close()


def test_a_broken_lazy_entry_names_itself_when_made(registrations, tokenizer):
    chatenv.register("user_broken", "no_such_module_for_chatenv:Task", env_id="user/Broken-v0")
    with pytest.raises(ValueError, match="'user_broken' is registered as 'no_such_module_for_chatenv:Task', which"):
        gym.make("user/Broken-v0", tokenizer=tokenizer)
    chatenv.register("user_missing", "chatenv.tasks:NoSuchTask")
    with pytest.raises(ValueError, match="'chatenv.tasks:NoSuchTask', which cannot be loaded"):
        ChatEnv("user_missing", tokenizer=tokenizer)
    chatenv.register("user_value", "chatenv.tasks:__all__")
    with pytest.raises(ValueError, match="'chatenv.tasks:__all__', which is a list, not callable"):
        ChatEnv("user_value", tokenizer=tokenizer)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (("", ArithmeticTask), {}, ValueError, "non-empty string"),
        (("x", "no_colon"), {}, ValueError, "'module:attr'"),
        (("x", 42), {}, TypeError, "callable or 'module:attr'"),
        (("x",), {}, ValueError, "'x' is not registered: give its factory"),
        (("x", ArithmeticTask), {"env_id": "not an id"}, ValueError, "Malformed environment ID"),
        (("x", ArithmeticTask), {"env_id": 3}, TypeError, "env_id must be a str"),
        (("x", ArithmeticTask), {"description": "no id"}, ValueError, "describe an env id"),
        (("x", ArithmeticTask), {"env_id": "user/X-v0", "description": 1}, TypeError, "description must be a str"),
    ],
)
def test_bad_registrations_are_refused(registrations, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        chatenv.register(*args, **kwargs)
    assert "x" not in registry._TASKS and "user/X-v0" not in gym.registry


@pytest.mark.slow
def test_the_tasks_package_never_imports_the_integrations():
    code = (
        "import sys, chatenv.tasks\n"
        "from chatenv.tasks import get_task\n"
        "get_task('arithmetic'), get_task('retrieval')\n"
        "loaded = [m for m in sys.modules if m.startswith('chatenv.integrations')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    package = pathlib.Path(chatenv.__file__).parent / "tasks"
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n.startswith("chatenv.integrations")], f"{path} imports {names}"


def test_token_level_is_told_by_the_class_the_id_makes(registrations):
    class MyTokenEnv(TokenEnv):
        pass

    gym.register("user/MyTok-v0", entry_point=MyTokenEnv)
    gym.register("user/ByPath-v0", entry_point="chatenv.envs:TokenEnv")
    gym.register("user/Factory-v0", entry_point=lambda: TokenEnv())
    assert is_token_level("user/MyTok-v0") and is_token_level("user/ByPath-v0")
    assert not is_token_level("user/Factory-v0")  # a factory function: not known without making an env


def test_lambdas_and_local_factories_are_never_taken_for_each_other(registrations):
    first = lambda **kw: ArithmeticTask(**kw)  # noqa: E731
    chatenv.register("mine", first)
    chatenv.register("mine", first)  # the very same object: fine
    with pytest.raises(ValueError, match="already registered"):
        chatenv.register("mine", lambda **kw: GuessNumberTask(**kw))

    def make(cls):
        def factory(**kw):
            return cls(**kw)

        return factory

    chatenv.register("local", make(ArithmeticTask))
    with pytest.raises(ValueError, match="already registered"):
        chatenv.register("local", make(GuessNumberTask))
