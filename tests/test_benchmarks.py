"""The benchmark scripts stay runnable code: each imports what it uses and parses its
arguments (``--help``, all in one interpreter), runs end to end with ``--smoke`` on the suite's
tiny target, draft and data, and none imports another script; what several share lives in
``benchmarks/common.py``. (Two scripts had broken unseen: an attribute the runtime split
removed, a function a refactor moved.)"""

import ast
import json
import os
import subprocess
import sys

import pytest

from specforge.cli import main
from specforge.recipes.train import train
from tests.helpers import (
    REPO,
    TINY_STEP_BY_STEP,
    tiny_train_config,
    tiny_train_overrides,
    write_peaked_target,
)

BENCHMARKS = REPO / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.name != "common.py")

RUN_HELP = """
import runpy, sys
failed = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        if done.code not in (0, None):
            failed.append(f"{path}: exit {done.code}")
    except Exception as error:
        failed.append(f"{path}: {type(error).__name__}: {error}")
print("FAILED", failed)
"""


def test_every_benchmark_script_imports_and_parses_its_arguments():
    done = subprocess.run(
        [sys.executable, "-c", RUN_HELP, *map(str, SCRIPTS)],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": f"{BENCHMARKS}:{REPO}", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "FAILED []", done.stdout[-3000:]


def test_no_benchmark_script_imports_another():
    names = {p.stem for p in SCRIPTS}
    for script in SCRIPTS:
        tree = ast.parse(script.read_text())
        imported = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            node.module.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        assert not imported & names, f"{script.name} imports {sorted(imported & names)}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_inputs(tmp_path_factory.mktemp("smoke"))


def tiny_inputs(root, **target) -> dict:
    """The smoke runs' inputs: a tiny target (``target``: its shape), its conversations, a
    trained run with an export inside (what ``--start`` takes), two MT-Bench-format questions
    and four GSM8K records."""
    folder, data = write_peaked_target(root, **target)
    run = root / "run"
    checkpoint = train(tiny_train_config(folder, data, run, "train.max_steps=2")).checkpoint
    assert main(["export", str(checkpoint), str(run / "export"), "--dtype", "float32"]) == 0
    questions = root / "question.jsonl"
    asked = [{"question_id": i, "category": "x", "turns": [f"count {i}", "again"]} for i in (1, 2)]
    questions.write_text("".join(json.dumps(q) + "\n" for q in asked))
    gsm8k = root / "gsm8k.jsonl"
    records = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(4)]
    gsm8k.write_text("".join(json.dumps(r) + "\n" for r in records))
    return {
        "target": str(folder),
        "data": str(data),
        "run": str(run),
        "export": str(run / "export"),
        "questions": str(questions),
        "gsm8k": str(gsm8k),
        "out": root / "out",
    }


def _tiny_recipe(t, *, family_options: bool = True) -> list[str]:
    """The tiny recipe's overrides for a script that trains from a shipped recipe (its own
    data, output and budget set by the script); without the step-by-step families' own
    options where the script trains every family."""
    kept = ("target.", "train.dtype", "train.lr", "train.log")
    kept += ("vocab.", "train.ttt_length") if family_options else ()
    return [o for o in tiny_train_overrides(t["target"], t["data"], "-") if o.startswith(kept)]


SMOKE = {
    "accept_length": lambda t, o: (
        ["--target", t["target"], "--draft", t["export"]]
        + ["--questions", t["questions"], "--metrics", f"{t['run']}/metrics.jsonl", "--output", o]
    ),
    "adaptive_depth": lambda t, o: (
        ["--target", t["target"], "--draft", t["export"]]
        + ["--questions", t["questions"], "--prompt-lookup", "4", "--output", f"{o}.json"]
    ),
    "baseline_decoding": lambda t, o: (
        ["--target", t["target"], "--questions", t["questions"]] + ["--output", f"{o}.json"]
    ),
    "decode_step": lambda t, o: (
        ["--target", t["target"], "--dtype", "float32"]
        + ["--profile", "1", "--output", f"{o}.json"]
    ),
    "verify_cost": lambda t, o: ["--target", t["target"], "--engine", "--output", f"{o}.json"],
    "engine_speedup": lambda t, o: (
        ["--target", t["target"], "--draft", t["export"]]
        + ["--questions", t["questions"], "--output", o]
    ),
    "round_overhead": lambda t, o: (
        ["--before", "HEAD", "--target", t["target"]]
        + ["--draft", t["export"], "--questions", t["questions"], "--setting", "auto"]
        + ["--output", o]
    ),
    "train_throughput": lambda t, o: (
        ["--output", f"{o}.json", f"train.data_path={t['data']}"] + _tiny_recipe(t)
    ),
    "draft_family_ab": lambda t, o: (
        ["--data", t["data"], "--questions", t["questions"]]
        + ["--arm", "eagle3", "eagle3", *TINY_STEP_BY_STEP, "--arm", "peagle", "peagle"]
        + [*TINY_STEP_BY_STEP, "--arm", "dflash", "dflash", "draft.dflash.block_size=4"]
        + ["--output", o, *_tiny_recipe(t, family_options=False)]
    ),
    "finetune_pretrained": lambda t, o: (
        ["--start", t["run"], "--gsm8k", t["gsm8k"]] + ["--mt-bench", t["questions"], "--output", o]
    ),
    "on_policy_ab": lambda t, o: (
        ["--start", t["run"], "--set", f"mt_bench={t['questions']}"] + ["--output", o]
    ),
    # its subject is the embedded target's GGUF conversion and regeneration: that target
    "prepare_stages": lambda t, o: (
        ["--conversations", t["data"], "--dtype", "float32"] + ["--output", f"{o}.json"]
    ),
    "real_size": lambda t, o: (
        ["--device", "cpu", "--data", t["data"]] + ["--tokenizer", t["target"], "--output", o]
    ),
    "data_scaling": lambda t, o: (
        ["--questions", t["questions"], "--gsm8k", t["gsm8k"]] + ["--output", o, *_tiny_recipe(t)]
    ),
    "cuda_checks": lambda t, o: (
        ["--device", "cpu", "--target", t["target"]]
        + ["--draft", t["export"], "--questions", t["questions"], "--output", o]
        + ["--only", "decode step"]  # the other stages are scripts smoke-run here themselves
    ),
    "vllm_agreement": lambda t, o: (
        ["--vllm-python", t["vllm_python"], "--target", t["target"]]
        + ["--export", f"tiny={t['export']}:3:{t['bench']}", "--questions", t["questions"]]
        + ["--output", o, "--result", f"{o}.json", "--vllm-flags=--max-model-len 512"]
    ),
}
"""Each script's inputs for ``--smoke``."""


def test_every_benchmark_script_has_a_smoke_run():
    assert sorted(SMOKE) == sorted(p.stem for p in SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(SMOKE) - {"vllm_agreement"}))
def test_a_benchmark_script_runs_end_to_end_with_smoke(tiny, name):
    smoke(name, tiny)


@pytest.mark.slow
@pytest.mark.integration
def test_the_vllm_agreement_script_runs_end_to_end_with_smoke(tmp_path, vllm_python):
    """In vLLM's own environment (the ``vllm_python`` fixture of ``conftest.py``), on a target
    vLLM's CPU attention serves (64-wide heads, 8 layers: tests/serving/test_vllm_client.py)."""
    inputs = tiny_inputs(tmp_path, hidden=256, num_layers=8)
    bench = tmp_path / "bench"  # the built-in bench vLLM's is compared with
    arguments = ["--target", inputs["target"], "--draft", inputs["export"], "--num-steps", "3"]
    arguments += ["--questions", inputs["questions"], "--max-new-tokens", "8"]
    assert main(["bench", *arguments, "--output", str(bench)]) == 0
    smoke(
        "vllm_agreement", {**inputs, "bench": str(bench / "bench.json"), "vllm_python": vllm_python}
    )


def smoke(name: str, tiny: dict) -> None:
    """``benchmarks/NAME.py --smoke`` on the tiny inputs; it must finish cleanly."""
    out = tiny["out"] / name
    done = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", "--smoke", *SMOKE[name](tiny, str(out))],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-4000:])
