"""Shared test data and the independent log-prob computation the policy tests compare against."""

import functools
import math
import re

import torch
from tensordict import TensorDict

from chatenv import ChatHistory, History

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, how are you today?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]


def history_td(chats=CHATS):
    """A (B,) tensordict with the chats at ("history", "prompt")."""
    n = len(chats)
    return TensorDict(history=ChatHistory(prompt=History.from_chats(chats), batch_size=[n]), batch_size=[n])


def reference_log_probs(model, ids, temperature=1.0, top_k=0):
    """log p(x_t | x_<t) of one unpadded sequence from a plain forward pass (NaN at t = 0)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.tensor([math.nan]), lp])


def template_corpus() -> list[str]:
    """Names of every original chat template TRL ships (its ``chat_templates`` folder, without ``*_training``)."""
    import glob
    import os

    import trl

    folder = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
    files = glob.glob(os.path.join(folder, "*.jinja"))
    return sorted(os.path.basename(f)[: -len(".jinja")] for f in files if not f.endswith("_training.jinja"))


@functools.cache
def corpus_tokenizer(name: str):
    """SmolLM2's real tokenizer with TRL's template ``name`` and its markers (as ``chatenv check --template``)."""
    import os

    import trl

    from chatenv.models import load_default_tokenizer
    from chatenv.templates.derive import tokenizer_for_template

    path = os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{name}.jinja")
    with open(path, encoding="utf-8") as f:
        return tokenizer_for_template(f.read(), load_default_tokenizer())


#: a vLLM engine small enough for this machine's tests (eager, 1024 tokens, 64 MiB of KV cache)
VLLM_ENGINE = {"enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 16, "kv_cache_memory_bytes": 64 << 20}


def async_vllm_policy(model_dir, **options):
    """A VLLMWrapper on vLLM's async engine (AsyncLLM) for the saved model in ``model_dir`` (call ``shutdown()``)."""
    import os

    os.environ.setdefault(
        "VLLM_CACHE_ROOT", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".scratch", "vllm")
    )
    from wrappers.policies import VLLMWrapper

    return VLLMWrapper(str(model_dir), async_engine=True, engine_kwargs=VLLM_ENGINE, **options)


#: the venv of each released third-party client the compatibility tests run (made by `make clients`)
CLIENT_VENVS = ("openenv", "verifiers03", "verifiers04", "inspect", "agents")


def client_python(name: str) -> str:
    """The Python of the released client ``name``'s own venv (``make clients`` installs each; their pins conflict).

    The compatibility tests run those clients unmodified, as programs of their own, against servers on loopback.
    """
    import os

    if name not in CLIENT_VENVS:
        raise ValueError(f"no client venv {name!r}; expected one of {CLIENT_VENVS}")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    python = os.path.join(root, ".venv-clients", name, "bin", "python")
    if not os.path.exists(python):
        raise FileNotFoundError(f"{python} is missing: run `make clients` (make test does) to install {name}'s client")
    return python


def run_client(name: str, script: str, *args: str, timeout: float = 300, env: dict | None = None):
    """Run ``script`` (Python source) with client ``name``'s venv; returns the completed process (check=True).

    The child gets a clean environment (no proxies; offline hubs), the given ``env`` on top.
    """
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    base.update({"NO_PROXY": "*", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    base.pop("PYTHONPATH", None)
    base.update(env or {})
    done = subprocess.run(
        [client_python(name), "-c", script, *args], capture_output=True, text=True, timeout=timeout, env=base
    )
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        raise AssertionError(f"{name} client failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return done


def stable_id(value: object) -> str:
    """A parametrize id from ``repr(value)`` without memory addresses, the same in every process (pytest-xdist
    workers must collect identical test names)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
