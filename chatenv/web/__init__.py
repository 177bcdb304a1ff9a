"""The HTTP layer under both servers (capture endpoint and env server): keys, binding, session ids, bodies, threads.

Neither server's code is imported here: :mod:`chatenv.serve` and :mod:`chatenv.envserver` both stand on this.
"""

from chatenv.web.http import (
    MAX_BODY_BYTES,
    SESSION_HEADER,
    SESSION_ID,
    api_keys,
    check_binding,
    check_session_id,
    install_key_check,
    is_loopback,
    key_folder,
    key_scope,
    loads,
    make_local_key,
    read_json_body,
    require_serve_extra,
    scope_of,
    scope_refusal,
)
from chatenv.web.threaded import ThreadedServer

__all__ = [
    "MAX_BODY_BYTES",
    "SESSION_HEADER",
    "SESSION_ID",
    "ThreadedServer",
    "api_keys",
    "check_binding",
    "check_session_id",
    "install_key_check",
    "is_loopback",
    "key_folder",
    "key_scope",
    "make_local_key",
    "loads",
    "read_json_body",
    "require_serve_extra",
    "scope_of",
    "scope_refusal",
]
