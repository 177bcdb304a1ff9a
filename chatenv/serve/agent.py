"""Agent programs as episodes: :class:`AgentEnv` runs one against the capture endpoint, a task scores it.

An agent is a Python callable ``agent(base_url, messages)`` or a command (a list of arguments, or a string split
like a shell would). It gets an OpenAI base URL that records everything in the episode's own session, and the
task's opening messages (a command reads them as JSON on stdin and in ``CHATENV_MESSAGES``; ``OPENAI_BASE_URL`` and
``OPENAI_API_KEY`` are set, so an unmodified ``openai`` client finds the endpoint). When the agent returns, the
task answers the final chat (its last reply) once: that is the episode's reward, ``terminated`` if the task is done
and ``truncated`` otherwise; rewards the agent posted to its session are added (component ``agent``).

:func:`agent_rollout` runs episodes of a list of such envs against one endpoint, concurrently (their requests share
policy calls), and returns the same TensorDict as :func:`chatenv.rollout` with the same policy: one row per reply,
one episode per segment (an agent that rewrote its history has one more segment per divergence; earlier segments
end ``truncated``), plus ``run`` and ``segment`` columns.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shlex
import subprocess
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from chatenv.envs.state import open_chat
from chatenv.errors import AgentError
from chatenv.messages import check_messages
from chatenv.protocols import OutputLayout, layout_of
from chatenv.rollout.assemble import assemble
from chatenv.rollout.collect import Transition
from chatenv.rollout.plan import EpisodePlan
from chatenv.serve.trajectory import Outcome, session_transitions
from chatenv.tasks import Task, TaskResponse, get_task

__all__ = ["AgentEnv", "AgentError", "agent_rollout"]


class AgentEnv:
    """One agent program, run for one episode at a time and scored by a task.

    Args:
        agent: ``agent(base_url, messages) -> Any``, or a command (list of arguments or a string).
        task: A :class:`~chatenv.tasks.Task` or registered task name that draws openings and scores the final chat;
            None: openings come from ``reset(options={"messages": [...]})`` and only posted rewards count.
        task_kwargs: Arguments for a task given by name.
        timeout: Seconds a command may run (callables are not interrupted).
        env: Extra environment variables for a command.
    """

    def __init__(
        self,
        agent: Callable[[str, list[dict[str, Any]]], Any] | Sequence[str] | str,
        task: str | Task | None = None,
        *,
        task_kwargs: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
    ):
        if not callable(agent) and not isinstance(agent, (str, Sequence)):
            raise TypeError(f"agent must be a callable or a command, got {type(agent).__name__}")
        self.agent = shlex.split(agent) if isinstance(agent, str) else agent
        if not callable(self.agent) and not self.agent:
            raise ValueError("the agent command is empty")
        self.task = None if task is None else get_task(task, **dict(task_kwargs or {}))
        self.timeout, self.env = timeout, dict(env or {})
        self.np_random = np.random.default_rng()
        self.messages: list[dict[str, Any]] = []
        self.state: Any = None

    def reset(self, seed: int | None = None, options: Any = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Draw the next episode's opening (the task's, or ``options["messages"]``); returns ``(messages, info)``."""
        if seed is not None:
            self.np_random = np.random.default_rng(seed)
        self.messages, self.state = open_chat(self.task, self.np_random, options)
        return [dict(m) for m in self.messages], {}

    def run(self, base_url: str) -> Any:
        """Run the agent on the current opening against ``base_url``; returns what it returned (a command's stdout).

        Raises:
            AgentError: If a command exits with a non-zero status or runs past ``timeout``.
        """
        messages = [dict(m) for m in self.messages]
        if callable(self.agent):
            return self.agent(base_url, messages)
        text = json.dumps(messages, ensure_ascii=False)
        env = {**os.environ, **self.env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "chatenv"}
        env["CHATENV_MESSAGES"] = text
        try:
            proc = subprocess.run(
                list(self.agent), input=text, env=env, capture_output=True, text=True, timeout=self.timeout
            )
        except subprocess.TimeoutExpired as e:
            raise AgentError(f"the agent command ran past {self.timeout} s: {self.agent}") from e
        if proc.returncode != 0:
            raise AgentError(f"the agent command exited with status {proc.returncode}: {proc.stderr[-2000:]}")
        return proc.stdout

    def score(self, snapshot: Mapping[str, Any]) -> Outcome:
        """How the episode ended: the task's answer to the final chat plus the rewards posted to the session.

        Raises:
            AgentError: If the agent made no request.
        """
        segments = [s for s in snapshot["segments"] if s["turns"]]
        if not segments:
            raise AgentError("the agent made no chat-completions request in its session")
        chat = [dict(m) for m in segments[-1]["messages"]]
        posted = dict(snapshot.get("rewards") or {})
        extra = float(sum(posted.values()))
        if self.task is None:
            info: dict[str, Any] = {"reward_components": {"agent": extra}} if posted else {}
            return Outcome(extra, True, False, {**info, "chat": chat})
        response = self.task.respond(chat, copy.deepcopy(self.state))
        if not isinstance(response, TaskResponse) or not math.isfinite(float(response.reward)):
            raise TypeError(f"{type(self.task).__name__}.respond must return a TaskResponse with a finite reward")
        components = {k: float(v) for k, v in dict(response.components).items()}
        if posted:
            components["agent"] = extra
        new = check_messages(response.messages, f"{type(self.task).__name__}.respond() messages", allow_empty=True)
        info = {"reward_components": components, "task_info": dict(response.info), "chat": chat + new}
        done = bool(response.done)
        return Outcome(float(response.reward) + extra, done, not done, info)

    def close(self) -> None:
        """Nothing to release (the endpoint belongs to whoever started it)."""


#: a finished run: the env index that ran it, its session snapshot, and how it ended
_Done = tuple[int, dict[str, Any], Outcome]


def _episode(env: AgentEnv, server: Any, seed: int | None, tag: str) -> tuple[dict[str, Any], Outcome]:
    session = f"{tag}-{uuid.uuid4().hex[:12]}"
    env.reset(seed=seed)
    env.run(server.base_url(session))
    try:
        snapshot = server.session(session)
    except KeyError:
        raise AgentError("the agent made no chat-completions request in its session") from None
    return snapshot, env.score(snapshot)


def _run_all(envs: list[AgentEnv], server: Any, plan: EpisodePlan) -> dict[int, _Done]:
    """Every run, env ``i`` taking runs ``i, i + E, ...`` (a reproducible assignment); the first failure stops them.

    Each run resets with the plan's seed (:meth:`~chatenv.rollout.plan.EpisodePlan.seed_of`). Returns
    ``{run: (env index, snapshot, outcome)}``; a failure is re-raised with ``err.completed`` holding the runs
    finished before.
    """
    done: dict[int, _Done] = {}
    failures: list[BaseException] = []

    def work(i: int) -> None:
        for k in range(i, plan.episodes or 0, len(envs)):
            if failures:
                return
            try:
                snapshot, outcome = _episode(envs[i], server, plan.seed_of(k, i, k == i), f"run{k}")
            except BaseException as e:  # handed to the caller's thread
                failures.append(e)
                return
            done[k] = (i, snapshot, outcome)

    threads = [threading.Thread(target=work, args=(i,), name=f"chatenv-agent-{i}") for i in range(len(envs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        failures[0].completed = done  # type: ignore[attr-defined]
        raise failures[0]
    return done


def _assemble(done: dict[int, _Done], layout: OutputLayout, decode: Any, plan: EpisodePlan) -> TensorDict:
    transitions: list[Transition] = []
    runs: list[int] = []
    segments: list[int] = []
    episode = 0
    for k in sorted(done):
        i, snapshot, outcome = done[k]
        group = plan.group(k) if plan.group_size else 0
        rows = session_transitions(snapshot, outcome, first_episode=episode, env_index=i, group=group, decode=decode)
        transitions += rows
        runs += [k] * len(rows)
        segments += [t.episode - episode for t in rows]
        episode += len({t.episode for t in rows})
    td = assemble(transitions, layout, groups=plan.group_size is not None)
    td.set("run", torch.tensor(runs, dtype=torch.long))
    td.set("segment", torch.tensor(segments, dtype=torch.long))
    return td


def agent_rollout(
    envs: AgentEnv | Sequence[AgentEnv],
    policy: Any = None,
    *,
    episodes: int,
    seed: int | None = None,
    group_size: int | None = None,
    server: Any = None,
) -> TensorDict:
    """Run ``episodes`` agent episodes and return their transitions in :func:`chatenv.rollout`'s layout.

    Args:
        envs: One :class:`AgentEnv` or several, run concurrently: env ``i`` runs episodes ``i, i + E, ...``.
        policy: The policy to serve (a :class:`~chatenv.serve.CaptureServer` on a free loopback port is started
            and stopped here), unless ``server`` is given.
        episodes: Runs to complete.
        seed: As :func:`chatenv.rollout`: env ``i`` first resets with ``seed + i``, later resets continue its
            generator; with groups, run ``k`` resets with ``seed + k // group_size``.
        group_size: Runs in groups of this many from the same reset (a ``group`` column).
        server: A running :class:`~chatenv.serve.CaptureServer` to use instead.

    Raises:
        BaseException: What stopped a run (the agent's error, :class:`AgentError`), with ``err.partial``: the
            TensorDict of the runs completed before.
    """
    from chatenv.serve.server import CaptureServer

    envs = [envs] if isinstance(envs, AgentEnv) else list(envs)
    if not envs or not all(isinstance(e, AgentEnv) for e in envs):
        raise TypeError("envs must be an AgentEnv or a non-empty list of them")
    plan = EpisodePlan.make(episodes=episodes, seed=seed, group_size=group_size).drawn()  # a group shares its opening
    if (policy is None) == (server is None):
        raise ValueError("give the policy to serve, or a running server=, not both")
    own = server is None
    server = CaptureServer(policy).start() if own else server
    decode = server.service.chat_tokenizer(None).decode

    layout = layout_of(server.service.policy)
    try:
        done = _run_all(envs, server, plan)
    except BaseException as e:
        e.partial = _assemble(getattr(e, "completed", {}), layout, decode, plan)  # type: ignore[attr-defined]
        raise
    finally:
        if own:
            server.stop()
    return _assemble(done, layout, decode, plan)
