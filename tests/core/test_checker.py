"""chatenv.check over every registered env and mode, with a policy, and on envs that break the rules."""

import gymnasium as gym
import numpy as np
import pytest

import chatenv
from chatenv import ChatEnv, EnvCheckError, check
from chatenv.cli import main
from chatenv.envs import ENVS
from chatenv.envs.buffer import TokenBuffer
from wrappers.policies import TransformersWrapper

CASES = [(e, m) for e in ENVS if not e.startswith("chatenv/Token") for m in ("history", "text", "tokens")] + [
    (e, None) for e in ENVS if e.startswith("chatenv/Token")
]


@pytest.mark.parametrize("env_id,mode", CASES)
def test_every_registered_env_passes(env_id, mode):
    kwargs = {} if mode is None else {"input_mode": mode}
    report = check(lambda: gym.make(env_id, **kwargs))
    assert report.ok and len(report.results) == 8
    assert report.results[-1].name == "fork_is_exact_and_independent"


@pytest.mark.parametrize("mode", ["history", "text", "tokens"])
def test_policy_checks(mode, tiny_model, tokenizer):
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode=mode, generate_kwargs={"max_new_tokens": 8, "seed": 0}
    )
    report = check(lambda: ChatEnv("arithmetic", input_mode=mode), policy)
    names = [r.name for r in report.results]
    assert names[-3:] == ["policy_prompt_response_full", "policy_masks", "policy_log_probs_match_scoring"]
    assert report.ok


class LeakyEnv(ChatEnv):
    """Breaks the transaction rule: counts a turn before checking the action."""

    def step(self, action):
        self.episode.turn += 1
        return super().step(action)


class DriftingEnv(ChatEnv):
    """Breaks TITO: re-tokenizes its observation from decoded text after every step."""

    def step(self, action):
        out = super().step(action)
        ep = self.episode
        text = self.chat_tokenizer.decode(ep.token_ids.tolist()).replace("\n", " \n")
        ids = self.tokenizer.encode(text)
        ep.chat._tokens = TokenBuffer(ids, [False] * len(ids))  # noqa: SLF001 - deliberately corrupting the env
        return (np.asarray(ids), *out[1:])


def test_broken_envs_fail_with_the_rule_they_break():
    report = check(lambda: LeakyEnv("arithmetic", input_mode="tokens"), raise_on_failure=False)
    assert [r.name for r in report.failures()] == ["failed_step_changes_nothing"]
    report = check(lambda: DriftingEnv("arithmetic", input_mode="tokens"), raise_on_failure=False)
    failed = {r.name for r in report.failures()}
    assert {"tito_equals_full_render", "next_turn_opens_assistant"} <= failed
    with pytest.raises(EnvCheckError, match="FAIL  tito_equals_full_render"):
        check(lambda: DriftingEnv("arithmetic", input_mode="tokens"))


def test_an_env_without_a_spec_needs_a_factory():
    with pytest.raises(TypeError, match="pass its id or a factory"):
        check(ChatEnv("arithmetic"))
    assert check(gym.make("chatenv/Arithmetic-v0", input_mode="text")).ok


def test_cli_check(capsys):
    assert main(["check", "chatenv/GuessNumber-v0", "--input-mode", "tokens"]) == 0
    out = capsys.readouterr().out
    assert "chatenv check: chatenv/GuessNumber-v0 (input_mode=tokens)" in out and "FAIL" not in out
    assert main(["check", "chatenv/Nope-v0"]) == 2
    assert chatenv.check is check
