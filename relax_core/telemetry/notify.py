"""Run notifications through Apprise: ``logger.notify_urls`` get a message at start, finish and failure.

Any Apprise URL works (``slack://``, ``mailto://``, ``json://host/path``, ``ntfy://``, ...; see the Apprise
docs). Relax adds one schema of its own, ``relaxfile:///abs/path/notify.jsonl``, which appends each message
as a JSON line to a local file: handy for tests and for clusters without outbound network.

A notification that cannot be delivered is logged and otherwise ignored: it must never fail a run.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("relax")

_registered = False


def _register_file_schema() -> None:
    """Register ``relaxfile://`` with Apprise (once per process)."""
    global _registered
    if _registered:
        return
    from apprise.decorators import notify

    @notify(on="relaxfile", name="Relax local file")
    def _write(body: str, title: str, notify_type: str, meta: dict, *args: Any, **kwargs: Any) -> bool:
        # Apprise normalises relaxfile:///a/b to relaxfile://a/b: the path is always absolute
        path = Path("/" + meta["url"].split("://", 1)[1].lstrip("/"))
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"time": time.time(), "type": str(notify_type), "title": title, "body": body}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return True

    _registered = True


class Notifier:
    """Sends run events to ``urls``; a no-op when the list is empty."""

    def __init__(self, urls: list[str], run_name: str = "relax") -> None:
        self.urls = list(urls or [])
        self.run_name = run_name
        self._apprise = None
        if self.urls:
            import apprise

            _register_file_schema()
            self._apprise = apprise.Apprise()
            for url in self.urls:
                if not self._apprise.add(url):
                    from relax_core.errors import RelaxUserError

                    raise RelaxUserError(f"logger.notify_urls: {url!r} is not a URL Apprise understands")

    def send(self, event: str, body: str) -> bool:
        """``event``: start | finish | failure. Returns whether every target accepted the message."""
        if self._apprise is None:
            return True
        import apprise

        kind = {
            "start": apprise.NotifyType.INFO,
            "finish": apprise.NotifyType.SUCCESS,
            "failure": apprise.NotifyType.FAILURE,
        }.get(event, apprise.NotifyType.INFO)
        title = f"[relax] {self.run_name}: {event} on {socket.gethostname()}"
        try:
            ok = bool(self._apprise.notify(body=body, title=title, notify_type=kind))
        except Exception as err:  # a notification must never fail the run
            log.warning("notification %r failed: %s", event, err)
            return False
        if not ok:
            log.warning("notification %r was not delivered to every target", event)
        return ok
