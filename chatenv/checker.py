"""``chatenv.check``: what an LLM environment must guarantee, checked on a live env (and optionally a policy).

Gymnasium's ``check_env`` checks the API; an LLM env must also keep its token view exact. :func:`check` runs:

- ``gymnasium_check_env``: Gymnasium's checker on the unwrapped env, with no warnings;
- ``same_seed_same_episode``: resetting with a seed and replaying the same replies gives the same episode;
- ``next_turn_opens_assistant``: every observation ends with the header of a new assistant turn;
- ``tito_equals_full_render``: after canonical replies, the kept ids equal a full render of the chat, and the
  assistant mask equals the template's (replies and their end-of-turn tokens only);
- ``control_strings_are_content``: text that spells the template's control tokens, in user, tool and assistant
  messages, stays content: the chat's special-token skeleton does not change and the reply is kept verbatim;
- ``roles_cannot_forge_turns``: a role carrying markup is refused;
- ``failed_step_changes_nothing``: a step that raises leaves the env as it was, and the next valid step equals a
  fresh env's;
- with a policy: ``policy_prompt_response_full``, ``policy_masks``, ``policy_log_probs_match_scoring``.

The scripted env checks live in :mod:`chatenv.env_checks`; the policy checks, the report and the entry point
here. ``chatenv check ENV_ID`` runs it from the command line.
"""

from __future__ import annotations

import math
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import gymnasium as gym

from chatenv.env_checks import (
    Env,
    attr,
    check_control_strings,
    check_failed_steps,
    check_fork,
    check_gymnasium,
    check_opens_assistant,
    check_roles,
    check_seeding,
    check_tito,
)
from chatenv.errors import ChatEnvError

__all__ = ["CheckReport", "CheckResult", "CheckedPolicy", "EnvCheckError", "check"]

#: Task state passed with ``reset(options={"messages": ...})`` so the built-in tasks accept a given chat.
DEFAULT_TASK_OPTIONS: dict[str, Any] = {"answer": 1, "secret": 1}


class EnvCheckError(ChatEnvError, AssertionError):
    """An env failed :func:`check`; the message lists every failed check."""


class CheckedPolicy(Protocol):
    """What :func:`check` uses of a policy: a generating policy wrapper that can also score its own output."""

    @property
    def input_mode(self) -> str: ...  # noqa: D102
    @property
    def input_key(self) -> Any: ...  # noqa: D102
    @property
    def pad_token_id(self) -> int: ...  # noqa: D102
    @property
    def tokens_key(self) -> Any: ...  # noqa: D102
    @property
    def masks_key(self) -> Any: ...  # noqa: D102

    def __call__(self, tensordict: Any) -> Any:
        """Generate: the policy's output TensorDict (prompt, response, masks, log-probs)."""

    def log_prob(self, tensordict: Any) -> Any:
        """Score a policy output again: its ``log_probs`` as the scoring pass computes them."""


@dataclass
class CheckResult:
    """One check's outcome (``applies=False``: a chat check on an env that is not a chat env; not a failure)."""

    name: str
    passed: bool
    detail: str = ""
    applies: bool = True


@dataclass
class CheckReport:
    """Every check's outcome for one env."""

    env: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every check passed."""
        return all(r.passed for r in self.results)

    def failures(self) -> list[CheckResult]:
        """The checks that failed."""
        return [r for r in self.results if not r.passed]

    def __str__(self) -> str:
        width = max((len(r.name) for r in self.results), default=0)
        lines = [f"chatenv check: {self.env}"]
        mark = {True: "ok  ", False: "FAIL"}
        lines += [
            f"  {mark[r.passed] if r.applies else 'n/a '}  {r.name:<{width}}  {r.detail}".rstrip() for r in self.results
        ]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- policy checks


def _policy_turn(env: Env, policy: CheckedPolicy, obs: Any) -> tuple[Any, Any]:
    """One policy call on the env's observation and token view, as :func:`chatenv.rollout` makes it."""
    from chatenv.modes import get_mode

    td = get_mode(policy.input_mode).policy_input(
        [obs],
        input_key=policy.input_key,
        pad_token_id=policy.pad_token_id,
        token_views=[attr(env, "token_view")()],
        tokens_key=policy.tokens_key,
        masks_key=policy.masks_key,
    )
    return td, policy(td)


def _check_policy(env: Env, policy: CheckedPolicy, seed: int, atol: float, turns: int = 2) -> list[CheckResult]:
    from chatenv.actions import ScoredAction

    obs, _ = env.reset(seed=seed)
    problems: dict[str, str] = {}
    worst = 0.0
    for _ in range(turns):
        before, mask_before = attr(env, "token_view")()
        _, out = _policy_turn(env, policy, obs)
        prompt, response = (out["tokens"].unpadded(p)[0] for p in ("prompt", "response"))
        if prompt.tolist() != before.tolist():
            problems.setdefault("policy_prompt_response_full", "the policy's prompt is not the env's ids")
        assistant = out["masks"].unpadded()[0]
        if assistant[: len(prompt)].tolist() != mask_before.tolist() or not bool(assistant[len(prompt) :].all()):
            problems.setdefault("policy_masks", "masks mark tokens the assistant did not sample, or miss some")
        generated = out["log_probs"].unpadded("response")[0]
        scored = policy.log_prob(out)["log_probs"].unpadded("response")[0]
        worst = max(worst, float((generated - scored).abs().max()) if len(generated) else 0.0)
        obs, _, terminated, truncated, _ = env.step(ScoredAction(response.numpy(), generated.numpy()))
        kept = attr(env, "token_ids")[: len(prompt) + len(response)].tolist()
        if kept != prompt.tolist() + response.tolist():
            problems.setdefault("policy_prompt_response_full", "the env did not keep prompt + response verbatim")
        if terminated or truncated:
            break
    ok = math.isfinite(worst) and worst <= atol
    return [
        CheckResult(
            "policy_prompt_response_full",
            "policy_prompt_response_full" not in problems,
            problems.get("policy_prompt_response_full", "the env keeps the policy's ids verbatim"),
        ),
        CheckResult("policy_masks", "policy_masks" not in problems, problems.get("policy_masks", "")),
        CheckResult("policy_log_probs_match_scoring", ok, f"max |diff| {worst:.2e} (atol {atol:g})"),
    ]


# ---------------------------------------------------------------------------------------------- entry point


def _run(name: str, fn: Callable[[], str]) -> CheckResult:
    try:
        return CheckResult(name, True, fn())
    except Exception as e:  # a check that crashes has failed; say why
        where = traceback.extract_tb(e.__traceback__)[-1]
        return CheckResult(name, False, f"{type(e).__name__}: {e} ({where.name}:{where.lineno})"[:300])


def check(
    env: str | Env | Callable[[], Env],
    policy: CheckedPolicy | None = None,
    *,
    seed: int = 0,
    turns: int = 3,
    task_options: Mapping[str, Any] | None = None,
    atol: float = 1e-4,
    raise_on_failure: bool = True,
) -> CheckReport:
    """Check that a chat env (and optionally a policy on it) keeps what an LLM env must keep.

    Args:
        env: A registered env id, a zero-argument factory, or an env (its spec, if any, makes the fresh copy
            the transaction check compares with; otherwise pass a factory or an id).
        policy: A generating policy wrapper in the env's input mode (adds the policy checks).
        seed: Seed of the episodes played.
        turns: Replies per scripted episode.
        task_options: Task state sent with ``reset(options={"messages": ...})`` (default: what the built-in
            tasks need).
        atol: Tolerance between generation-time and scored log-probs.
        raise_on_failure: Raise :class:`EnvCheckError` listing the failures (else just return the report).

    Returns:
        The report (``print`` it for a table).

    Example:
        >>> print(check("chatenv/Arithmetic-v0").ok)
        True
    """
    fresh = _factory(env)
    subject = fresh() if not isinstance(env, gym.Env) else env
    options = dict(DEFAULT_TASK_OPTIONS if task_options is None else task_options)
    name = env if isinstance(env, str) else (getattr(subject.spec, "id", None) or type(subject.unwrapped).__name__)
    report = CheckReport(str(name))
    steps: list[tuple[str, Callable[[], str]]] = [
        ("gymnasium_check_env", lambda: check_gymnasium(subject, seed)),
        ("same_seed_same_episode", lambda: check_seeding(subject, seed, turns)),
        ("next_turn_opens_assistant", lambda: check_opens_assistant(subject, seed, turns)),
        ("tito_equals_full_render", lambda: check_tito(subject, seed, turns)),
        ("control_strings_are_content", lambda: check_control_strings(subject, seed, options)),
        ("roles_cannot_forge_turns", lambda: check_roles(subject, seed, options)),
        ("failed_step_changes_nothing", lambda: check_failed_steps(subject, fresh, seed)),
        ("fork_is_exact_and_independent", lambda: check_fork(subject, seed)),
    ]
    if not _is_chat_env(subject):  # e.g. a remote OpenEnv env: Gymnasium's checks apply, the chat ones cannot
        why = "not a chat env (no token view): this check does not apply"
        report.results = [_run(*steps[0])] + [CheckResult(n, True, why, applies=False) for n, _ in steps[1:]]
        if policy is not None:
            raise TypeError("check(env, policy): the policy checks need a chat env (one with a token view)")
    else:
        report.results = [_run(n, fn) for n, fn in steps]
    if policy is not None and _is_chat_env(subject):
        try:
            report.results += _check_policy(subject, policy, seed, atol)
        except Exception as e:
            report.results.append(CheckResult("policy", False, f"{type(e).__name__}: {e}"[:300]))
    if subject is not env:
        subject.close()
    if raise_on_failure and not report.ok:
        raise EnvCheckError(str(report))
    return report


def _is_chat_env(env: Env) -> bool:
    """Whether ``env`` is a chat env (it, or a wrapper of it, has a token view); the chat checks need one."""
    try:
        attr(env, "token_view")
    except AttributeError:
        return False
    return True


def _factory(env: str | Env | Callable[[], Env]) -> Callable[[], Env]:
    if isinstance(env, str):
        return lambda: gym.make(env)
    if isinstance(env, gym.Env):
        spec = env.spec
        if spec is None:
            raise TypeError(
                "check(env) needs a fresh copy of the env to compare with: pass its id or a factory "
                "(lambda: MyEnv(...)) instead of an env made without gymnasium.make"
            )
        return lambda: gym.make(spec)
    if callable(env):
        return env
    raise TypeError(f"expected an env id, an env or a factory, got {type(env).__name__}")
