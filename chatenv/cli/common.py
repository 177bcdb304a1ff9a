"""What the commands that run a model share: the model's path, its sampling settings, the policy and the reference.

``chatenv rollout``, ``chatenv train`` and ``chatenv serve`` build their policies here (:func:`build_policy`): a
``TransformersWrapper``, or with ``--backend vllm`` a ``VLLMWrapper`` with the CLI's engine defaults
(:func:`engine_kwargs`). Their sampling flags become one :class:`~chatenv.sampling.GenerationSettings`
(:func:`generation_settings`), checked by the core and refused in the flags' own names (:func:`settings_problem`).
``rollout`` and ``train`` run under :class:`StopSignals`: SIGTERM stops them as Ctrl-C does, what was collected is
kept, and the exit code (130, 143) says which signal stopped them. ``--task-kwargs`` is read by :func:`task_kwargs`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from chatenv.sampling import GenerationSettings, SettingError, normalize_generate_kwargs

__all__ = [
    "DEFAULT_MODEL",
    "EASY_ARITHMETIC",
    "ENGINE_CONTEXT",
    "StopSignals",
    "add_model_arguments",
    "build_policy",
    "engine_kwargs",
    "generation_settings",
    "model_path",
    "reference_model",
    "settings_problem",
    "task_kwargs",
]

#: the task options ``chatenv train`` and ``chatenv eval`` use for ``chatenv/Arithmetic-v0`` unless ``--task-kwargs``
#: says otherwise: one-digit additions, two tries
EASY_ARITHMETIC: dict[str, Any] = {"max_operand": 9, "operations": ["+"], "max_attempts": 2}

#: the ``--model`` value naming the embedded SmolLM2-135M-Instruct
DEFAULT_MODEL = "default"

#: the context a vLLM engine gets unless the command sets one (at most the model's): a modest context keeps the KV
#: cache small on CPUs
ENGINE_CONTEXT = 4096

#: the flags that set generation settings, by setting
_FLAGS = {"max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "seed": "--seed"}


def add_model_arguments(parser: argparse.ArgumentParser, *, backends: bool = True) -> None:
    """Add ``--model`` (and with ``backends``, ``--backend`` and ``--engine-memory``) to a command's parser."""
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"'{DEFAULT_MODEL}' (embedded SmolLM2-135M-Instruct) or a model path"
    )
    if backends:
        parser.add_argument("--backend", choices=("transformers", "vllm"), default="transformers")
        parser.add_argument(
            "--engine-memory", type=float, default=1.0, help="vLLM KV-cache memory in GiB (--backend vllm; default 1)"
        )


def model_path(model: str) -> str:
    """``--model`` as a path: ``"default"`` is the embedded SmolLM2's folder (converted on first use)."""
    if model == DEFAULT_MODEL:
        from chatenv.models import default_model_path

        return str(default_model_path())
    return model


def generation_settings(args: argparse.Namespace) -> GenerationSettings:
    """The command's sampling flags (``--max-new-tokens``, ``--temperature``, ``--seed``) as the policy's settings.

    Raises:
        SettingError: For a value the settings refuse, worded with the flag's name.
    """
    given = {name: getattr(args, name) for name in _FLAGS if getattr(args, name, None) is not None}
    try:
        return normalize_generate_kwargs(given)
    except SettingError as e:
        raise e.renamed(_FLAGS.get(e.setting or "", "")) from None


def settings_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the sampling flags (``"--temperature must be ..."``), or None."""
    try:
        generation_settings(args)
    except SettingError as e:
        return str(e)
    return None


def engine_kwargs(path: str, memory_gib: float, max_num_seqs: int, context: int | None = None) -> dict[str, Any]:
    """The vLLM engine's arguments: CPU-safe defaults (no graph capture, a bounded KV cache, a modest context).

    Args:
        path: The model's folder.
        memory_gib: KV-cache memory (``--engine-memory``).
        max_num_seqs: The most sequences per engine step (the envs stepped together, a server's batch).
        context: The context length (default: the model's, at most :data:`ENGINE_CONTEXT`).
    """
    return {
        "enforce_eager": True,
        "kv_cache_memory_bytes": int(memory_gib * (1 << 30)),
        "max_model_len": context or _context_length(path, ENGINE_CONTEXT),
        "max_num_seqs": max(max_num_seqs, 1),
    }


def _context_length(path: str, cap: int) -> int:
    """The model's context length, at most ``cap``."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(path).get_text_config(), "max_position_embeddings", None)
    return min(cap, int(limit)) if limit else cap


def build_policy(
    args: argparse.Namespace,
    *,
    model: str | None = None,
    input_mode: str = "tokens",
    max_num_seqs: int = 1,
    context: int | None = None,
    async_engine: bool = False,
) -> Any:
    """The command's policy, sampling as its flags say (:func:`generation_settings`).

    Args:
        args: The parsed arguments (``--model``, the sampling flags; ``--backend`` and ``--engine-memory`` where the
            command has them).
        model: The model to load instead of ``--model`` (a run's saved weights).
        input_mode: The policy's input mode.
        max_num_seqs: vLLM: the most sequences per engine step.
        context: vLLM: the context length (see :func:`engine_kwargs`).
        async_engine: vLLM: run vLLM's async engine.

    Returns:
        A ``TransformersWrapper``, or with ``--backend vllm`` a ``VLLMWrapper``.
    """
    settings = generation_settings(args)
    path = model_path(model or args.model)
    if getattr(args, "backend", "transformers") == "vllm":
        from wrappers.policies import VLLMWrapper

        engine = engine_kwargs(path, args.engine_memory, max_num_seqs, context)
        return VLLMWrapper(
            path, input_mode=input_mode, generate_kwargs=settings, engine_kwargs=engine, async_engine=async_engine
        )
    from wrappers.policies import TransformersWrapper

    return TransformersWrapper(path, input_mode=input_mode, generate_kwargs=settings)


def reference_model(model: str, policy: Any, **kwargs: Any) -> Any:
    """A frozen copy of ``model`` scoring at the temperature of the log-probs ``policy`` reports.

    That is its sampling temperature, or 1 when it reports the model's own log-probs (greedy decoding,
    ``raw_log_probs``): a KL then compares distributions at the same temperature.

    Args:
        model: ``--model`` (``"default"`` or a path).
        policy: The policy whose replies the reference scores.
        **kwargs: Other arguments of ``wrappers.kl.ReferenceModel`` (``kv_cache_size``, ...).
    """
    from wrappers.kl import ReferenceModel
    from wrappers.policies.logits import reports_processed

    settings = policy.settings
    temperature = settings.temperature if reports_processed(settings, policy.raw_log_probs) else 1.0
    return ReferenceModel(model_path(model), temperature=temperature, **kwargs)


class StopSignals:
    """Within it, SIGTERM stops a run the way Ctrl-C does, and the run's exit code says which signal stopped it.

    Both raise ``KeyboardInterrupt`` where the run is, so what was collected is kept; the command then exits with
    ``128 + signal number``, as shells report a process a signal ended: 130 for SIGINT (Ctrl-C), 143 for SIGTERM.
    A scheduler can so tell a stopped run from a finished one (0) and from a failed one (1).

    Example:
        >>> with StopSignals() as stop:
        ...     stop.exit_code
        130
    """

    def __init__(self) -> None:
        self.signum = int(signal.SIGINT)  # a KeyboardInterrupt not raised by the SIGTERM handler is Ctrl-C's
        self.interrupted = False
        self._old: Any = None
        self._installed = False

    def __enter__(self) -> StopSignals:
        try:
            self._old = signal.signal(signal.SIGTERM, self._handler)
            self._installed = True
        except ValueError:  # not the main thread: leave signals alone
            pass
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._old)
            self._installed = False

    def _handler(self, signum: int, frame: Any) -> None:
        self.signum = signum
        raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        """``128 +`` the number of the signal that stopped the run (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum

    def report(self, kept: str) -> int:
        """Say on stderr that the run was interrupted, by what, and what was kept where; returns the exit code.

        Args:
            kept: What was saved and where (``"the 12 episodes collected so far are saved in runs/x"``).
        """
        self.interrupted = True
        name = signal.Signals(self.signum).name + (" (Ctrl-C)" if self.signum == signal.SIGINT else "")
        print(f"\ninterrupted by {name}: {kept}; exit code {self.exit_code}", file=sys.stderr, flush=True)
        return self.exit_code


def task_kwargs(text: str | None, env: str, *, easy_default: bool = True) -> dict[str, Any] | str:
    """``--task-kwargs`` as a dict of task options, or what is wrong with it (a str).

    Args:
        text: The flag's value (JSON object), or None when it was not given.
        env: The env id (the default depends on it).
        easy_default: Without the flag, ``chatenv/Arithmetic-v0`` gets :data:`EASY_ARITHMETIC` (``train``,
            ``eval``); otherwise, and for other envs, the task's own defaults (``{}``).

    Example:
        >>> task_kwargs('{"max_operand": 5}', "chatenv/Arithmetic-v0"), task_kwargs(None, "chatenv/Chat-v0")
        ({'max_operand': 5}, {})
        >>> task_kwargs("[1]", "chatenv/Arithmetic-v0")
        "--task-kwargs must be a JSON object, got '[1]'"
    """
    if text is None:
        return dict(EASY_ARITHMETIC) if easy_default and env == "chatenv/Arithmetic-v0" else {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"--task-kwargs is not valid JSON ({e.msg}): {text!r}"
    if not isinstance(value, dict):
        return f"--task-kwargs must be a JSON object, got {text!r}"
    return value
