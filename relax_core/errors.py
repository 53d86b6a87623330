"""Errors a user can cause (bad config, missing files, malformed data).

``RelaxUserError`` lives in the model layer (``relax_models.errors``), the lowest package that raises it;
this is its name for the engine and the launcher, which catch it around a run.
"""

from relax_models.errors import RelaxUserError

__all__ = ["RelaxUserError"]
