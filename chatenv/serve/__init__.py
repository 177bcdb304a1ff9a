"""Any agent as a policy: an OpenAI-compatible endpoint that records token-exact trajectories.

Agents written against the OpenAI chat API (the ``openai`` client, agent frameworks, CLIs) talk to
:class:`CaptureServer` (or ``chatenv serve``) as to any chat-completions server; behind it, a policy wrapper
generates, and every session's trajectory is kept token-exact (:mod:`chatenv.serve.sessions`): generated ids
verbatim, only new messages' tokens appended, divergent histories split into segments and counted. The
trajectories convert to chatenv's rollout TensorDict and episode view (:mod:`chatenv.serve.trajectory`), and
:class:`AgentEnv` / :func:`agent_rollout` run agent programs for episodes scored by a task.

fastapi and uvicorn (the ``serve`` extra) are imported only when a server or app is built.
"""

from chatenv.serve.agent import AgentEnv, AgentError, agent_rollout
from chatenv.serve.app import create_app
from chatenv.serve.errors import APIError
from chatenv.serve.server import CaptureServer, serve_forever
from chatenv.serve.service import CaptureService
from chatenv.serve.sessions import Session
from chatenv.serve.store import SessionStore
from chatenv.serve.trajectory import (
    Outcome,
    episode_records,
    episodes_from_records,
    session_records,
    session_tensordict,
    session_transitions,
)
from chatenv.web import SESSION_HEADER

__all__ = [
    "SESSION_HEADER",
    "APIError",
    "AgentEnv",
    "AgentError",
    "CaptureServer",
    "CaptureService",
    "Outcome",
    "Session",
    "SessionStore",
    "agent_rollout",
    "create_app",
    "episode_records",
    "episodes_from_records",
    "serve_forever",
    "session_records",
    "session_tensordict",
    "session_transitions",
]
