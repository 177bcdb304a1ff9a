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
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    for attr in module.__all__:
        assert hasattr(module, attr), f"{name}.{attr}"


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


def test_modules_stay_small():
    import pathlib

    for root in (pathlib.Path(chatenv.__file__).parent, pathlib.Path(wrappers.__file__).parent):
        for path in root.rglob("*.py"):
            lines = path.read_text().count("\n")
            assert lines <= 520, f"{path} has {lines} lines; split it (one concept per module)"


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
