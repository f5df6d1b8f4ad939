"""The one exception type for mistakes a user can fix (a bad value, a missing file, a refused
overwrite). The ``specforge`` command reports a :class:`UserError` in one line; any other
exception is a bug and keeps its traceback.

``UserError`` subclasses ``ValueError`` so that callers that already catch ``ValueError`` keep
working.
"""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input, config, files or environment; the message names it."""
