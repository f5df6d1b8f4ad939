"""What a stage applies when it starts, and what importing the package does not: the oneDNN
cache cap goes into the environment when a stage starts, and ``auto`` values are resolved on
the machine that runs the stage and recorded in its outputs (a loaded config keeps ``auto``)."""

import json
import os
import subprocess
import sys

from specforge.cli import main
from specforge.config import load_config
from specforge.config.resolve import bfloat16_is_fast
from specforge.recipes.stage import ONEDNN_PRIMITIVE_CACHE_CAPACITY, start_stage

CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def test_importing_the_package_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k != CACHE_VARIABLE}
    code = f"import os, specforge, specforge.cli; print(os.environ.get('{CACHE_VARIABLE}'))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "None"


def test_a_stage_caps_the_onednn_cache_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv(CACHE_VARIABLE, raising=False)
    start_stage(load_config(None))
    assert os.environ[CACHE_VARIABLE] == ONEDNN_PRIMITIVE_CACHE_CAPACITY
    monkeypatch.setenv(CACHE_VARIABLE, "64")
    start_stage(load_config(None))
    assert os.environ[CACHE_VARIABLE] == "64"


def test_auto_is_resolved_when_the_stage_starts_and_recorded(tmp_path, tiny_target_dir):
    out = tmp_path / "conversations.jsonl"
    code = main(
        ["prepare", "--target", str(tiny_target_dir), "--limit", "2", "--output", str(out)]
        + ["target.dtype=auto", "train.dtype=auto"]
    )
    assert code == 0
    recorded = json.loads((tmp_path / "conversations.stats.json").read_text())["config"]
    expected = "bfloat16" if bfloat16_is_fast("cpu") else "float32"
    assert recorded["target"]["dtype"] == recorded["train"]["dtype"] == expected
    assert recorded["bench"]["draft_quantize"] in ("int8", "none")
