"""The benchmark scripts stay runnable code: each imports what it uses and parses its
arguments (``--help``, all in one interpreter), and none imports another script; what several
share lives in ``benchmarks/common.py``. (Two scripts had broken unseen: an attribute the
runtime split removed, a function a refactor moved.)"""

import ast
import subprocess
import sys

from tests.helpers import REPO

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
