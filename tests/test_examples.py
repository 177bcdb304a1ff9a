"""Each example runs to completion (they are small by design: seconds to a minute on 2 CPU cores)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example is a subprocess that loads models and trains or serves

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
EXPECT = {
    "quickstart.py": "turn 1: reward",
    "token_env_kl.py": "coef now",
    "vllm_policy.py": "game 3: rewards",
    "ray_reference.py": "KL-penalised",
    "torchrl_interop.py": "",
    "grpo_training.py": "reward: first step",
    "trl_grpo.py": "reward per step",
    "openai_agent.py": "collected",
    "tool_agent.py": "scripted episode",
}
# the training loop runs two short steps here (its default run, 8 steps, shows the reward rising)
ARGS = {
    "grpo_training.py": ["--steps", "2", "--group", "4"],
    "trl_grpo.py": ["--steps", "1"],
    "openai_agent.py": ["--episodes", "2"],
}


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name):
    scratch = ROOT / ".scratch"
    (scratch / "tmp").mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "TMPDIR": os.environ.get("TMPDIR", str(scratch / "tmp")),
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(scratch / "vllm")),
        "RAY_AUTH_MODE": "disabled",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *ARGS.get(name, [])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert EXPECT.get(name, "") in proc.stdout, proc.stdout[-2000:]
