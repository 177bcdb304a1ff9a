"""The env server's sessions and what each call does with one: one env per session, LRU eviction.

:class:`EnvService` is what the HTTP routes and the WebSocket both call: ``reset``, ``step``, ``state``, ``fork``
and ``delete`` on a session, each returning a JSON-ready dict or raising :class:`~chatenv.errors.APIError` with the
status and code the client maps back to an exception (:mod:`chatenv.envserver.wire`). Actions and observations
have OpenEnv's shapes (:mod:`chatenv.envserver.protocol`). A session is created by its first reset (a WebSocket
connection's own session, by :meth:`EnvService.open`); when ``max_sessions`` are open, the least recently used idle
one is closed, and a later request for it gets 409 ``session_evicted``. With several API keys each key (its
``scope``, an int; None with one key or none) has its own sessions, under the one session-scope rule of
:mod:`chatenv.web`: another key's session is unknown to reads (``state``, ``fork`` from it, ``delete``, listing:
404) and refused to what would create or change it (``reset``, ``step``, ``fork`` onto its id: 403
``session_forbidden``). One call runs on a session at a time; a call arriving while another holds the session is
answered 409 ``session_busy`` at once (no thread waits for the session), so a client sends its calls one after
another. A call that an env refuses (a bad action, a step after the episode ended) leaves the env as it was: the
envs validate before they commit.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from chatenv.envs.fork import fork
from chatenv.envserver.protocol import observation_dict, parse_action
from chatenv.envserver.wire import ERRORS, error_code, space_spec, to_json
from chatenv.errors import APIError
from chatenv.web import scope_refusal

__all__ = ["EnvService", "Session", "env_info"]

#: evicted session ids remembered (for their 409), oldest forgotten first
_REMEMBERED = 65536


@dataclass
class Session:
    """One client's env, its lock (one call at a time) and counters."""

    id: str
    env: Any
    scope: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0
    steps: int = 0
    episodes: int = 0
    episode_id: str | None = None
    closed: bool = False


def _refused(code: str, message: str, param: str | None = None) -> APIError:
    return APIError(message, status=ERRORS[code][0], code=code, param=param)


def env_info(env: Any, env_id: str, env_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """What ``GET /info`` says of the served env: id, kwargs, kind, spaces, tokenizer, template and tools."""
    from chatenv.envs.base import shared_default_tokenizer
    from chatenv.templates import get_template

    unwrapped = env.unwrapped
    template = unwrapped.chat_tokenizer.template
    try:
        registered = bool(template.name) and get_template(template.name).source == template.source
    except (KeyError, TypeError):
        registered = False
    tools = unwrapped.tools
    return {
        "env_id": env_id,
        "env_kwargs": to_json(dict(env_kwargs)),
        "kind": type(unwrapped).__name__,
        "input_mode": str(env.get_wrapper_attr("input_mode")),
        "vocab_size": int(unwrapped.vocab_size),
        "observation_space": space_spec(env.observation_space),
        "action_space": space_spec(env.action_space),
        "tokenizer": {
            "name_or_path": str(getattr(unwrapped.tokenizer, "name_or_path", "")),
            "embedded": unwrapped.tokenizer is shared_default_tokenizer(),
        },
        "template": template.name if registered else None,
        "tools": None if tools is None else to_json(tools.schemas()),
    }


class EnvService:
    """Sessions of one env id, each with its own env (see the module docstring).

    Args:
        make_env: Builds a fresh env (what ``gymnasium.make(env_id, **env_kwargs)`` gives).
        info: What ``GET /info`` answers.
        max_sessions: Most open sessions; the least recently used idle one is closed for a new one.
    """

    def __init__(self, make_env: Callable[[], Any], info: dict[str, Any], *, max_sessions: int = 64):
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {max_sessions!r}")
        self.make_env, self.info, self.max_sessions = make_env, info, max_sessions
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._evicted: collections.OrderedDict[str, int | None] = collections.OrderedDict()  # id -> its scope
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def ids(self, scope: int | None = None) -> list[str]:
        """The open sessions of ``scope`` (an API key's), least recently used first."""
        with self._lock:
            return [sid for sid, s in self._sessions.items() if s.scope == scope]

    # ------------------------------------------------------------------------------------------ sessions

    def _admit(self, sid: str, scope: int | None, env: Any) -> tuple[Session, list[Session]]:
        """Add a session (the pool lock held), choosing the idle sessions to close to make room."""
        if len(self._sessions) >= self.max_sessions and not any(s.users == 0 for s in self._sessions.values()):
            raise _refused("too_many_sessions", f"all {self.max_sessions} sessions are busy; retry later")
        gone: list[Session] = []
        while len(self._sessions) >= self.max_sessions:
            victim = next(s for s in self._sessions.values() if s.users == 0)
            del self._sessions[victim.id]
            self._evicted[victim.id] = victim.scope
            gone.append(victim)
        while len(self._evicted) > _REMEMBERED:
            self._evicted.popitem(last=False)
        self._evicted.pop(sid, None)
        session = self._sessions[sid] = Session(sid, env, scope, users=1)
        return session, gone

    def _find(self, sid: str, scope: int | None, *, create: bool, change: bool) -> Session | None:
        """The session (the pool lock held); None when missing and ``create``. Applies the session-scope rule.

        Raises:
            APIError: 403 for another key's session when ``change``; 404 (another key's, unknown) or 409
                (evicted) when it is missing and not ``create``.
        """
        session = self._sessions.get(sid)
        theirs = session is not None and session.scope != scope
        theirs = theirs or (session is None and sid in self._evicted and self._evicted[sid] != scope)
        if theirs and change:
            raise scope_refusal(sid)
        if session is not None and not theirs:
            return session
        if not theirs and sid in self._evicted and not create:
            raise _refused(
                "session_evicted",
                f"session {sid!r} was closed to make room for newer ones (max_sessions={self.max_sessions}); "
                "reset to start a new session",
                "session",
            )
        if theirs or not create:
            raise _refused("session_not_found", f"no session {sid!r}; a reset creates it", "session")
        return None

    @contextlib.contextmanager
    def _use(self, sid: str, scope: int | None, *, create: bool = False, change: bool = False) -> Iterator[Session]:
        """The session, counted as in use (never evicted meanwhile) and locked; ``create``: made if missing.

        Raises:
            APIError: 404/409 for a missing or evicted session, 403 for another key's session when the call would
                change it (``change``), 409 ``session_busy`` while another call holds it.
        """
        gone: list[Session] = []
        with self._lock:
            session = self._find(sid, scope, create=create, change=change or create)
            if session is None:
                session, gone = self._admit(sid, scope, None)
            else:
                session.users += 1
                self._sessions.move_to_end(sid)
        for old in gone:
            _close(old)
        try:
            if not session.lock.acquire(blocking=False):
                raise _refused("session_busy", f"session {sid!r} is running another call; send one at a time")
            try:
                if session.closed:  # deleted while this request waited for it
                    raise _refused("session_not_found", f"session {sid!r} was closed", "session")
                if session.env is None:
                    session.env = self.make_env()
                yield session
            finally:
                session.lock.release()
        finally:
            with self._lock:
                session.users -= 1

    def open(self, sid: str, scope: int | None = None) -> None:
        """Open a new session ``sid`` now (a WebSocket connection's own; its env is made by its first call).

        It is never evicted: it stays until :meth:`discard` (the connection ended) or a ``delete``.

        Raises:
            APIError: 503 ``too_many_sessions`` when every session is busy or held by a connection; 400 if ``sid``
                is taken.
        """
        with self._lock:
            if sid in self._sessions:
                raise _refused("invalid_request", f"session {sid!r} exists already", "session")
            _, gone = self._admit(sid, scope, None)  # counted as in use (users=1) until discarded
        for old in gone:
            _close(old)

    def close(self) -> None:
        """Close every session's env."""
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), collections.OrderedDict()
        for session in sessions:
            _close(session)

    # ------------------------------------------------------------------------------------------ calls

    def reset(self, sid: str, body: Any, scope: int | None = None) -> dict[str, Any]:
        """Start an episode in the session (made if new): ``{"seed": int?, "options": {...}?, "episode_id": str?}``.

        ``episode_id`` (OpenEnv's) names the episode in :meth:`state` (default ``"<session>:<n>"``).
        """
        seed, options, episode_id = _reset_args(body)
        with self._use(sid, scope, create=True) as session:
            obs, info = _call(session.env.reset, seed=seed, options=options)
            session.steps, session.episodes = 0, session.episodes + 1
            session.episode_id = episode_id or f"{sid}:{session.episodes}"
            return {
                "observation": observation_dict(to_json(obs), self.info),
                "reward": None,
                "done": False,
                "terminated": False,
                "truncated": False,
                "info": to_json(info),
                "session_id": sid,
            }

    def step(self, sid: str, action: Any, scope: int | None = None) -> dict[str, Any]:
        """One step of the session's env with an OpenEnv action object (read by :func:`.protocol.parse_action`).

        A non-finite reward travels as :func:`~chatenv.envserver.wire.to_json` writes it (``"nan"``, ``"inf"``,
        ``"-inf"``: standard JSON, which ``float()`` reads back).
        """
        with self._use(sid, scope, change=True) as session:
            obs, reward, terminated, truncated, info = _call(session.env.step, parse_action(action, self.info))
            session.steps += 1
            return {
                "observation": observation_dict(to_json(obs), self.info),
                "reward": to_json(float(reward)),
                "done": bool(terminated or truncated),
                "terminated": bool(terminated),
                "truncated": bool(truncated),
                "info": to_json(info),
            }

    def state(self, sid: str, scope: int | None = None) -> dict[str, Any]:
        """The session's episode: OpenEnv's ``episode_id`` and ``step_count``, ids, assistant mask, messages, turn."""
        with self._use(sid, scope) as session:
            env = session.env
            ids, mask = env.get_wrapper_attr("token_view")()
            episode = env.get_wrapper_attr("episode")
            return {
                "episode_id": session.episode_id,
                "step_count": session.steps,
                "session_id": sid,
                "turn": int(env.get_wrapper_attr("turn")),
                "done": bool(env.get_wrapper_attr("done")),
                "num_tokens": len(ids),
                "token_ids": to_json(ids),
                "assistant_mask": to_json(mask),
                "messages": to_json(env.get_wrapper_attr("messages")),
                "task_state": None if episode is None else to_json(episode.state),
            }

    def fork(self, sid: str, body: Any, scope: int | None = None) -> dict[str, Any]:
        """A new session ``{"session_id": ...}`` with a copy of this one's env (``"episode": false``: none)."""
        if not isinstance(body, Mapping) or not isinstance(body.get("session_id"), str):
            raise _refused("invalid_request", "the body must be {'session_id': <new id>, 'episode': <bool>}")
        new_id, episode = body["session_id"], body.get("episode", True)
        if not isinstance(episode, bool):
            raise _refused("invalid_request", f"'episode' must be a bool, got {episode!r}", "episode")
        with self._use(sid, scope) as session:
            twin = _call(fork, session.env, episode=episode)
            copied = (session.steps, session.episodes, session.episode_id) if episode else (0, 0, None)
        with self._lock:
            try:
                if self._find(new_id, scope, create=True, change=True) is not None:
                    raise _refused("invalid_request", f"session {new_id!r} exists already", "session_id")
                added, gone = self._admit(new_id, scope, twin)
            except BaseException:
                twin.close()
                raise
            added.users = 0
            added.steps, added.episodes, added.episode_id = copied
        for old in gone:
            _close(old)
        return {"session_id": new_id}

    def delete(self, sid: str, scope: int | None = None) -> dict[str, Any]:
        """Close the session's env and forget the session."""
        with self._use(sid, scope) as session:
            with self._lock:
                self._sessions.pop(sid, None)
            session.env.close()
            session.closed = True
        return {"session_id": sid, "deleted": True}

    def discard(self, sid: str) -> None:
        """Close session ``sid`` if it is open (a WebSocket connection's own, when it ends); waits for its call."""
        with self._lock:
            session = self._sessions.pop(sid, None)
        if session is not None:
            _close(session)


def _close(session: Session) -> None:
    with session.lock:
        if session.env is not None:
            session.env.close()
        session.closed = True


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call the env; a refusal becomes a 4xx naming what was wrong (other failures stay 500s)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        code = error_code(e)
        if code is None:
            raise
        raise _refused(code, f"{type(e).__name__}: {e}") from e


_RESET_FIELDS = ("seed", "options", "episode_id")


def _reset_args(body: Any) -> tuple[int | None, dict[str, Any] | None, str | None]:
    body = {} if body is None else body
    if not isinstance(body, Mapping):
        raise _refused("invalid_request", "the body must be a JSON object: {'seed': <int>, 'options': {...}}")
    unknown = sorted(str(k) for k in body if k not in _RESET_FIELDS)
    if unknown:
        raise _refused("invalid_request", f"unknown reset field(s) {unknown}: a reset takes {list(_RESET_FIELDS)}",
                       unknown[0])  # fmt: skip
    seed, options, episode_id = body.get("seed"), body.get("options"), body.get("episode_id")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise _refused("invalid_request", f"'seed' must be an int >= 0 or null, got {seed!r}", "seed")
    if options is not None and not isinstance(options, Mapping):
        raise _refused("invalid_request", f"'options' must be an object or null, got {options!r:.60}", "options")
    if episode_id is not None and not (isinstance(episode_id, str) and 0 < len(episode_id) <= 255):
        raise _refused("invalid_request", f"'episode_id' must be a str of 1 to 255 characters or null, got "
                       f"{episode_id!r:.60}", "episode_id")  # fmt: skip
    return seed, None if options is None else dict(options), episode_id
