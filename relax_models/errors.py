"""Errors a user can cause (bad config, missing files, malformed data).

Defined in the lowest package that raises it, so the model layer does not import the engine; the engine
re-exports it as ``relax_core.errors.RelaxUserError``. The launcher prints its message as one line and exits
non-zero instead of showing a traceback.
"""


class RelaxUserError(Exception):
    """A problem with the user's input; the message names the cause and how to fix it."""
