"""Drive chat envs with a batched policy and collect the transitions as one TensorDict.

:func:`rollout` takes one env, a list of envs, or a Gymnasium vector env, and a policy wrapper (anything with
the :class:`wrappers.policies.LLMWrapperBase` interface). Each round calls the policy once for every env that
is mid-episode, then steps those envs; envs in a list are stepped from a thread pool, so a slow task (a reward
that calls a judge, a sleeping tool) does not hold up the others more than the turn barrier requires.

The result has one row per transition, ordered by episode then turn, in TorchRL's layout:

- ``tokens`` / ``masks`` / ``log_probs``: the policy's containers for the turn (prompt = the observation,
  response = the generated ids), plus ``text`` or ``history`` in those input modes;
- ``("next", "reward")``, ``("next", "done")``, ``("next", "terminated")``, ``("next", "truncated")``: ``(N, 1)``;
- ``("next", "reward_components", name)``: ``(N, 1)``, NaN where a turn did not report that component;
- ``episode``, ``turn``, ``env_index``: ``(N,)`` int64 bookkeeping;
- with KL env wrappers (``wrappers.kl``): ``ref_log_probs`` and ``kl`` (shaped like ``log_probs``, NaN on the
  prompt) and ``("next", "task_reward")``; ``("next", "reward")`` is then the penalised reward.

Actions are :class:`~chatenv.envs.ScoredAction` objects (ids + generation log-probs), so KL wrappers reuse the
policy's log-probs. When envs in a list share one reference model (``RefLogProbs(env, ref)`` with the same
``ref``), its log-probs are computed in one batched forward per round and handed to every env.

In tokens mode the policy's prompt is the env's observation verbatim and the assistant mask of earlier turns is
carried along, so masks mark every generated token of the episode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorStack, TensorDict

from chatenv.actions import ScoredAction

__all__ = ["rollout"]


@dataclass
class _Transition:
    episode: int
    turn: int
    env_index: int
    prompt: list[int]
    response: list[int]
    assistant: list[bool]
    log_probs: list[float]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    components: dict[str, float] = field(default_factory=dict)
    prompt_text: str | None = None
    response_text: str | None = None
    prompt_chat: list[dict] | None = None
    reply: list[dict] | None = None
    ref_log_probs: list[float] | None = None
    kl: list[float] | None = None
    task_reward: float | None = None


@dataclass
class _Slot:
    """One env's episode in progress."""

    obs: Any = None
    episode: int = -1
    turn: int = 0
    assistant: list[bool] | None = None  # tokens mode: assistant mask of obs
    active: bool = False


def rollout(
    env: Any,
    policy: Any,
    *,
    episodes: int | None = None,
    steps: int | None = None,
    seed: int | None = None,
    max_workers: int | None = None,
    ref_model: Any = None,
) -> TensorDict:
    """Run episodes (or a number of transitions) and return every transition.

    Args:
        env: A :class:`~chatenv.envs.ChatEnv` (or a wrapper of one), a list of them, or a Gymnasium vector env.
        policy: A generating policy wrapper whose ``input_mode`` matches the envs'.
        episodes: Complete this many episodes (no more are started).
        steps: Or collect this many transitions (episodes in progress at the end are left unfinished).
        seed: Seed of the first reset (env i gets ``seed + i``; later resets continue each env's generator).
        max_workers: Threads stepping a list of envs (default: one per env).
        ref_model: A reference model (``log_probs(sequences)``) whose log-probs of each turn's generated tokens
            are computed here, in one batch per round, and handed to the envs' KL wrappers with the actions. Use
            it with vector envs whose sub-envs are wrapped as ``KLPenalty(RefLogProbs(env), ...)`` (no model in
            the env processes). Without it, envs in a list that share a ``RefLogProbs`` reference are batched
            the same way automatically.

    Returns:
        A TensorDict of batch ``(N,)``, one row per transition.
    """
    if (episodes is None) == (steps is None):
        raise ValueError("give exactly one of episodes=... or steps=...")
    limit = episodes if episodes is not None else steps
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"episodes/steps must be a positive int, got {limit!r}")
    if not getattr(policy, "generate", False):
        raise ValueError("rollout needs a generating policy (generate=True)")
    if getattr(policy, "num_samples", None) is not None:
        raise ValueError("rollout samples one reply per observation; use a policy without num_samples")
    import gymnasium as gym

    if isinstance(env, gym.vector.VectorEnv):
        runner = _VectorRunner(env)
    else:
        envs = list(env) if isinstance(env, Sequence) else [env]
        if not envs:
            raise ValueError("no envs given")
        runner = _ListRunner(envs, max_workers)
    mode = runner.input_mode
    if mode != policy.input_mode:
        raise ValueError(f"the envs use input_mode={mode!r} but the policy {policy.input_mode!r}; make them match")
    try:
        transitions = _collect(runner, policy, episodes, steps, seed, ref_model)
    finally:
        runner.shutdown()
    transitions.sort(key=lambda t: (t.episode, t.turn))
    return _to_tensordict(transitions, policy, mode)


# ------------------------------------------------------------------------------------------- env runners


class _ListRunner:
    def __init__(self, envs: list, max_workers: int | None):
        self.envs = envs
        modes = {getattr(e.unwrapped, "input_mode", None) for e in envs}
        if len(modes) != 1 or None in modes:
            raise ValueError(f"all envs must be chat envs with the same input_mode, got {modes}")
        self.input_mode = modes.pop()
        self.n = len(envs)
        self.pool = ThreadPoolExecutor(max_workers=max_workers or self.n) if self.n > 1 else None

    def reset(self, i: int, seed: int | None) -> Any:
        obs, _ = self.envs[i].reset(seed=seed)
        return obs

    def step(self, actions: dict[int, Any]) -> dict[int, tuple]:
        if self.pool is None:
            return {i: self.envs[i].step(a) for i, a in actions.items()}
        futures = {i: self.pool.submit(self.envs[i].step, a) for i, a in actions.items()}
        return {i: f.result() for i, f in futures.items()}

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


class _VectorRunner:
    """A Gymnasium vector env: steps all sub-envs together, handling its autoreset mode."""

    def __init__(self, venv: Any):
        import gymnasium as gym

        self.venv = venv
        self.n = venv.num_envs
        mode = venv.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        if mode not in (gym.vector.AutoresetMode.NEXT_STEP, gym.vector.AutoresetMode.SAME_STEP):
            raise ValueError(f"rollout supports vector envs with NEXT_STEP or SAME_STEP autoreset, got {mode}")
        self.same_step = mode == gym.vector.AutoresetMode.SAME_STEP
        self.input_mode = venv.get_attr("input_mode")[0]
        self.pending_reset = [False] * self.n
        self._eot = None

    def reset_all(self, seed: int | None) -> list:
        obs, _ = self.venv.reset(seed=seed)
        return list(obs)

    def step(self, actions: dict[int, Any]) -> tuple[dict[int, tuple], dict[int, Any]]:
        """Step with actions for some envs; the others get a placeholder reply (their step is discarded)."""
        filler = ScoredAction(np.array([self._filler_id()], dtype=np.int64), placeholder=True)
        full = tuple(actions.get(i, filler) for i in range(self.n))
        obs, reward, terminated, truncated, info = self.venv.step(full)
        results, reset_obs = {}, {}
        for i in range(self.n):
            if self.pending_reset[i]:
                reset_obs[i] = obs[i]  # NEXT_STEP: this step was the reset
                self.pending_reset[i] = False
                continue
            done = bool(terminated[i] or truncated[i])
            results[i] = (obs[i], float(reward[i]), bool(terminated[i]), bool(truncated[i]), _info_row(info, i))
            if done:
                if self.same_step:
                    reset_obs[i] = obs[i]
                else:
                    self.pending_reset[i] = True
        return results, reset_obs

    def _filler_id(self) -> int:
        if self._eot is None:
            tok = self.venv.get_attr("chat_tokenizer")[0]
            self._eot = tok.end_of_turn_ids[0]
        return self._eot

    def shutdown(self) -> None:
        pass


def _info_row(info: dict, i: int) -> dict:
    out = {}
    for k, v in info.items():
        if k.startswith("_"):
            continue
        if isinstance(v, dict):
            out[k] = _info_row(v, i)
        elif isinstance(v, np.ndarray) and v.ndim >= 1:
            mask = info.get(f"_{k}")
            if mask is None or bool(mask[i]):
                item = v[i]
                out[k] = item.item() if isinstance(item, np.ndarray) and item.ndim == 0 else item
                if isinstance(out[k], np.generic):
                    out[k] = out[k].item()
    return out


# ------------------------------------------------------------------------------------------- collection


def _collect(
    runner: Any, policy: Any, episodes: int | None, steps: int | None, seed: int | None, ref_model: Any
) -> list:
    n = runner.n
    slots = [_Slot() for _ in range(n)]
    transitions: list[_Transition] = []
    started = 0
    finished = 0
    vector = isinstance(runner, _VectorRunner)

    def begin(i: int, obs: Any) -> None:
        nonlocal started
        if episodes is not None and started >= episodes:
            slots[i].active = False
            return
        slots[i] = _Slot(obs=obs, episode=started, turn=0, active=True)
        if runner.input_mode == "tokens":
            slots[i].assistant = [False] * len(obs)
        started += 1

    if vector:
        for i, obs in enumerate(runner.reset_all(seed)):
            begin(i, obs)
    else:
        for i in range(n):
            if episodes is not None and i >= episodes:
                break
            begin(i, runner.reset(i, None if seed is None else seed + i))

    while True:
        if steps is not None and len(transitions) >= steps:
            break
        active = [i for i in range(n) if slots[i].active]
        if not active:
            if vector and any(runner.pending_reset) and (episodes is None or started < episodes):
                # NEXT_STEP envs reset on their next step: take it with placeholder replies only
                _, reset_obs = runner.step({})
                for i, obs in reset_obs.items():
                    begin(i, obs)
                continue
            break
        if steps is not None:
            active = active[: steps - len(transitions)]
        out = policy(_policy_input(policy, [slots[i] for i in active], runner.input_mode))
        rows = _rows(out, policy, runner.input_mode, len(active))
        actions = {}
        for k, i in enumerate(active):
            row = rows[k]
            lp = row["log_probs"][len(row["prompt"]) :] if row["log_probs"] is not None else None
            actions[i] = ScoredAction(
                np.asarray(row["response"], dtype=np.int64), None if lp is None else np.asarray(lp, np.float32)
            )
        _batched_reference(runner, active, rows, actions, ref_model)
        if vector:
            results, reset_obs = runner.step(actions)
        else:
            results, reset_obs = runner.step(actions), {}
        for k, i in enumerate(active):
            slot, row = slots[i], rows[k]
            obs, reward, terminated, truncated, info = results[i]
            transitions.append(
                _Transition(
                    episode=slot.episode,
                    turn=slot.turn,
                    env_index=i,
                    prompt=row["prompt"],
                    response=row["response"],
                    assistant=row["assistant"],
                    log_probs=row["log_probs"],
                    reward=reward,
                    terminated=terminated,
                    truncated=truncated,
                    components=dict(info.get("reward_components", {}) or {}),
                    prompt_text=row.get("prompt_text"),
                    response_text=row.get("response_text"),
                    prompt_chat=row.get("prompt_chat"),
                    reply=row.get("reply"),
                    ref_log_probs=_list(info.get("ref_log_probs")),
                    kl=_list(info.get("kl")),
                    task_reward=info.get("task_reward"),
                )
            )
            if terminated or truncated:
                finished += 1
                slot.active = False
                if not vector and (episodes is None or started < episodes):
                    begin(i, runner.reset(i, None))
            else:
                if runner.input_mode == "tokens":
                    grown = len(obs) - len(slot.obs) - len(row["response"])
                    slot.assistant = slot.assistant + [True] * len(row["response"]) + [False] * grown
                slot.obs = obs
                slot.turn += 1
        for i, obs in reset_obs.items():
            if not slots[i].active:
                begin(i, obs)
        if episodes is not None and finished >= episodes:
            break
    return transitions


def _list(values: Any) -> list[float] | None:
    return None if values is None else np.asarray(values, dtype=np.float32).reshape(-1).tolist()


def _reference_of(env: Any) -> Any:
    """The reference model of a ``RefLogProbs`` wrapper in ``env``'s wrapper chain (found by duck typing)."""
    while env is not None:
        if type(env).__name__ == "RefLogProbs" and hasattr(env, "ref_model"):
            return env.ref_model
        env = getattr(env, "env", None)
    return None


def _batched_reference(
    runner: Any, active: list[int], rows: list[dict], actions: dict[int, Any], ref_model: Any = None
) -> None:
    """One reference forward per round for all envs that share a reference model (or for all, with ``ref_model``)."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    if ref_model is not None:
        groups[id(ref_model)] = (ref_model, list(range(len(active))))
    else:
        envs = runner.envs if isinstance(runner, _ListRunner) else getattr(runner.venv, "envs", None)
        if envs is None:  # sub-envs in other processes: they compute their own (or pass ref_model=...)
            return
        for k, i in enumerate(active):
            ref = _reference_of(envs[i])
            if ref is not None:
                groups.setdefault(id(ref), (ref, []))[1].append(k)
    for ref, ks in groups.values():
        seqs = [rows[k]["prompt"] + rows[k]["response"] for k in ks]
        for k, lp in zip(ks, ref.log_probs(seqs)):
            n = len(rows[k]["prompt"])
            actions[active[k]].ref_log_probs = lp[n:].numpy()


def _policy_input(policy: Any, slots: list[_Slot], mode: str) -> TensorDict:
    from chatenv.containers import Masks, Tokens
    from chatenv.history import History

    b = len(slots)
    td = TensorDict(batch_size=[b])
    key = policy.input_key
    if mode == "history":
        td.set(key, History.from_chats([list(s.obs) for s in slots]))
    elif mode == "text":
        td.set(key, NonTensorStack.from_list([s.obs for s in slots]))
    else:
        ids = [torch.as_tensor(np.asarray(s.obs), dtype=torch.long) for s in slots]
        tokens = Tokens.from_sequences(ids, padded=True, pad_value=policy.pad_token_id)
        td.set(key[0] if isinstance(key, tuple) else key, tokens)
        masks = Masks.from_tokens(tokens, [torch.tensor(s.assistant, dtype=torch.bool) for s in slots])
        if getattr(policy, "masks_key", None) is not None:
            td.set(policy.masks_key, masks)
    return td


def _rows(out: TensorDict, policy: Any, mode: str, n: int) -> list[dict]:
    """Per-row plain values of a policy output, each container unpacked once."""
    tokens = out.get(policy.tokens_key)
    parts = {p: tokens.unpadded(p) for p in ("prompt", "response")}
    assistant = (
        [m.tolist() for m in out.get(policy.masks_key).unpadded()] if policy.masks_key is not None else [None] * n
    )
    lps = out.get(policy.log_probs_key, None) if policy.log_probs_key is not None else None
    lp_parts = {p: lps.unpadded(p) for p in ("prompt", "response")} if lps is not None else None
    texts = out.get(policy.text_key) if mode in ("text", "history") and policy.text_key is not None else None
    hist = out.get(policy.history_key) if mode == "history" and policy.history_key is not None else None
    prompt_text = list(texts.prompt) if texts is not None else None
    response_text = list(texts.response) if texts is not None else None
    prompt_chats = hist.prompt.to_chats() if hist is not None else None
    replies = hist.response.to_chats() if hist is not None else None
    rows = []
    for b in range(n):
        row = {
            "prompt": parts["prompt"][b].tolist(),
            "response": parts["response"][b].tolist(),
            "assistant": assistant[b],
            "log_probs": (lp_parts["prompt"][b].tolist() + lp_parts["response"][b].tolist()) if lp_parts else None,
        }
        if texts is not None:
            row["prompt_text"], row["response_text"] = prompt_text[b], response_text[b]
        if hist is not None:
            row["prompt_chat"] = [m for m in prompt_chats[b] if m]
            row["reply"] = [m for m in replies[b] if m]
        rows.append(row)
    return rows


def _to_tensordict(transitions: list[_Transition], policy: Any, mode: str) -> TensorDict:
    from chatenv.containers import ChatHistory, LogProbs, Masks, Text, Tokens
    from chatenv.history import History

    n = len(transitions)
    padded = bool(getattr(policy, "pad_output", True))
    prompts = [torch.tensor(t.prompt, dtype=torch.long) for t in transitions]
    responses = [torch.tensor(t.response, dtype=torch.long) for t in transitions]
    tokens = Tokens.from_sequences(prompts, responses, padded=padded, pad_value=policy.pad_token_id)
    td = TensorDict(batch_size=[n])
    td.set(policy.tokens_key, tokens)
    if transitions and transitions[0].assistant is not None:
        td.set(
            policy.masks_key,
            Masks.from_tokens(tokens, [torch.tensor(t.assistant, dtype=torch.bool) for t in transitions]),
        )
    if transitions and transitions[0].log_probs is not None:
        lp_prompt = [torch.tensor(t.log_probs[: len(t.prompt)], dtype=torch.float32) for t in transitions]
        lp_resp = [torch.tensor(t.log_probs[len(t.prompt) :], dtype=torch.float32) for t in transitions]
        td.set(policy.log_probs_key, LogProbs.from_sequences(lp_prompt, lp_resp, padded=padded))
    if mode in ("text", "history") and transitions and transitions[0].prompt_text is not None:
        p = [t.prompt_text for t in transitions]
        r = [t.response_text for t in transitions]
        td.set(
            policy.text_key,
            Text(
                prompt=NonTensorStack.from_list(p),
                response=NonTensorStack.from_list(r),
                full=NonTensorStack.from_list([a + b for a, b in zip(p, r)]),
                batch_size=[n],
            ),
        )
    if mode == "history" and transitions and transitions[0].prompt_chat is not None:
        td.set(
            policy.history_key,
            ChatHistory(
                prompt=History.from_chats([t.prompt_chat for t in transitions]),
                response=History.from_chats([t.reply for t in transitions]),
                full=History.from_chats([t.prompt_chat + t.reply for t in transitions]),
                batch_size=[n],
            ),
        )
    for key, field_name in (("ref_log_probs", "ref_log_probs"), ("kl", "kl")):
        if transitions and all(getattr(t, field_name) is not None for t in transitions):
            td.set(
                key,
                LogProbs.from_sequences(
                    [torch.full((len(t.prompt),), math.nan) for t in transitions],
                    [torch.tensor(getattr(t, field_name), dtype=torch.float32) for t in transitions],
                    padded=padded,
                ),
            )
    col = lambda values, dtype: torch.tensor(values, dtype=dtype).reshape(n, 1)  # noqa: E731
    if transitions and all(t.task_reward is not None for t in transitions):
        td.set(("next", "task_reward"), col([t.task_reward for t in transitions], torch.float32))
    td.set(("next", "reward"), col([t.reward for t in transitions], torch.float32))
    td.set(("next", "terminated"), col([t.terminated for t in transitions], torch.bool))
    td.set(("next", "truncated"), col([t.truncated for t in transitions], torch.bool))
    td.set(("next", "done"), col([t.terminated or t.truncated for t in transitions], torch.bool))
    names = sorted({k for t in transitions for k in t.components})
    for name in names:
        td.set(
            ("next", "reward_components", name),
            col([t.components.get(name, math.nan) for t in transitions], torch.float32),
        )
    td.set("episode", torch.tensor([t.episode for t in transitions], dtype=torch.long))
    td.set("turn", torch.tensor([t.turn for t in transitions], dtype=torch.long))
    td.set("env_index", torch.tensor([t.env_index for t in transitions], dtype=torch.long))
    return td
