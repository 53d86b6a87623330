"""Errors a user can cause (bad config, missing files, malformed data).

The launcher prints their message as one line and exits non-zero instead of showing a traceback.
"""


class RelaxUserError(Exception):
    """A problem with the user's input; the message names the cause and how to fix it."""
