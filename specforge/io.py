"""Atomic file writes: everything the project writes goes through a temp file and a rename, so
an interrupted run never leaves a half-written file where a finished one is expected."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder (``.<name>.*.tmp``), fsync
    and rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_jsonl_atomic(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Write one JSON object per line to ``path`` atomically."""
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON to ``path`` atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


@contextmanager
def atomic_directory(final: str | Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temp folder next to ``final``; when the block succeeds it is renamed to ``final``.

    With ``replace=False`` an existing ``final`` (say, written meanwhile by another rank) is
    kept and the temp folder discarded. On error nothing is left behind.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            if not replace:
                return
            shutil.rmtree(final)
        try:
            tmp.rename(final)
        except OSError:
            if replace or not final.exists():  # not a concurrent writer that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
