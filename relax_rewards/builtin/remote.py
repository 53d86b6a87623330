"""``remote``: a reward computed by an HTTP service (e.g. a sandboxed code runner or a reward model)."""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any

from relax_rewards.registry import register

log = logging.getLogger(__name__)

# statuses worth retrying: the server is busy or briefly broken, the request itself is fine
_RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def _parse_reply(body: Any, url: str) -> float | dict[str, float]:
    if isinstance(body, bool) or not isinstance(body, int | float | dict):
        raise ValueError(
            f"remote reward at {url} replied {str(body)[:200]!r}; expected a number or a JSON object"
        )
    if not isinstance(body, dict):
        return float(body)
    numeric = {k: float(v) for k, v in body.items() if isinstance(v, int | float)}  # bools count as 0/1
    if set(body) == {"reward"} and "reward" in numeric:
        return numeric["reward"]
    if not numeric:
        raise ValueError(f"remote reward at {url} replied {str(body)[:200]!r} with no numeric entry")
    return numeric


@register("remote", key="reward", needs_one_of=("url",))
def remote_reward(
    response: str,
    label: Any,
    metadata: dict[str, Any] | None = None,
    *,
    url: str | None = None,
    timeout_s: float = 10.0,
    retries: int = 3,
    backoff_s: float = 0.5,
    headers: dict[str, str] | None = None,
) -> float | dict[str, float]:
    """POST ``{"prompt", "response", "label"}`` as JSON to ``url`` and return its reward.

    The reply is ``{"reward": x}`` (-> x), a bare number, or an object of numbers (-> that dict; the
    executor takes ``reward`` or the configured key). Connection errors, timeouts and HTTP
    408/425/429/5xx are retried ``retries`` times with exponential backoff ``backoff_s * 2**attempt``;
    other HTTP errors fail at once. ``url`` may also come from ``metadata["reward_url"]``.
    """
    import httpx

    md = metadata or {}
    url = url or md.get("reward_url")
    if not url:
        raise ValueError("remote reward needs a url: pass kwargs url='http://host:port/path'")
    payload = {"prompt": _jsonable(md.get("prompt")), "response": response, "label": _jsonable(label)}
    last_error = ""
    for attempt in range(max(0, int(retries)) + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            resp = httpx.post(url, json=payload, timeout=timeout_s, headers=headers)
        except httpx.HTTPError as e:  # connection refused, reset, timeout ...
            last_error = f"{type(e).__name__}: {e}"
            log.info("remote reward %s attempt %d failed: %s", url, attempt + 1, last_error)
            continue
        if resp.status_code in _RETRY_STATUS:
            last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            log.info("remote reward %s attempt %d failed: %s", url, attempt + 1, last_error)
            continue
        if resp.status_code != 200:
            raise RuntimeError(
                f"remote reward at {url} rejected the request: HTTP {resp.status_code}: {resp.text[:200]}"
            )
        try:
            body = resp.json()
        except ValueError:
            raise ValueError(f"remote reward at {url} replied non-JSON: {resp.text[:200]!r}") from None
        out = _parse_reply(body, url)
        if isinstance(out, float) and not math.isfinite(out):
            raise ValueError(f"remote reward at {url} replied a non-finite reward {out}")
        return out
    raise RuntimeError(
        f"remote reward at {url} failed after {int(retries) + 1} attempts; last error: {last_error}"
    )
