"""Child processes never outlive their purpose (:mod:`specforge.processes`): a timeout stops
the child's whole process group, grandchildren included (``subprocess.run(timeout=)`` kills
only the child), and a child started by a parent that is then killed outright goes with it."""

import os
import signal
import subprocess
import sys
import time

from specforge.processes import run_group


def _gone(pid: int, within: float = 10.0) -> bool:
    """Whether process ``pid`` is gone (or a zombie: dead, waiting to be reaped) in time."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_timeout_stops_the_whole_group(tmp_path):
    pid_file = tmp_path / "grandchild"
    script = f"sleep 300 & echo $! > {pid_file}; wait"
    assert run_group(["bash", "-c", script], timeout=2) is None
    grandchild = int(pid_file.read_text())
    assert _gone(grandchild)
    assert run_group(["bash", "-c", "exit 3"], timeout=30) == 3


PARENT = """
import subprocess, sys, time
from specforge.processes import start_group
child = start_group(["sleep", "300"], stdout=subprocess.DEVNULL)
print(child.pid, flush=True)
time.sleep(300)
"""


def test_a_child_dies_with_its_parent_killed_outright():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert not _gone(child, within=0.5)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert _gone(child)
