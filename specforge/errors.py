"""The one exception type for mistakes a user can fix (a bad value, a missing file, a refused
overwrite). The ``specforge`` command reports a :class:`UserError` in one line; any other
exception is a bug and keeps its traceback.

``UserError`` subclasses ``ValueError`` so that callers that already catch ``ValueError`` keep
working.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input, config, files or environment; the message names it."""


class Interrupted(Exception):
    """A run stopped by a signal (SIGINT, SIGTERM) after saving what it had; the message says
    how to continue. The ``specforge`` command reports it in one line and exits ``128 +
    signal``, as a shell does for a process the signal killed."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
