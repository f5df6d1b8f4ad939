"""What several benchmark scripts share: running ``specforge`` stages as subprocesses (each
skipped when its output is already there, so a rerun resumes), timing a callable, and
profiling a block. A script imports this module, never another script."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch


def specforge(*arguments: str) -> None:
    """Run ``specforge ARGUMENTS`` with this interpreter; stop on a failure."""
    command = [sys.executable, "-m", "specforge.cli", *arguments]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)


def bench(out: Path, *arguments: str) -> dict:
    """``specforge bench ARGUMENTS --output OUT``, skipped when ``OUT/bench.json`` is there;
    returns that bench.json."""
    if not (out / "bench.json").is_file():
        specforge("bench", *arguments, "--output", str(out))
    return json.loads((out / "bench.json").read_text())


def export_once(common: list[str], export: Path) -> None:
    """``specforge export COMMON`` of a run's newest checkpoint to ``export``, skipped when an
    export is there."""
    if not (export / "config.json").is_file():
        specforge("export", *common, f"export.output={export}")


def median_ms(fn, repeats: int) -> float:
    """The median wall time of ``fn()`` over ``repeats`` calls after one warm-up, in ms."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@contextmanager
def profiled(device: torch.device) -> Iterator[None]:
    """Prints PyTorch's profiler tables of the block: host time by operator, and on a GPU its
    own time by kernel."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if cuda:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
