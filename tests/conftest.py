import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

torch.set_num_threads(1)

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (pad == eos == <|im_end|>)."""
    from chatenv.models import load_default_tokenizer

    return load_default_tokenizer()


@pytest.fixture(scope="session")
def llama3_tokenizer(tokenizer):
    """SmolLM2's tokenizer with Llama-3's control tokens added as special tokens."""
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIALS})
    return tok


@pytest.fixture(scope="session")
def template_tokenizers(tokenizer, llama3_tokenizer):
    """A tokenizer for each registered template whose control strings are single special tokens."""
    return {"chatml": tokenizer, "qwen2.5": tokenizer, "llama3": llama3_tokenizer}


@pytest.fixture(scope="session")
def smollm2():
    from chatenv.models import load_default_model

    return load_default_model()
