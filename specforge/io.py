"""Files: atomic writes (everything the project writes goes through a temp file and a rename, so
an interrupted run never leaves a half-written file where a finished one is expected) and the one
JSON-lines reader, which names the file and line of anything it cannot read."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from specforge.errors import UserError

logger = logging.getLogger(__name__)


class BadLine(UserError):
    """A JSON-lines line that is not UTF-8 or not JSON; the message names the file and line."""

    def __init__(self, path: Path, number: int, reason: str):
        super().__init__(f"{path}: line {number}: {reason}")
        self.number = number
        self.reason = reason


LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".yaml", ".yml", ".gguf")


def looks_local(name: str) -> bool:
    """Whether a model or dataset argument names a local path rather than an HF hub id
    (``owner/name``): it starts with ``.``, ``/`` or ``~``, has more than two parts, or ends
    with a file suffix. Such a name that does not exist is a local mistake, reported at once
    instead of after the hub's retries."""
    return (
        name.startswith((".", "/", "~"))
        or len(Path(name).parts) > 2
        or Path(name).suffix.lower() in LOCAL_SUFFIXES
    )


def require_local(name: str, what: str) -> None:
    """Raise :class:`UserError` when ``name`` looks local (:func:`looks_local`) and does not
    exist."""
    if looks_local(name) and not Path(name).expanduser().exists():
        raise UserError(f"{what} {name!r}: no such file or folder")


def _parse_line(path: Path, number: int, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise BadLine(path, number, f"not UTF-8 (byte {err.start} of the line)") from None
    except json.JSONDecodeError as err:
        raise BadLine(path, number, f"invalid JSON ({err.msg})") from None


def iter_jsonl(path: str | Path, *, strict: bool = True) -> Iterator[tuple[int, Any]]:
    """Yield ``(line number, value)`` for every non-blank line of a JSON-lines file.

    Args:
        path: the file.
        strict: raise :class:`BadLine` at the first unreadable line; otherwise yield the
            :class:`BadLine` as that line's value and go on (readers that skip and count).
    """
    path = Path(path)
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                value = _parse_line(path, number, raw)
            except BadLine as bad:
                if strict:
                    raise
                value = bad
            yield number, value


def read_jsonl(path: str | Path, *, repair: bool = False) -> list[Any]:
    """Every record of a JSON-lines file (``[]`` when it does not exist).

    Args:
        path: the file.
        repair: a last line without its newline (torn by a kill) is cut off the file, with a
            warning, instead of being an error. For files this project appends to.

    Raises:
        BadLine: an unreadable line (or a torn last line without ``repair``).
    """
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # tail is b"" when the file ends with a newline
    records = [
        _parse_line(path, number, line)
        for number, line in enumerate(complete, start=1)
        if line.strip()
    ]
    if tail.strip():
        if not repair:
            raise BadLine(path, len(lines), "incomplete last line (no newline)")
        logger.warning("%s: dropping an incomplete last line left by an interrupted run", path)
        with path.open("r+b") as f:
            f.truncate(len(data) - len(tail))
    return records


def append_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Append records to a JSON-lines file with one write and an fsync (a kill leaves at most
    a torn last line, which :func:`read_jsonl` with ``repair`` removes); its folder is created
    when missing."""
    payload = "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(16 * 2**20):
            digest.update(block)
    return digest.hexdigest()


def file_problem(path: Path, sha256: str, size: int | None = None) -> str | None:
    """Why ``path`` is not the file that was recorded (missing, another size, another sha256),
    said after its name, or ``None`` when it is."""
    if not path.is_file():
        return "is missing"
    if (size is not None and path.stat().st_size != size) or file_sha256(path) != sha256:
        return "is corrupted or truncated (its size or sha256 differs from the one recorded)"
    return None


def read_safetensors(path: str | Path) -> dict[str, Any]:
    """A safetensors file's tensors.

    Raises:
        UserError: a missing, truncated or damaged file, named.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise UserError(f"{path} cannot be read ({err}): truncated or damaged") from None


def read_json(path: str | Path) -> Any:
    """A JSON file's value.

    Raises:
        UserError: a missing, truncated or damaged file, named.
    """
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path} cannot be read ({err})") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err}): truncated or damaged") from None


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

    An existing ``final`` is replaced only once the new folder is complete: it is moved aside,
    the new one renamed into place, then the old one removed. Callers decide beforehand whether
    ``final`` is theirs to replace. With ``replace=False`` an existing ``final`` (say, written
    meanwhile by another rank) is kept and the temp folder discarded. On error nothing is left
    behind. The folder gets the permissions the user's umask gives (not ``mkdtemp``'s 0700).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        yield tmp
        mask = _umask()
        for path in tmp.rglob("*"):  # some writers (safetensors) create files 0600
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)
        if not final.exists():
            try:
                tmp.rename(final)
            except OSError:
                if replace or not final.exists():  # not a concurrent writer that won the race
                    raise
        elif replace:
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}-old-", dir=final.parent))
            try:
                final.rename(old / final.name)
            except OSError:
                old.rmdir()  # nothing was moved: leave no trace of the attempt
                raise
            tmp.rename(final)
            shutil.rmtree(old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
