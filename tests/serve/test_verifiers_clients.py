"""verifiers' released token clients, unmodified, against the capture endpoint on loopback.

verifiers 0.3.1's token client (``/v1/chat/completions`` with ``return_token_ids``, then
``/v1/chat/completions/tokens`` with the ids it stitched through ``/tokenize``) and verifiers 0.4.0's train client
(``/inference/v1/generate``) each run two-turn episodes in their own venvs (drivers in ``clients/``). Each episode
must be one whole token-exact segment: its ids are the fresh render of the episode's chat, the assistant mask is on
exactly the sampled ids, and the log-probs the client got equal the recorded ones and a scoring forward pass.
"""

import json
import math
import os

import pytest
import torch
from helpers import reference_log_probs, run_client

from chatenv.serve import CaptureServer
from chatenv.tokenization import chat_tokenizer

torch.set_num_threads(1)

MODEL = "chatenv-policy"
CLIENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clients")


def _driver(name):
    with open(os.path.join(CLIENTS, name), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    from wrappers.policies import TransformersWrapper

    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 40}
    )
    with CaptureServer(policy) as srv:
        yield srv


def _check_episode(episode, segment, ct, tiny_model):
    """One episode = one whole token-exact segment."""
    last = episode["turns"][-1]
    ids = last["prompt_ids"] + last["completion_ids"]
    assert segment["ids"] == ids
    fresh = ct.encode(episode["chat"], add_generation_prompt=False).ids.tolist()
    assert fresh[: len(ids)] == ids and ct.decode(fresh[len(ids) :]).strip() == ""  # only the closing newline left
    mask = torch.tensor(segment["assistant_mask"])
    sampled = torch.zeros(len(ids), dtype=torch.bool)
    for turn, recorded in zip(episode["turns"], segment["turns"], strict=True):
        start = len(turn["prompt_ids"])
        assert recorded["start"] == start and recorded["length"] == len(turn["completion_ids"])
        assert ids[start : start + recorded["length"]] == turn["completion_ids"]
        sampled[start : start + recorded["length"]] = True
        got = segment["log_probs"][start : start + recorded["length"]]
        assert got == pytest.approx(turn["completion_logprobs"], abs=1e-6)
    assert torch.equal(mask, sampled)
    ref = reference_log_probs(tiny_model, ids)
    lps = torch.tensor([math.nan if v is None else v for v in segment["log_probs"]])
    assert torch.isnan(lps[~mask]).all()
    assert torch.allclose(lps[mask], ref[mask], atol=1e-4)


def _check_session(server, session, episodes, ct, tiny_model):
    segments = server.session(session)["segments"]
    assert len(segments) == len(episodes)
    by_ids = {tuple(s["ids"]): s for s in segments}
    for episode in episodes:
        last = episode["turns"][-1]
        segment = by_ids[tuple(last["prompt_ids"] + last["completion_ids"])]
        _check_episode(episode, segment, ct, tiny_model)


def _lines(done):
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_verifiers03_token_client_records_one_segment_per_episode(server, tokenizer, tiny_model):
    session = "v03"  # four episodes through one session URL at once (verifiers' max_concurrent)
    script = _driver("verifiers03_tokens.py")
    done = run_client("verifiers03", script, server.base_url(session), MODEL, "4", "4")
    rows = _lines(done)
    assert rows[-1] == {"fallbacks": 0}  # every second turn went through /v1/chat/completions/tokens
    episodes = rows[:-1]
    assert len(episodes) == 4 and all(e["error"] is None and len(e["turns"]) == 2 for e in episodes)
    _check_session(server, session, episodes, chat_tokenizer(tokenizer, None), tiny_model)


@pytest.mark.slow
def test_verifiers04_train_client_records_one_segment_per_episode(server, tokenizer, tiny_model, tiny_model_dir):
    session = "v04"  # every episode through one session URL, concurrently
    done = run_client(
        "verifiers04", _driver("verifiers04_generate.py"), server.base_url(session), MODEL, str(tiny_model_dir), "3"
    )
    episodes = _lines(done)
    assert len(episodes) == 3 and all(len(e["turns"]) == 2 for e in episodes)
    _check_session(server, session, episodes, chat_tokenizer(tokenizer, None), tiny_model)
