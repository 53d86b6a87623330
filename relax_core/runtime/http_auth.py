"""Rules shared by every HTTP surface Relax serves (control plane, engine server, agent endpoint): bound to
loopback it is open, bound beyond it it needs a bearer token; and every request is answered with a 2xx or a
4xx naming its cause, whatever numbers or nesting it carries."""

from __future__ import annotations

import ipaddress
import math
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

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


class _Guard:
    """ASGI middleware in front of every route, ``/openapi.json`` and ``/docs`` included (route dependencies
    do not cover those): the bearer token, then the body size, read before any handler parses it."""

    def __init__(self, app: Any, token: str | None, max_body_bytes: int | None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.expected is not None:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                reply = JSONResponse(
                    {"detail": "missing or wrong bearer token"}, 401, headers={"WWW-Authenticate": "Bearer"}
                )
                await reply(scope, receive, send)
                return
        if self.max_body_bytes is None:
            await self.app(scope, receive, send)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                reply = JSONResponse(
                    {"detail": f"request body over this server's limit of {self.max_body_bytes} bytes"}, 413
                )
                await reply(scope, receive, send)
                return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


# below this a temperature turns logits into infinities (NaN probabilities); 0 means greedy
MIN_TEMPERATURE = 1e-6


def check_temperature(value: float | None) -> float | None:
    """A pydantic ``AfterValidator``: 0 (greedy) or at least :data:`MIN_TEMPERATURE`."""
    if value is not None and 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {value!r}")
    return value


def _json_safe(value: Any) -> Any:
    """``value`` with non-finite floats (which JSON cannot carry) as their names, e.g. ``"nan"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


async def _invalid_body(_: Request, err: RequestValidationError) -> JSONResponse:
    # the default handler echoes the input, and a NaN or Infinity in it made the answer itself fail (500)
    return JSONResponse({"detail": _json_safe(jsonable_encoder(err.errors()))}, 422)


async def _too_deep(_: Request, err: RecursionError) -> JSONResponse:
    return JSONResponse({"detail": "the request nests too deeply: flatten its JSON"}, 400)


def guard(app: FastAPI, token: str | None = None, max_body_bytes: int | None = None) -> FastAPI:
    """Make ``app`` answer every request: with a ``token``, every route (the schema and docs too) needs
    ``Authorization: Bearer <token>`` (401); a body over ``max_body_bytes`` gets 413; a body with NaN,
    Infinity or out-of-range numbers a 422 naming the field; one nested too deeply a 400."""
    app.add_middleware(_Guard, token=token, max_body_bytes=max_body_bytes)
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(RecursionError, _too_deep)
    return app
