"""The one episode record: built from a rollout, written as JSON, read back unchanged, and back to the episode view."""

import json

import pytest
import torch

import chatenv
from chatenv import ChatEnv, rollout
from chatenv.rollout.records import EpisodeRecord, episode_records, records_view
from wrappers.policies import TransformersWrapper

KEYS = {
    "episode",
    "env_index",
    "prompt",
    "completion",
    "assistant_mask",
    "log_probs",
    "turn_start",
    "response_tokens",
    "rewards",
    "task_rewards",
    "kl",
    "reward",
    "turns",
    "terminated",
    "truncated",
    "messages",
}


@pytest.fixture(scope="module")
def td(tiny_model, tokenizer):
    policy = TransformersWrapper(
        tiny_model, tokenizer=tokenizer, input_mode="history", generate_kwargs={"max_new_tokens": 6, "seed": 0}
    )
    envs = [ChatEnv("arithmetic", input_mode="history", max_turns=2) for _ in range(2)]
    return rollout(envs, policy, episodes=4, group_size=2, seed=3)


def test_records_round_trip_through_json(td):
    records = episode_records(td, success_threshold=1.0, group_offset=5)
    assert [r.episode for r in records] == [0, 1, 2, 3] and [r.group for r in records] == [5, 5, 6, 6]
    for record in records:
        row = json.loads(json.dumps(record.to_json()))
        assert KEYS | {"group", "policy_version", "success"} == set(row)
        assert row["turns"] == len(row["rewards"]) == len(row["turn_start"]) == len(row["response_tokens"])
        assert len(row["assistant_mask"]) == len(row["prompt"]) + len(row["completion"])
        assert row["reward"] == pytest.approx(sum(row["rewards"]))
        back = EpisodeRecord.from_json(json.dumps(row))
        assert back == record and back.to_json() == row
    renumbered = episode_records(td, first_episode=10)
    assert [r.episode for r in renumbered] == [10, 11, 12, 13] and renumbered[0].success is None


def test_records_give_back_the_episode_view(td):
    view = chatenv.episodes(td, pad_token_id=0)
    back = records_view([json.dumps(r.to_json()) for r in episode_records(td)])
    for key in ("turn_start", "turn_length", "num_turns", "terminated", "truncated", "episode"):
        assert torch.equal(back[key], view[key]), key
    torch.testing.assert_close(back["turn_reward"], view["turn_reward"], equal_nan=True)
    assert torch.equal(back["tokens"].full, view["tokens"].full)
    assert torch.equal(back["masks"].all_assistant_mask, view["masks"].all_assistant_mask)
    torch.testing.assert_close(back["log_probs"].full, view["log_probs"].full, equal_nan=True)


def test_unknown_keys_are_kept_and_missing_ones_refused(td):
    row = {**episode_records(td)[0].to_json(), "note": "kept"}
    assert EpisodeRecord.from_json(row).to_json() == row
    del row["rewards"]
    with pytest.raises(ValueError, match="needs"):
        EpisodeRecord.from_json(row)
    assert episode_records(None) == []


def test_a_line_without_some_keys_is_written_back_as_it_was(td):
    row = episode_records(td)[0].to_json()
    for key in ("env_index", "prompt", "completion", "assistant_mask", "log_probs", "turn_start"):
        del row[key]  # a line of an earlier writer, or of an episode without one token chain
    assert EpisodeRecord.from_json(row).to_json() == row
    old = {k: v for k, v in row.items() if k not in ("rewards", "turns", "response_tokens")}
    old.update(turn_reward=row["rewards"], num_turns=row["turns"], turn_length=row["response_tokens"])
    with pytest.raises(ValueError, match="earlier JSONL layout"):
        EpisodeRecord.from_json(old)


def test_an_episode_that_does_not_chain_loses_only_its_own_chain(td):
    broken = td.clone()
    first = (broken["episode"] == 0).nonzero().flatten()
    assert len(first) == 2  # two turns: make the second one start a new context segment
    broken["next", "segment"] = torch.zeros_like(broken["next", "reward"], dtype=torch.long)
    broken["next", "segment"][first[1]] = 1
    records = {r.episode: r for r in episode_records(broken)}
    assert records[0].prompt is None and "prompt" not in records[0].to_json()
    intact = {r.episode: r for r in episode_records(td)}
    for e in (1, 2, 3):
        assert records[e].prompt == intact[e].prompt and records[e].log_probs == intact[e].log_probs
