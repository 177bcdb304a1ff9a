"""The growing token view of an episode: appends are amortised O(new), views are independent copies."""

import numpy as np
import pytest

from chatenv import ChatEnv
from chatenv.envs.buffer import TokenBuffer


def test_appends_grow_past_the_capacity_and_keep_every_id():
    buf = TokenBuffer([1, 2, 3], [False, False, True], text="abc")
    expected_ids, expected_mask = [1, 2, 3], [False, False, True]
    for k in range(1000):
        ids = list(range(k % 7 + 1))
        buf.extend(ids, [k % 2 == 0] * len(ids), text=str(k))
        expected_ids += ids
        expected_mask += [k % 2 == 0] * len(ids)
    assert buf.ids().tolist() == expected_ids and buf.mask().tolist() == expected_mask
    assert buf.text == "abc" + "".join(str(k) for k in range(1000))
    assert buf.ids([9, 9]).tolist() == expected_ids + [9, 9] and buf.mask(2).tolist() == expected_mask + [True] * 2
    with pytest.raises(ValueError, match="differ in length"):
        buf.extend([1, 2], [True])
    with pytest.raises(RuntimeError, match="keeps no text view"):
        _ = TokenBuffer([1], [False]).text


def test_an_observation_is_the_callers_to_change(tokenizer):
    env = ChatEnv("arithmetic", input_mode="tokens", tokenizer=tokenizer, max_turns=5)
    obs, _ = env.reset(seed=0)
    kept = obs.copy()
    obs[:] = 0  # scribbling on an observation does not touch the episode
    assert np.array_equal(env.token_ids, kept)
    reply = env.chat_tokenizer.reply(env.messages, {"role": "assistant", "content": "12"}).ids.numpy()
    obs2, *_ = env.step(reply)
    assert np.array_equal(obs2[: len(kept)], kept) and np.array_equal(obs2[len(kept) : len(kept) + len(reply)], reply)
    full = env.chat_tokenizer.encode(env.messages, add_generation_prompt=True)
    assert np.array_equal(obs2, full.ids.numpy()) and np.array_equal(env.assistant_mask, full.assistant_mask.numpy())
