"""Child processes that never outlive their purpose: each runs as the leader of a process group
of its own, so a timeout (or an error in the parent) stops its whole group, its compilers or
workers included, not only the direct child; and on Linux it is sent a signal when its parent
dies (``prctl(PR_SET_PDEATHSIG)``), so a parent killed outright (``SIGKILL``, the OOM killer)
does not leave a server holding a port and memory.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from typing import Any

PR_SET_PDEATHSIG = 1
"""``prctl``'s option that makes the kernel signal a process when its parent dies."""


def _die_with_parent(signum: int):
    """A ``preexec_fn`` (run in the child before ``exec``): ``signum`` when the parent dies.
    ``None`` where the kernel has no such option (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getpid()

    def arrange() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signum)

    return arrange


def start_group(command: list[str], *, death_signal: int = signal.SIGTERM, **popen: Any):
    """``subprocess.Popen(command, **popen)`` as the leader of a new process group that gets
    ``death_signal`` when this process dies (see the module docstring)."""
    return subprocess.Popen(
        command, start_new_session=True, preexec_fn=_die_with_parent(death_signal), **popen
    )


def stop_group(process: subprocess.Popen, grace: float = 60.0) -> None:
    """Stop ``process``'s whole group: SIGTERM, then SIGKILL after ``grace`` seconds."""
    if process.poll() is None:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(process, signal.SIGKILL)  # what the leader left behind, if anything
    process.wait()


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:  # the group is gone
        pass


def run_group(command: list[str], *, timeout: float, **popen: Any) -> int | None:
    """Run ``command`` in a group of its own (:func:`start_group`) and return its exit code,
    or ``None`` when it ran past ``timeout`` seconds: then the whole group is killed, as it is
    when this process is interrupted while waiting."""
    process = start_group(command, death_signal=signal.SIGKILL, **popen)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if process.poll() is None:
            _signal_group(process, signal.SIGKILL)
            process.wait()
