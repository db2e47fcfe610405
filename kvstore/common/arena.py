"""The same-node arena hand-out protocol, shared by the daemon and its clients.

The daemon serves the host arena's memfd on a second unix socket, ``<grpc socket>.arena``
(:class:`kvstore.service.arena_server.ArenaServer`); a client sends one hello line and
maps what it receives (:class:`kvstore.client.arena_mapping.ArenaMapping`). Both sides
name an arena by :func:`arena_identity`, and gRPC calls of a mapped client carry it in
:data:`ARENA_HEADER`.

Hello version 1 (:data:`HELLO`): the daemon answers ``OK <bytes>`` with the memfd and
closes the connection. Version 2 (:data:`HELLO_SESSION`): it answers
``OK <bytes> <session id or -> <longest lease TTL, s>`` and keeps the connection open as
the client's *session*: the client holds it for as long as it maps the arena and names the
session in :data:`SESSION_HEADER`; when the connection closes (the client unmapped, or its
process died) the daemon ends what the session holds at once
(:mod:`kvstore.service.liveness`). Version 3 (:data:`HELLO_CONTROL`): as version 2, with a
fourth field, ``1`` when the daemon also serves control frames on the connection (Lookup,
Lease, Release without gRPC: :mod:`kvstore.common.arena_wire`), ``0`` when it does not (the
client then uses gRPC for them). Version 4 (:data:`HELLO_TABLE`): as version 3, with a fifth
field, ``1`` when two more descriptors follow the memfd: the arena's block table (read-only)
and the session's reader page (:mod:`tiers.block_table`), which let the client find and copy
host blocks with no round trip; ``0`` when the daemon keeps no table (or serves no control
frames to this session). Versions 3 and 4 end with one more field (the fifth, the sixth),
``1`` when the session also takes a zero-copy put's Reserve and Commit as control frames
(older daemons send no such field: the client then reserves and commits by gRPC). A
daemon that does not know a version answers its hello
``ERR bad request``; the client says the version below instead.
"""

from __future__ import annotations

import os

HELLO = b"KVSTORE-ARENA 1 "
HELLO_SESSION = b"KVSTORE-ARENA 2 "
HELLO_CONTROL = b"KVSTORE-ARENA 3 "
HELLO_TABLE = b"KVSTORE-ARENA 4 "
MAX_HELLO_LINE = 4096

SESSION_HEADER = "kvstore-session"
"""gRPC metadata a mapped client sends on Lease, Reserve and Commit beside
:data:`ARENA_HEADER`: the session id of its hand-out connection (absent: no session)."""

ARENA_HEADER = "kvstore-arena"
"""gRPC metadata a mapped client sends on Lease, Reserve and Commit: the
:func:`arena_identity` of its mapping. A daemon serving another arena (it restarted
since the client mapped it) refuses the call with a message holding
:data:`ARENA_CHANGED`, so the client never copies from or into a stale mapping."""

ARENA_CHANGED = "the shared arena changed"


def arena_identity(fd: int) -> str:
    """Which memfd an arena is, ``"<st_dev>:<st_ino>"``: the daemon and every client that
    received the descriptor see the same, and a restarted daemon's new memfd differs
    while any client still maps the old one."""
    st = os.fstat(fd)
    return f"{st.st_dev}:{st.st_ino}"
