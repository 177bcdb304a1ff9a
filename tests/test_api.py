import importlib
import subprocess
import sys

import pytest

MODULES = [
    "chatenv",
    "chatenv.containers",
    "chatenv.errors",
    "chatenv.history",
    "chatenv.models",
    "chatenv.spaces",
    "chatenv.templates",
    "chatenv.tokenization",
    "wrappers",
]


@pytest.mark.parametrize("name", MODULES)
def test_every_public_name_imports(name):
    module = importlib.import_module(name)
    for attr in module.__all__:
        assert hasattr(module, attr), f"{name}.{attr}"


def test_core_never_imports_the_adapters(tmp_path):
    # a user's own module named "wrappers" must not matter to chatenv
    (tmp_path / "wrappers.py").write_text("raise RuntimeError('user module imported')\n")
    code = "import sys, chatenv, chatenv.tokenization, chatenv.models; assert 'wrappers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True)
