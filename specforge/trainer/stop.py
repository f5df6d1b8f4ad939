"""Stopping a training run cleanly on SIGINT (Ctrl-C) or SIGTERM (a scheduler's time limit).

While :class:`StopRequest` is entered, either signal is noted instead of killing the process:
the loop finishes the step in flight, writes a checkpoint and raises
:class:`specforge.errors.Interrupted` saying how to resume. A second signal acts at once (the
handlers in place before are restored when the first arrives). Handlers can only be installed
from the main thread; elsewhere the request is inert and the signals act as they would.
"""

from __future__ import annotations

import logging
import signal
import threading

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """The first SIGINT or SIGTERM received while entered (``signum``; 0 when none)."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _note(self, signum: int, frame) -> None:
        self.signum = signum
        self._restore()
        logger.warning(
            "%s: stopping after the step in flight and writing a checkpoint (send it again to "
            "stop at once)",
            signal.Signals(signum).name,
        )
