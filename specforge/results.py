"""Measurements as data: the provenance every benchmark records, and the results page.

A results file is one JSON object. Benchmarks write it through :func:`write_result`, which adds
the provenance (:func:`provenance`: date, commit, machine, library versions, command) to what
they measured. A file kept under ``docs/results/`` also carries a ``title``, a one-line
``summary`` and the ``figures`` worth showing (a flat mapping, or a table of ``columns`` and
``rows``), and optionally an ``image`` beside it, ``notes`` (the run's longer story, kept in
the file only), ``"kind": "decision"`` for an A/B that chose
a setting (else it is a current figure) and ``"alone": true`` when nothing else ran on the
machine during the measurement. ``docs/results.md`` is rendered from those files by
:func:`render_results_page` (``python -m specforge.docgen``), and a test fails when the two
differ. Each file is one run: one commit, the exact command. Superseded runs are deleted from
``docs/results/``: git keeps them.

Example::

    write_result("out/verify_cost.json", {"rows": rows})   # + date, commit, machine, versions
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from specforge.errors import UserError
from specforge.io import write_json_atomic

PROVENANCE_KEYS = ("date", "commit", "machine", "versions", "command")
"""What every results file records about the run that made it."""

PAGE_KEYS = ("title", "summary", "figures")
"""What a file under ``docs/results/`` adds for the results page."""

KINDS = {"figure": "Current figures", "decision": "Decisions (A/B)"}
"""The results page's sections, by a file's ``kind`` (default ``figure``)."""

LIBRARIES = ("torch", "transformers", "specforge-eagle3")
"""The distributions whose versions a results file records (with Python's)."""


def _git_commit() -> str | None:
    """The checkout's short commit (``-dirty`` with uncommitted changes to tracked files), or
    ``None`` outside a git checkout."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        if done.returncode:
            raise OSError(done.stderr)
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except OSError:
        return None
    return f"{head}-dirty" if dirty else head


def _cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what :mod:`platform` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe_machine() -> str:
    """One line naming the CPU, its cores, the memory and any CUDA GPU, e.g. ``AMD EPYC 9R14,
    2 cores, 24 GB; no GPU``."""
    import torch

    cpu = f"{_cpu_name()}, {os.cpu_count()} cores"
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        cpu += f", {pages / 2**30:.0f} GB"
    except (ValueError, OSError, AttributeError):
        pass
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{cpu}; {len(gpus)} x {gpus[0]}"
    return f"{cpu}; no GPU"


def library_versions() -> dict[str, str | None]:
    """Python's version and each of :data:`LIBRARIES`' (``None`` where not installed)."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance(command: list[str] | None = None) -> dict[str, Any]:
    """Where a measurement comes from: today's date (UTC), the commit, the machine, the library
    versions and the command line (default: this process's ``sys.argv``)."""
    argv = sys.argv if command is None else command
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "commit": _git_commit(),
        "machine": describe_machine(),
        "versions": library_versions(),
        "command": shlex.join(["python", *argv] if argv and argv[0].endswith(".py") else argv),
    }


def write_result(path: str | Path, measured: dict[str, Any], /, **page: Any) -> dict[str, Any]:
    """Write what a benchmark measured with its :func:`provenance`, atomically.

    Args:
        path: the JSON file.
        measured: the benchmark's results (kept whole under their own keys; the provenance's
            keys replace any of the same name).
        page: optional ``title``, ``summary`` and ``figures`` for the results page.

    Returns:
        The record written.
    """
    record = {**measured, **provenance(), **page}
    write_json_atomic(Path(path), record)
    return record


# ---------------------------------------------------------------------------------------------
# The results page


def load_results(folder: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(file stem, record)`` of every ``*.json`` in ``folder``, sorted by name.

    Raises:
        UserError: a file that is not JSON, or lacks a provenance or page key.
    """
    records = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise UserError(f"{path}: not a JSON results file ({err})") from None
        missing = [key for key in (*PAGE_KEYS, *PROVENANCE_KEYS) if key not in record]
        if missing:
            raise UserError(f"{path}: a results file needs {missing}")
        if record.get("kind", "figure") not in KINDS:
            raise UserError(f"{path}: kind {record['kind']!r} is not one of {sorted(KINDS)}")
        records.append((path.stem, record))
    return records


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,d}" if abs(value) >= 1e4 else str(value)
    if value is None:
        return "-"
    if value == "":
        return ""
    return str(value).replace("|", "\\|").replace("\n", " ")


PAIRS_A_ROW_FROM = 6
"""A flat ``figures`` mapping longer than this is shown two figures a row."""


def _figures_table(figures: Any) -> list[str]:
    """Markdown rows of a ``figures`` entry: a mapping (two columns) or ``{columns, rows}``."""
    if isinstance(figures, dict) and set(figures) == {"columns", "rows"}:
        columns, rows = figures["columns"], figures["rows"]
    else:
        pairs = [[key, value] for key, value in figures.items()]
        columns, rows = ["figure", "value"], pairs
        if len(pairs) > PAIRS_A_ROW_FROM:  # a long mapping: two figures a row
            half = (len(pairs) + 1) // 2
            columns = columns * 2
            rows = [a + b for a, b in zip(pairs[:half], pairs[half:] + [["", ""]], strict=False)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines


def figures_markdown(figures: Any) -> str:
    """A ``figures`` entry as the markdown table the results page shows (what a benchmark
    prints when it ends)."""
    return "\n".join(_figures_table(figures))


def _versions(versions: dict[str, Any]) -> str:
    return ", ".join(f"{name} {version}" for name, version in versions.items() if version)


def _entry(stem: str, record: dict[str, Any]) -> list[str]:
    """One run on the results page: its title, summary, provenance and command, figures."""
    where = [
        record["date"],
        f"commit `{record['commit']}`",
        record["machine"],
        _versions(record["versions"]),
        f"[`{stem}.json`](results/{stem}.json)",
    ]
    if record.get("alone"):
        where.append("nothing else ran")
    lines = [
        f'### <a id="{stem}"></a>{record["title"]}',
        f"{record['summary']}<br><sub>{' · '.join(where)}</sub><br>`{record['command']}`",
        "",
        *_figures_table(record["figures"]),
        "",
    ]
    if record.get("image"):
        lines += [f"![{record['title']}](results/{record['image']})", ""]
    return lines


def render_results_page(folder: str | Path) -> str:
    """``docs/results.md``: the current figures, then the decisions (A/B), one entry per
    results file (title, summary, where it comes from, the command, the figures)."""
    records = load_results(folder)
    lines = [
        "# Results",
        "",
        "<!-- Generated by `python -m specforge.docgen` from docs/results/*.json; do not edit. -->",
        "",
        "Each entry is one run: the command shown, at the commit named, on the machine named; "
        "the JSON beside this page holds its full output. Current figures first, then the A/B "
        "runs that chose a default. Superseded runs are in git history.",
    ]
    for kind, heading in KINDS.items():
        lines += ["", f"## {heading}", ""]
        for stem, record in records:
            if record.get("kind", "figure") == kind:
                lines += _entry(stem, record)
    return "\n".join(lines).rstrip("\n") + "\n"
