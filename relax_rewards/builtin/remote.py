"""``remote``: a reward computed by an HTTP service (e.g. a sandboxed code runner or a reward model)."""

from __future__ import annotations

import json
import logging
import math
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


class _Retryable(Exception):
    """A failure worth another attempt: the service is down, busy or briefly broken."""


def _post_once(url: str, payload: dict[str, Any], timeout_s: float, headers: dict[str, str] | None) -> Any:
    """One POST; the parsed JSON reply of a 200, _Retryable for transient failures, else a clear error."""
    import httpx

    try:
        resp = httpx.post(url, json=payload, timeout=timeout_s, headers=headers)
    except httpx.HTTPError as e:  # connection refused, reset, timeout ...
        raise _Retryable(f"{type(e).__name__}: {e}") from None
    if resp.status_code in _RETRY_STATUS:
        raise _Retryable(f"HTTP {resp.status_code}: {resp.text[:200]}")
    if resp.status_code != 200:
        raise RuntimeError(
            f"remote reward at {url} rejected the request: HTTP {resp.status_code}: {resp.text[:200]}"
        )
    try:
        return resp.json()
    except ValueError:
        raise ValueError(f"remote reward at {url} replied non-JSON: {resp.text[:200]!r}") from None


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
    408/425/429/5xx are retried ``retries`` times with exponential backoff ``backoff_s * 2**attempt``
    (tenacity); other HTTP errors fail at once. ``url`` may also come from ``metadata["reward_url"]``.
    """
    from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

    md = metadata or {}
    url = url or md.get("reward_url")
    if not url:
        raise ValueError("remote reward needs a url: pass kwargs url='http://host:port/path'")
    payload = {"prompt": _jsonable(md.get("prompt")), "response": response, "label": _jsonable(label)}
    attempts = max(0, int(retries)) + 1
    retrying = Retrying(
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=backoff_s, min=0, max=float("inf")),
        retry=retry_if_exception_type(_Retryable),
        before_sleep=lambda state: log.info(
            "remote reward %s attempt %d failed: %s", url, state.attempt_number, state.outcome.exception()
        ),
    )
    try:
        body = retrying(_post_once, url, payload, timeout_s, headers)
    except RetryError as err:
        raise RuntimeError(
            f"remote reward at {url} failed after {attempts} attempts; last error: "
            f"{err.last_attempt.exception()}"
        ) from None
    out = _parse_reply(body, url)
    if isinstance(out, float) and not math.isfinite(out):
        raise ValueError(f"remote reward at {url} replied a non-finite reward {out}")
    return out
