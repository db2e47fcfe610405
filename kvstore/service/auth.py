"""Who is calling: bearer tokens, tenants, and each tenant's private key space.

A daemon serves one of three set-ups (``[server]`` in the TOML config):

====================  ===================================================================
config                who may call, and which blocks they see
====================  ===================================================================
neither key set       anyone who can open the socket (a unix socket is mode 0600);
                      one shared key space
``auth_token``        callers sending ``authorization: Bearer <auth_token>``; one shared
                      key space
``[server.tenants]``  callers sending one tenant's token (``name = "token"``); each
                      tenant has its own key space
====================  ===================================================================

**Tenant key spaces.** With tenants, the server maps every client key to
:func:`tenant_key` ``= SHA-256(domain | len(tenant) | tenant | key)`` before the tier
manager sees it, and maps keys in replies back, so clients never notice. Two tenants that
send the same key (the same prompt tokens under the same namespace) therefore address
different blocks, and no key that one tenant can send names another tenant's block
without a SHA-256 preimage. ``auth_token`` and ``tenants`` cannot be combined: a caller
in the shared space could compute a tenant's internal keys and read its blocks.

**Token checks.** Every configured token is compared with the presented
``authorization`` value on every call, through :func:`hmac.compare_digest` over SHA-256
digests (fixed 32-byte inputs), without stopping at a match: the time taken does not
depend on how many leading bytes, or which tenant's token, the caller guessed. A call
must carry exactly one ``authorization`` value.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

TENANT_KEY_DOMAIN = b"kvstore/tenant-key/v1\0"
"""Domain separation prefix of :func:`tenant_key` (changing it orphans every stored block)."""

_SCHEME = b"Bearer "


def tenant_key(tenant: str, key: bytes) -> bytes:
    """The internal 32-byte block key of client ``key`` in ``tenant``'s key space.

    ``SHA-256(TENANT_KEY_DOMAIN | len(tenant) as 4 bytes big-endian | tenant UTF-8 | key)``:
    the length prefix keeps ``("ab", key)`` and ``("a", b"b" + key)`` apart.
    """
    name = tenant.encode("utf-8")
    h = hashlib.sha256(TENANT_KEY_DOMAIN)
    h.update(len(name).to_bytes(4, "big"))
    h.update(name)
    h.update(key)
    return h.digest()


@dataclass(frozen=True)
class KeySpace:
    """One caller's view of the store.

    Attributes:
        tenant: the tenant's name; ``""`` is the shared key space (client keys are stored
            as they are).
    """

    tenant: str = ""

    @property
    def shared(self) -> bool:
        return not self.tenant

    def internal(self, key: bytes) -> bytes:
        """The manager's key for client ``key`` (checked for length by the caller)."""
        return key if self.shared else tenant_key(self.tenant, key)

    def internal_many(self, keys: Sequence[bytes]) -> list[bytes]:
        return list(keys) if self.shared else [tenant_key(self.tenant, k) for k in keys]

    def scoped(self, name: str) -> str:
        """A caller-chosen name (a trajectory id) made private to this tenant."""
        return name if self.shared else f"{self.tenant}\x00{name}"


SHARED = KeySpace("")


class Authenticator:
    """Maps the bearer token of a call to the caller's tenant.

    Args:
        tokens: bearer token -> tenant name (``""``: the shared key space). Tokens must be
            unique and non-empty.
    Raises ValueError for an empty token table or an empty token.
    """

    def __init__(self, tokens: Mapping[str, str]):
        if not tokens:
            raise ValueError("an authenticator needs at least one token")
        entries = []
        for token, tenant in tokens.items():
            if not token:
                raise ValueError("bearer tokens must not be empty")
            entries.append((hashlib.sha256(_SCHEME + token.encode("utf-8")).digest(), tenant))
        self._entries = tuple(entries)
        self.tenants = frozenset(t for _, t in entries)

    @classmethod
    def from_config(cls, server) -> "Authenticator | None":
        """The authenticator of a :class:`kvstore.config.ServerConfig`; None when calls are
        not authenticated (no ``auth_token``, no ``tenants``)."""
        if server.tenants:
            return cls({token: tenant for tenant, token in server.tenants.items()})
        if server.auth_token:
            return cls({server.auth_token: ""})
        return None

    def tenant_for(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The tenant whose token the call's metadata carries, or None (reject the call).

        ``metadata`` is gRPC invocation metadata (``(key, value)`` pairs). None when there
        is no ``authorization`` value, more than one, or one that matches no token.
        """
        values = [v for k, v in metadata or () if k == "authorization"]
        if len(values) != 1:
            return None
        got = values[0].encode("utf-8") if isinstance(values[0], str) else bytes(values[0])
        digest = hashlib.sha256(got).digest()
        match = None
        for expected, tenant in self._entries:   # no early exit: time does not depend on the match
            if hmac.compare_digest(digest, expected):
                match = tenant
        return match

    def key_space(self, metadata) -> KeySpace | None:
        """The caller's :class:`KeySpace`, or None when the call is not authenticated."""
        tenant = self.tenant_for(metadata)
        return None if tenant is None else KeySpace(tenant)


__all__ = ["Authenticator", "KeySpace", "SHARED", "TENANT_KEY_DOMAIN", "tenant_key"]
