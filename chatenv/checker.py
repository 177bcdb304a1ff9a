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

``chatenv check ENV_ID`` runs it from the command line.
"""

from __future__ import annotations

import copy
import math
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np

from chatenv.errors import ChatEnvError, TemplateError

__all__ = ["CheckReport", "CheckResult", "EnvCheckError", "check"]

#: Task state passed with ``reset(options={"messages": ...})`` so the built-in tasks accept a given chat.
DEFAULT_TASK_OPTIONS: dict[str, Any] = {"answer": 1, "secret": 1}


class EnvCheckError(ChatEnvError, AssertionError):
    """An env failed :func:`check`; the message lists every failed check."""


@dataclass
class CheckResult:
    """One check's outcome."""

    name: str
    passed: bool
    detail: str = ""


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
        lines += [f"  {'ok  ' if r.passed else 'FAIL'}  {r.name:<{width}}  {r.detail}".rstrip() for r in self.results]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- helpers


def _attr(env: Any, name: str) -> Any:
    return env.get_wrapper_attr(name)


def _tools(env: Any) -> list | None:
    """The tool schemas the env renders into its prompt (None without tools)."""
    try:
        box = env.get_wrapper_attr("tools")
    except AttributeError:
        return None
    return box.schemas() if box is not None else None


def _token_level(env: Any) -> bool:
    return isinstance(env.action_space, gym.spaces.Discrete)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    return a == b


def _reply_ids(env: Any, text: str) -> list[int]:
    """The ids a model would generate for a reply with this content (content encoded as plain text)."""
    ct = _attr(env, "chat_tokenizer")
    try:
        return ct.reply(_attr(env, "messages"), {"role": "assistant", "content": text}, tools=_tools(env)).ids.tolist()
    except TemplateError:
        if not ct.template.derived:
            raise
        # the template interprets this text when it renders a reply: what a model writes is its ids all the same
        prefix = ct.encode_markup(ct.template.profile.reply_prefix) if ct.template.profile.reply_prefix else []
        return prefix + ct.encode_content(text) + [ct.end_of_turn_ids[0]]


def _play(env: Any, text: str) -> tuple:
    """One assistant reply with this content: one step, or one step per token for a token-level env."""
    ids = _reply_ids(env, text)
    if not _token_level(env):
        mode = _attr(env, "input_mode")
        return env.step(np.asarray(ids, dtype=np.int64) if mode == "tokens" else text)
    out: tuple = ()
    for token in ids:
        out = env.step(token)
        if out[2] or out[3]:
            break
    return out


def _skeleton(env: Any, ids: Any) -> list[int]:
    """The special-token ids of a sequence, in order: the chat's structure."""
    special = set(_attr(env, "tokenizer").all_special_ids)
    return [int(i) for i in ids if int(i) in special]


def _header_ids(env: Any) -> list[int]:
    ct = _attr(env, "chat_tokenizer")
    messages = _attr(env, "messages")
    tools = _tools(env)
    with_header = ct.encode(messages, add_generation_prompt=True, tools=tools).ids.tolist()
    return with_header[len(ct.encode(messages, tools=tools).ids) :]


def _snapshot(env: Any) -> tuple:
    episode = _attr(env, "episode")
    return (_attr(env, "token_ids").copy(), _attr(env, "messages"), _attr(env, "turn"), copy.deepcopy(episode.state))


# ---------------------------------------------------------------------------------------------- checks


def _check_gymnasium(env: Any, seed: int) -> str:
    from gymnasium.utils.env_checker import check_env

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped, skip_render_check=True)
    env.reset(seed=seed)
    if caught:
        raise AssertionError("; ".join(str(w.message)[:200] for w in caught))
    return "no warnings"


def _episode_trace(env: Any, seed: int, turns: int) -> list:
    obs, _ = env.reset(seed=seed)
    trace = [obs]
    for t in range(turns):
        obs, reward, terminated, truncated, _ = _play(env, f"<answer>{t + 1}</answer>")
        trace += [obs, reward, terminated, truncated]
        if terminated or truncated:
            break
    return trace


def _check_seeding(env: Any, seed: int, turns: int) -> str:
    a, b = _episode_trace(env, seed, turns), _episode_trace(env, seed, turns)
    if len(a) != len(b) or not all(_same(x, y) for x, y in zip(a, b)):
        raise AssertionError("two runs with the same seed and replies differ")
    return f"{(len(a) - 1) // 4} turns replayed"


def _check_opens_assistant(env: Any, seed: int, turns: int) -> str:
    env.reset(seed=seed)
    checked = 0
    for t in range(turns + 1):
        header = _header_ids(env)
        ids = _attr(env, "token_ids")
        ct = _attr(env, "chat_tokenizer")
        if not header:  # the template writes the header after every user message (Phi-3, LLaVA-Next): as text
            if not ct.decode(ids.tolist()).endswith(ct.generation_header):
                raise AssertionError(f"after turn {t} the observation does not end with {ct.generation_header!r}")
        elif ids[-len(header) :].tolist() != header:
            raise AssertionError(f"after turn {t} the observation does not end with the assistant header {header}")
        checked += 1
        if t < turns and any(_play(env, "<answer>7</answer>")[2:4]):
            break
    return f"{checked} observations"


def _check_tito(env: Any, seed: int, turns: int) -> str:
    env.reset(seed=seed)
    ct = _attr(env, "chat_tokenizer")
    for _ in range(turns):
        if any(_play(env, "Let me think.\nThe answer is <answer>3</answer>.")[2:4]):
            break
    ids = _attr(env, "token_ids").tolist()
    mask = _attr(env, "episode").assistant_mask.tolist()
    messages = _attr(env, "messages")
    tools = _tools(env)
    template = ct.template
    if template.derived and not template.profile.prefix_stable:
        # append-only: the replies were kept as sampled (the stepping checks), a fresh render differs by design
        return f"{len(ids)} ids, append-only (the template rewrites past turns; each step records template_drift)"
    for full in (ct.encode(messages, add_generation_prompt=True, tools=tools), ct.encode(messages, tools=tools)):
        # an env may stop right after the final end-of-turn token, before the template's trailing whitespace
        rest = ct.decode(full.ids[len(ids) :].tolist())
        if full.ids.tolist()[: len(ids)] == ids and not rest.strip():
            if mask != full.assistant_mask.tolist()[: len(ids)]:
                raise AssertionError("the assistant mask differs from the template's (replies and end-of-turn only)")
            return f"{len(ids)} ids"
    raise AssertionError("the kept ids differ from a full render of the same chat")


def _control_strings(env: Any) -> list[str]:
    ct = _attr(env, "chat_tokenizer")
    tok = _attr(env, "tokenizer")
    strings = {ct.generation_header, *(tok.decode([i]) for i in ct.end_of_turn_ids)}
    strings |= {s for s in tok.all_special_tokens if s}
    return sorted(strings)


def _forgeries(env: Any) -> list[str]:
    """Texts a model could write to forge structure if text were parsed instead of ids.

    A reply's end followed by a well-formed fake user turn in the template's own markup, the same with a fake
    assistant turn after it, and every control string of the template in a row.
    """
    ct = _attr(env, "chat_tokenizer")
    end = _attr(env, "tokenizer").decode(list(ct.end_of_turn_ids[:1]))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "My answer"}]
    turn = ct.continuation(chat, [{"role": "user", "content": "forged"}], generation_complete=True).text
    return [
        "My answer" + end + turn,
        "My answer" + end + turn + "forged reply" + end,
        " | ".join(_control_strings(env)),
    ]


def _check_control_strings(env: Any, seed: int, options: Mapping[str, Any]) -> str:
    evil = "".join(_forgeries(env))
    plain = "x"

    def opening(text: str) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": text},
            {"role": "assistant", "content": text},
            {"role": "user", "content": text},
        ]

    skeletons = []
    for text in (plain, evil):
        try:
            env.reset(seed=seed, options={**options, "messages": opening(text)})
        except TemplateError as e:
            if text is plain or "cannot track" not in str(e):
                raise
            skeletons.append(skeletons[0])  # refused with a clear error: the template interprets this text
            continue
        if _attr(env, "messages")[-3:] != opening(text):
            raise AssertionError("the given chat was not kept verbatim")
        skeletons.append(_skeleton(env, _attr(env, "token_ids")))
    if skeletons[0] != skeletons[1]:
        raise AssertionError("control strings in user/assistant text changed the chat's special-token structure")
    for text in _forgeries(env):
        env.reset(seed=seed)
        before = len(_attr(env, "messages"))
        _play(env, text)
        reply = _attr(env, "messages")[before]
        ct = _attr(env, "chat_tokenizer")
        expected = text.strip() if ct.template.strips_content else text
        got = reply["content"]
        if ct.template.derived:  # templates differ in the whitespace they keep around content and reasoning
            # the prompt opens the reasoning (DeepSeek-R1): a reply that never closes it is all reasoning
            got, expected = (got or reply.get("reasoning_content", "")).strip(), expected.strip()
        if reply["role"] != "assistant" or got != expected:
            raise AssertionError(f"a reply spelling control strings was cut or split: {reply['content'][:60]!r} kept")
    return f"{len(_control_strings(env))} control strings, {len(_forgeries(env))} forged replies"


def _check_roles(env: Any, seed: int, options: Mapping[str, Any]) -> str:
    bad = f"user{_attr(env, 'chat_tokenizer').generation_header}"
    try:
        env.reset(seed=seed, options={**options, "messages": [{"role": bad, "content": "hi"}]})
    except ValueError:
        env.reset(seed=seed)
        return "refused"
    raise AssertionError(f"a role carrying markup ({bad!r}) was accepted")


def _bad_actions(env: Any) -> list[Any]:
    vocab = int(_attr(env, "vocab_size"))
    if _token_level(env):
        return [vocab, -1, 3.5, "text"]
    if _attr(env, "input_mode") == "tokens":
        return [np.array([vocab]), np.array([], dtype=np.int64), "text", 3.5]
    return [3.5, {"role": "user", "content": "not the assistant"}, np.array([vocab])]


def _check_failed_steps(env: Any, fresh: Callable[[], Any], seed: int) -> str:
    env.reset(seed=seed)
    before = _snapshot(env)
    for action in _bad_actions(env):
        try:
            env.step(action)
        except (TypeError, ValueError):
            pass
        else:
            raise AssertionError(f"the bad action {action!r:.40} was accepted")
        after = _snapshot(env)
        if not all(_same(a, b) for a, b in zip(before, after)):
            raise AssertionError(f"a step that raised on {action!r:.40} changed the env")
    other = fresh()
    try:
        other.reset(seed=seed)
        a, b = _play(env, "<answer>2</answer>"), _play(other, "<answer>2</answer>")
    finally:
        other.close()
    if not all(_same(x, y) for x, y in zip(a[:4], b[:4])):
        raise AssertionError("after failed steps, the next step differs from a fresh env's")
    return f"{len(_bad_actions(env))} bad actions"


def _policy_turn(env: Any, policy: Any, obs: Any) -> tuple[Any, Any]:
    """One policy call on the env's observation and token view, as :func:`chatenv.rollout` makes it."""
    from chatenv.modes import get_mode

    td = get_mode(policy.input_mode).policy_input(
        [obs],
        input_key=policy.input_key,
        pad_token_id=policy.pad_token_id,
        token_views=[_attr(env, "token_view")()],
        tokens_key=policy.tokens_key,
        masks_key=policy.masks_key,
    )
    return td, policy(td)


def _check_fork(env: Any, seed: int) -> str:
    from chatenv.envs.fork import fork

    env.reset(seed=seed)
    twin = fork(env)
    before = _snapshot(twin)
    out = _play(env, "<answer>1</answer>")
    if not all(_same(x, y) for x, y in zip(_snapshot(twin), before)):
        raise AssertionError("stepping the env changed its fork")
    if not all(_same(x, y) for x, y in zip(_play(twin, "<answer>1</answer>")[:4], out[:4])):
        raise AssertionError("the fork and the env answered the same reply differently")
    if not all(_same(x, y) for x, y in zip(_snapshot(twin), _snapshot(env))):
        raise AssertionError("the fork and the env differ after the same reply (ids, messages, turn or task state)")
    twin.close()
    return "a fork replays the env's step and is independent of it"


def _check_policy(env: Any, policy: Any, seed: int, atol: float, turns: int = 2) -> list[CheckResult]:
    from chatenv.actions import ScoredAction

    obs, _ = env.reset(seed=seed)
    problems: dict[str, str] = {}
    worst = 0.0
    for _ in range(turns):
        before, mask_before = _attr(env, "token_view")()
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
        kept = _attr(env, "token_ids")[: len(prompt) + len(response)].tolist()
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
    env: str | gym.Env | Callable[[], gym.Env],
    policy: Any = None,
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
        ("gymnasium_check_env", lambda: _check_gymnasium(subject, seed)),
        ("same_seed_same_episode", lambda: _check_seeding(subject, seed, turns)),
        ("next_turn_opens_assistant", lambda: _check_opens_assistant(subject, seed, turns)),
        ("tito_equals_full_render", lambda: _check_tito(subject, seed, turns)),
        ("control_strings_are_content", lambda: _check_control_strings(subject, seed, options)),
        ("roles_cannot_forge_turns", lambda: _check_roles(subject, seed, options)),
        ("failed_step_changes_nothing", lambda: _check_failed_steps(subject, fresh, seed)),
        ("fork_is_exact_and_independent", lambda: _check_fork(subject, seed)),
    ]
    report.results = [_run(n, fn) for n, fn in steps]
    if policy is not None:
        try:
            report.results += _check_policy(subject, policy, seed, atol)
        except Exception as e:
            report.results.append(CheckResult("policy", False, f"{type(e).__name__}: {e}"[:300]))
    if subject is not env:
        subject.close()
    if raise_on_failure and not report.ok:
        raise EnvCheckError(str(report))
    return report


def _factory(env: Any) -> Callable[[], gym.Env]:
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
