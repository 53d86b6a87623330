"""For runs a test stops with Ctrl-C (imported by name: pytest puts this folder on sys.path).

A test session started in the background of a non-interactive shell (``cmd &``) inherits SIGINT ignored,
and so would the run it starts: Python then installs no KeyboardInterrupt handler and the Ctrl-C is lost.
"""

from __future__ import annotations

import signal


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` of the run's Popen: SIGINT back to its default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
