"""Stopping training by a signal keeps the work: SIGTERM (a scheduler's limit) or SIGINT
(Ctrl-C) during ``specforge train`` finishes the step in flight, writes a checkpoint, says in
one line how to resume and exits 128 + the signal; the resumed run continues from it. A
``--resume`` with nothing to resume, or of a run already past the steps asked for, says so."""

import json
import logging
import signal
import subprocess
import sys
import time

import pytest

from specforge.recipes.train import train
from tests.helpers import REPO, tiny_train_config, tiny_train_overrides

SLOW_RUN = ("train.max_steps=100000", "train.save_every=100000", "train.eval_every=100000")


def _logged_steps(out) -> int:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


@pytest.mark.parametrize(("signum", "resuming"), [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_a_signal_during_training_saves_a_checkpoint_and_says_how_to_resume(
    tmp_path, peaked_target_dir, signum, resuming
):
    """A run that already resumes (``train.resume=true``, as the quickstart's) is told to run
    the same command; one that does not, to add ``--resume``."""
    folder, data = peaked_target_dir
    out = tmp_path / "run"
    command = [sys.executable, "-m", "specforge.cli", "train"]
    resume = ("train.resume=true",) * resuming
    process = subprocess.Popen(
        [*command, *tiny_train_overrides(folder, data, out, *SLOW_RUN, *resume)],
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while _logged_steps(out) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert process.poll() is None, "training ended before the signal"
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("specforge train: stopped by " + signal.Signals(signum).name), last
    assert ("--resume" in last) != resuming and "Traceback" not in stderr
    assert "run the same command" in last
    saved = sorted(int(p.name.removeprefix("step_")) for p in (out / "checkpoints").iterdir())
    assert saved and saved[-1] >= 2 and f"step_{saved[-1]}" in last

    resumed = train(
        tiny_train_config(
            folder, data, out, *SLOW_RUN, "train.resume=true", f"train.max_steps={saved[-1] + 1}"
        )
    )
    assert resumed.checkpoint == out / "checkpoints" / f"step_{saved[-1] + 1}"


def test_resume_says_when_there_is_nothing_to_resume_or_to_train(
    tmp_path, peaked_target_dir, caplog
):
    folder, data = peaked_target_dir
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING):
        train(tiny_train_config(folder, data, out, "train.resume=true", "train.max_steps=2"))
    assert "holds no checkpoint: training from step 0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = train(
            tiny_train_config(folder, data, out, "train.resume=true", "train.max_steps=1")
        )
    assert "at step 2, past the 1 steps this run asks for" in caplog.text
    assert again.checkpoint is None
