"""The capture endpoint's sessions by id: at most ``max_sessions`` in memory, the rest spilled to disk, per API key."""

from __future__ import annotations

import json
import os
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from chatenv.serve.errors import APIError
from chatenv.serve.sessions import Session

__all__ = ["SessionStore"]


@dataclass
class SessionStore:
    """Every session the endpoint has seen, by id (requests without one get a fresh session each).

    At most ``max_sessions`` are held in memory: past it, the least recently used idle session is written to
    ``spill_dir`` (a temporary folder unless given) as its snapshot, and stays readable and deletable there. A request
    that would extend an evicted session is refused (``session_evicted``), so its trajectory is never split silently.

    With several API keys each session has a ``scope`` (the key that made it): lookups with another scope find
    nothing, listings show only the caller's sessions, and a request naming another key's session is refused.
    """

    sessions: dict[str, Session] = field(default_factory=dict)
    max_sessions: int | None = 4096
    spill_dir: str | None = None

    def __post_init__(self) -> None:
        if self.max_sessions is not None and (
            isinstance(self.max_sessions, bool) or not isinstance(self.max_sessions, int) or self.max_sessions < 1
        ):
            raise ValueError(f"max_sessions must be a positive int or None, got {self.max_sessions!r}")
        self._lock = threading.Lock()
        self._spilled: dict[str, tuple[str, int | None]] = {}  # id -> (file, scope)

    def get(self, session_id: str | None, *, create: bool = True, scope: int | None = None) -> Session | None:
        """The session ``session_id`` of ``scope`` (created if new and ``create``); a fresh anonymous one for None.

        Raises:
            APIError: 409 ``session_evicted`` when ``create`` and the session was evicted to disk; 403
                ``session_forbidden`` when ``create`` and the id is another key's session.
        """
        with self._lock:
            if session_id is None:
                session_id = f"anon-{uuid.uuid4().hex}"
            theirs = self.sessions[session_id].scope if session_id in self.sessions else None
            theirs = self._spilled[session_id][1] if session_id in self._spilled else theirs
            known = session_id in self.sessions or session_id in self._spilled
            if known and theirs != scope:
                if not create:
                    return None
                raise APIError(
                    f"session {session_id!r} belongs to another API key; use another session id",
                    status=403,
                    code="session_forbidden",
                    param="session",
                )
            if session_id in self.sessions:
                self.sessions[session_id] = self.sessions.pop(session_id)  # the most recently used is last
                return self.sessions[session_id]
            if not create:
                return None
            if session_id in self._spilled:
                raise APIError(
                    f"session {session_id!r} was evicted from memory (more than {self.max_sessions} sessions); read "
                    "it with GET /v1/sessions/{id}, and start a new session to go on",
                    status=409,
                    code="session_evicted",
                    param="session",
                )
            self.sessions[session_id] = Session(session_id, scope)
            self._evict()
            return self.sessions[session_id]

    def _evict(self) -> None:
        """Write the least recently used idle sessions to disk until at most ``max_sessions`` are held."""
        if self.max_sessions is None:
            return
        for sid in list(self.sessions):
            if len(self.sessions) <= self.max_sessions:
                return
            session = self.sessions[sid]
            if session.pending or sid == next(reversed(self.sessions)):
                continue
            if self.spill_dir is None:
                self.spill_dir = tempfile.mkdtemp(prefix="chatenv-sessions-")
            path = os.path.join(self.spill_dir, f"{sid}.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(session.snapshot(), f)
            self._spilled[sid] = (path, session.scope)
            del self.sessions[sid]

    def spilled(self, session_id: str, scope: int | None = None) -> dict[str, Any] | None:
        """The snapshot of a session of ``scope`` evicted to disk, or None."""
        with self._lock:
            path, theirs = self._spilled.get(session_id, (None, None))
        if path is None or theirs != scope:
            return None
        with open(path, encoding="utf-8") as f:
            snapshot: dict[str, Any] = json.load(f)
        return snapshot

    def discard(self, session: Session) -> None:
        """Remove ``session`` if it is still the one held under its id (a refused first request's session)."""
        with self._lock:
            if self.sessions.get(session.id) is session:
                del self.sessions[session.id]

    def pop(self, session_id: str, scope: int | None = None) -> Any:
        """Remove a session of ``scope`` (from memory or from disk) and return it, or its snapshot; None if unknown."""
        with self._lock:
            if session_id in self.sessions:
                return self.sessions.pop(session_id) if self.sessions[session_id].scope == scope else None
            if self._spilled.get(session_id, (None, None))[1] != scope:
                return None
            path = self._spilled.pop(session_id)[0]
        with open(path, encoding="utf-8") as f:
            snapshot = json.load(f)
        os.unlink(path)
        return snapshot

    def ids(self, scope: int | None = None) -> list[str]:
        """The ids of the sessions of ``scope`` held (in memory, then evicted to disk)."""
        with self._lock:
            held = [sid for sid, s in self.sessions.items() if s.scope == scope]
            return held + [sid for sid, (_, theirs) in self._spilled.items() if theirs == scope]
