"""Settings of the streamable-HTTP transport: who may bind where, which Host/Origin headers pass, body limits.

The MCP SDK answers a request whose Host is not allowed with 421 and a foreign Origin with 403
(mcp/server/transport_security.py), a body over the limit with 413, and a missing or wrong bearer
token with 401 (its auth middleware). What is ours: refusing a non-loopback bind without a token,
the allow-lists (a DNS-rebinding page names an attacker's host, so it never matches), and a body
limit large enough for a pasted multi-MB training log.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

from mcp.server.transport_security import TransportSecuritySettings

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
MAX_BODY_MB = 32
"""Default request-body limit: room for a 20 MB log pasted into check_mfu (JSON-escaped) and no more."""


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS


def check_bind(host: str, token: str | None, token_env: str) -> None:
    """Refuse to serve beyond this machine without a bearer token."""
    if not is_loopback(host) and not token:
        raise ValueError(f"--host {host} is not loopback: set a bearer token in ${token_env} "
                         "(clients send 'Authorization: Bearer <token>')")


def _with_port(name: str) -> list[str]:
    name = f"[{name}]" if ":" in name and not name.startswith("[") else name
    return [name, f"{name}:*"]


def security(host: str, allowed_hosts: Iterable[str] = ()) -> TransportSecuritySettings:
    """Host/Origin allow-lists: the bind address, this machine's names and the names given.

    A wildcard bind (0.0.0.0) accepts this machine's host name and FQDN; other names clients use
    (a DNS alias, an address) must be listed with --allow-host.
    """
    names = {*LOOPBACK_HOSTS, *allowed_hosts}
    if host not in WILDCARD_HOSTS:
        names.add(host)
    if not is_loopback(host):
        names.update({socket.gethostname(), socket.getfqdn()})
    names.discard("")
    hosts = sorted({h for n in names for h in _with_port(n)})
    origins = sorted({f"{scheme}://{h}" for n in names for h in _with_port(n) for scheme in ("http", "https")})
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts, allowed_origins=origins)
