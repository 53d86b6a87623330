"""The one token rule of every HTTP surface Relax serves (control plane, engine server): bound to loopback
it is open; bound beyond it, it needs a bearer token."""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Callable

from fastapi import HTTPException, Request

from relax_core.errors import RelaxUserError


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_security(
    host: str, token: str | None, host_key: str = "control_plane.host", token_key: str = "control_plane.token"
) -> None:
    """Refuse to expose an HTTP surface beyond this machine without a token."""
    if not is_loopback(host) and not token:
        raise RelaxUserError(f"{host_key}={host!r} is reachable from other machines: set {token_key}")


def bearer_auth(token: str | None) -> Callable[[Request], None]:
    """A FastAPI dependency: with a ``token``, every request must carry ``Authorization: Bearer <token>``."""

    def auth(request: Request) -> None:
        if token is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given, f"Bearer {token}"):
            raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})

    return auth
