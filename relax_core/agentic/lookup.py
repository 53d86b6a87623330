"""A slow tool: a search-like lookup behind a local HTTP service that answers after a set latency
(``experiment=agent_slow_tool``).

The task is ``find 374``: the model calls ``find(374)``, the service replies ``=52`` after 0.1–0.5 s,
and the model copies ``52``. The value is a fixed hash of the key, so only the tool knows it. Rollout
time is mostly waiting here, the case where ``mode=async`` overlaps training with rollouts.

Without ``url`` the first environment of a process starts one shared service on 127.0.0.1 (a free
port, daemon threads; requests are served concurrently). The tool calls of one turn's episodes run in
concurrent threads (:func:`relax_core.agentic.env.call_many_with_timeout`), so they wait together. A
service that is down or too slow gives the observation ``=error`` and a counted ``tool_errors``
(metric ``reward/tool_errors``, per episode); the episode goes on and scores 0 unless it answers right.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from relax_core.agentic.env import BaseInteractionEnv

CALL = re.compile(r"^find\((\d{1,8})\)$")


def lookup_value(key: str) -> str:
    """The service's answer for ``key``: two digits from a hash (learnable only through the tool)."""
    return f"{int(hashlib.sha256(key.encode()).hexdigest(), 16) % 90 + 10}"


class _Server(ThreadingHTTPServer):
    # every episode of a step connects at once: the default backlog of 5 drops connections, whose SYN
    # retries (1 s, 3 s) then read as a slow service (measured: 1% tool errors at 128 episodes)
    request_queue_size = 1024
    daemon_threads = True


class LookupService:
    """``GET /lookup?q=<key>`` -> ``{"value": ...}`` after ``latency_s`` (a number, or [low, high]
    drawn uniformly per request). ``events`` records each answered request's (key, start, end) monotonic
    times, the end taken before the reply is sent."""

    def __init__(self, latency_s: float | list[float] = (0.1, 0.5), seed: int = 0) -> None:
        self.latency = _pair(latency_s)
        self.events: list[tuple[str, float, float]] = []
        rng, lock, service = random.Random(seed), threading.Lock(), self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                start = time.monotonic()
                parts = urlsplit(self.path)
                key = (parse_qs(parts.query).get("q") or [""])[0]
                if parts.path != "/lookup" or not key:
                    self.send_error(400, "GET /lookup?q=<key>")
                    return
                with lock:
                    delay = rng.uniform(*service.latency)
                time.sleep(delay)
                body = json.dumps({"value": lookup_value(key)}).encode()
                with lock:  # before the reply: a client's next request cannot start ahead of this end
                    service.events.append((key, start, time.monotonic()))
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out: it counts the error
                    pass

            def log_message(self, *args: Any) -> None:  # one line per request would flood the run's log
                pass

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # a short poll keeps close() quick
        threading.Thread(
            target=self.server.serve_forever, args=(0.05,), daemon=True, name="relax-lookup"
        ).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_services: dict[tuple[float, float], LookupService] = {}
_services_lock = threading.Lock()


def shared_service(latency_s: float | list[float]) -> LookupService:
    """The process's service for this latency, started on first use."""
    key = _pair(latency_s)
    with _services_lock:
        if key not in _services:
            _services[key] = LookupService(list(key))
        return _services[key]


def fetch(url: str, key: str, timeout_s: float) -> str:
    """The service's value for ``key`` (http.client, not urllib: a proxy set in the environment must not
    catch 127.0.0.1). Raises OSError / ValueError when the service is down, slow or answers garbage."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=timeout_s)
    try:
        conn.request("GET", f"/lookup?q={key}")
        response = conn.getresponse()
        payload = response.read()
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}")
        return str(json.loads(payload)["value"])
    except (KeyError, TypeError, http.client.HTTPException) as err:
        raise ValueError(f"bad answer: {err}") from None
    finally:
        conn.close()


class SlowLookupEnv(BaseInteractionEnv):
    """Answer ``find 374`` by calling ``find(374)`` first; the service replies ``=52``.

    Any turn that is not a well-formed ``find(...)`` call is the final answer: reward 1 when it equals the
    label and the tool was called. ``url``: the service (None: this process's own, with ``latency_s``);
    ``timeout_s``: per request, keep it below ``rollout.env_step_timeout_s`` so a slow service is a counted
    tool error, not a failed episode. ``info`` (cumulative, every step): ``tool_calls``, ``tool_errors``,
    ``tool_wait_s``; at the end ``acc``.
    """

    def __init__(
        self,
        label: Any = None,
        metadata: dict | None = None,
        seed: int = 0,
        url: str | None = None,
        latency_s: float | list[float] = (0.1, 0.5),
        timeout_s: float = 2.0,
    ) -> None:
        super().__init__(label, metadata, seed)
        if url is not None and (urlsplit(url).scheme != "http" or not urlsplit(url).hostname):
            raise ValueError(
                f"rollout.env.url={url!r} is not http://host:port (or null for the built-in service)"
            )
        self.key = str(self.metadata.get("key", ""))
        self.url, self.latency_s, self.timeout_s = url, list(_pair(latency_s)), float(timeout_s)
        self.tool_calls = self.tool_errors = 0
        self.tool_wait_s = 0.0

    def _counts(self) -> dict[str, float]:
        return {
            "tool_calls": float(self.tool_calls),
            "tool_errors": float(self.tool_errors),
            "tool_wait_s": self.tool_wait_s,
        }

    def step(self, response_text: str) -> tuple[Any, bool, dict[str, Any]]:
        text = response_text.strip()
        call = CALL.match(text)
        if call:
            self.tool_calls += 1
            url = self.url or shared_service(self.latency_s).url
            start = time.monotonic()
            try:
                observation = f"={fetch(url, call.group(1), self.timeout_s)}"
            except (OSError, ValueError):  # down, refused, timed out or garbage: counted, the episode goes on
                self.tool_errors += 1
                observation = "=error"
            self.tool_wait_s += time.monotonic() - start
            return observation, False, self._counts()
        correct = text == str(self.label) and self.tool_calls > self.tool_errors
        return None, True, {"reward": float(correct), "acc": float(correct)} | self._counts()

    def expert_action(self) -> str:
        return f"find({self.key})" if self.tool_calls == 0 else str(self.label)


def _pair(latency_s: Any) -> tuple[float, float]:
    """A fixed latency or a [low, high] range (a list from the config, a tuple as the default)."""
    if isinstance(latency_s, int | float):
        return float(latency_s), float(latency_s)
    low, high = (float(x) for x in latency_s)
    if not 0 <= low <= high:
        raise ValueError(f"rollout.env.latency_s={list(latency_s)} must be [low, high] with 0 <= low <= high")
    return low, high
