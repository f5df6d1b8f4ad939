"""Decode attention on CPU through a small C++ kernel (``csrc/decode_attention.cpp``), built on
first use with ``torch.utils.cpp_extension`` into a folder of its own
(``<TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions>/specforge_decode_attention-<hash>``, the
hash of the sources, the flags and the PyTorch version, so a changed kernel never meets an old
build). The same module carries the row-bucket linear op of compiled verification graphs
(``csrc/bucket_linear.cpp``, :mod:`specforge.engine.cpu.row_buckets`), so one build serves both.

Why: self-distillation's continuous batching decodes one position for hundreds of rows a step,
and PyTorch's CPU flash kernel runs that shape as many tiny matrix products. Per row and key
head the kernel reads each unmasked key and value row once (converting bf16 to float32 in
registers), scores the group's query heads against it in float32, and takes the softmax in
float32 (SDPA's CPU kernel rounds the probabilities to bf16 before weighting the values), so
results agree with SDPA to float rounding (tested). ``benchmarks/prepare_stages.py
--compare-decode-kernel`` measures what it buys.

It applies to x86-64 CPUs where PyTorch reports AVX-512, float32 or bfloat16, head size 64 or
128, 1-8 query heads per key head, and a boolean mask shared by the heads. Elsewhere, or where
it cannot be built (no C++ compiler or ninja, or a build past :data:`BUILD_TIMEOUT_S`),
attention stays PyTorch's; ``regenerate.decode_kernel: on`` turns that fallback into an error
naming the reason.

The build runs in a subprocess with a time limit, so a stuck build cannot hang the stage. A
build killed half-way (a resumed run's usual history) leaves PyTorch's ``lock`` file behind,
which makes every later ``load`` wait forever: each process that builds or loads records its
process id beside the lock (``load`` takes the lock on every call), and a lock whose holders are
all gone is removed as stale before the next build.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specforge.errors import UserError

log = logging.getLogger(__name__)

DECODE_KERNEL_MODES = ("auto", "on", "off")
"""``regenerate.decode_kernel``: see :class:`~specforge.config.RegenerateConfig`."""

NAME = "specforge_decode_attention"
CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "decode_attention.cpp", CSRC / "bucket_linear.cpp"]
"""The module's sources: the attention kernel, and the row-bucket linear op
(:mod:`specforge.engine.cpu.row_buckets`), built together so that one build serves both."""
HEAD_SIZES = (64, 128)
MAX_GROUP = 8
"""Query heads per key head the kernel is built for (``1..MAX_GROUP``)."""
BUILD_FLAGS = ["-O3", "-fopenmp"]
"""The kernel's functions carry their own AVX-512 target (a pragma in the source), so the rest
of the module, its import included, runs on any x86-64 CPU; OpenMP as PyTorch's own
``at::parallel_for`` runs it."""
BUILD_TIMEOUT_S = 600.0
"""A build (about half a minute on two cores) still running after this long is stopped, and
attention stays PyTorch's."""


def build_directory() -> Path:
    """Where this source, these flags and this PyTorch build the kernel."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path.home() / ".cache" / "torch_extensions"
    )
    digest = hashlib.sha256(b"".join(source.read_bytes() for source in SOURCES))
    digest.update(" ".join(BUILD_FLAGS).encode())
    digest.update(torch.__version__.encode())
    return Path(root) / f"{NAME}-{digest.hexdigest()[:12]}"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def builder_marker(directory: Path):
    """Record this process as one that may hold ``directory``'s ``lock`` while inside: PyTorch's
    ``load`` takes the lock on every call, a build or not, so a loading process is a builder."""
    marker = directory / f"build-{os.getpid()}.pid"
    marker.write_text(str(os.getpid()))
    try:
        yield
    finally:
        marker.unlink(missing_ok=True)


def clear_stale_lock(directory: Path) -> bool:
    """Remove PyTorch's build ``lock`` in ``directory`` when no process that loads or builds
    there is alive (each records ``build-<pid>.pid`` first, :func:`builder_marker`) and the lock
    is still the one seen before the markers were read (a live holder may release its lock and
    drop its marker in between, and the next one take a new lock); returns whether a stale lock
    was removed."""
    lock = directory / "lock"
    seen = _identity(lock)  # before the markers: a holder writes its marker before the lock
    owners = list(directory.glob("build-*.pid"))
    alive = [p for p in owners if _process_alive(int(p.stem.removeprefix("build-")))]
    for dead in set(owners) - set(alive):
        dead.unlink(missing_ok=True)
    if seen is not None and not alive and _identity(lock) == seen:
        lock.unlink(missing_ok=True)
        log.warning("removed a stale build lock in %s (its build was stopped)", directory)
        return True
    return False


def _identity(path: Path) -> tuple[int, int, int] | None:
    """Which file ``path`` is now (device, inode, modification time), or ``None`` if none."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_mtime_ns


def _load(directory: Path):
    """``torch.utils.cpp_extension.load`` of the kernel in ``directory`` (builds it when the
    source is newer than the build)."""
    from torch.utils.cpp_extension import load

    return load(
        name=NAME,
        sources=[str(source) for source in SOURCES],
        extra_cflags=BUILD_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(directory),
    )


def build_decode_kernel(timeout_s: float = BUILD_TIMEOUT_S):
    """Build the kernel if needed (in a subprocess, within ``timeout_s``) and import it.

    Raises:
        UserError: the build failed or ran past ``timeout_s`` (its lock is cleared).
    """
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(directory)
    if not (directory / f"{NAME}.so").is_file() or (directory / "lock").exists():
        log.info("building the CPU decode attention kernel (first use) in %s", directory)
        start = time.perf_counter()
        builder = subprocess.Popen(
            [sys.executable, "-m", __name__, str(directory)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its compiler processes go with it on a timeout
        )
        try:
            output, _ = builder.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(builder.pid, signal.SIGKILL)
            builder.wait()
            clear_stale_lock(directory)
            raise UserError(f"building it took more than {timeout_s:.0f} s") from None
        if builder.returncode != 0:
            last = (output or "").strip().splitlines()[-1:] or [f"exit {builder.returncode}"]
            raise UserError(f"building it failed ({last[0]})")
        log.info("decode attention kernel built in %.1f s", time.perf_counter() - start)
    with builder_marker(directory):
        return _load(directory)


def load_decode_kernel() -> tuple[Callable | None, str | None]:
    """``(kernel, None)``, or ``(None, why it is unavailable)``; built once per machine and
    loaded once per process."""
    module, missing = load_kernel_module()
    return (None, missing) if module is None else (module.decode_attention, None)


@functools.cache
def load_kernel_module():
    """``(the built module, None)``, or ``(None, why it is unavailable)``: the attention
    kernel, and ``register_bucket_linear`` (:mod:`specforge.engine.cpu.row_buckets`)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64") or not capability.startswith("AVX512"):
        return None, f"it needs an x86-64 CPU with AVX-512 (PyTorch reports {capability})"
    try:
        module = build_decode_kernel()
    except UserError as error:
        return None, str(error)
    except Exception as error:  # no compiler or ninja, an unloadable build: PyTorch's attention
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return None, f"building it failed ({type(error).__name__}: {reason})"
    return module, None


def check_decode_kernel_mode(mode: str) -> None:
    """Raises:
    ValueError: ``mode`` is not one of :data:`DECODE_KERNEL_MODES`."""
    if mode not in DECODE_KERNEL_MODES:
        raise ValueError(f"decode kernel mode must be one of {DECODE_KERNEL_MODES}, got {mode!r}")


def kernel_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    *,
    mode: str = "off",
) -> torch.Tensor | None:
    """Attention of one query position ``query`` (B, H, 1, D) over ``key``/``value``
    (B, H_kv, S, D) with ``mask`` (B or 1, 1, 1, S) bool or None, as HF's attention returns it:
    (B, 1, H, D). ``mode`` (``regenerate.decode_kernel``, passed down by the caller): None where
    it is ``off``, and in ``auto`` off a CPU or where the kernel does not apply (with a warning,
    once per reason); ``on`` raises there instead.

    Raises:
        ValueError: a ``mode`` not in :data:`DECODE_KERNEL_MODES`.
        UserError: ``on`` where the kernel cannot run.
    """
    check_decode_kernel_mode(mode)
    if mode == "off" or (mode == "auto" and query.device.type != "cpu"):
        return None  # a GPU's attention kernels are its own
    why = _unsupported(query, key, value, mask)
    kernel, missing = load_decode_kernel() if why is None else (None, why)
    if kernel is None:
        if mode == "on":
            raise UserError(f"regenerate.decode_kernel is on, but {missing}")
        _warn_once(missing)
        return None
    rows, heads, _, size = query.shape
    kv_heads = key.shape[1]
    if mask is None:
        mask = torch.ones(rows, key.shape[2], dtype=torch.bool, device=key.device)
    else:
        mask = mask.expand(rows, -1, -1, -1)[:, 0, 0]
    grouped = query.reshape(rows, kv_heads, heads // kv_heads, size)
    scale = size**-0.5 if scaling is None else scaling
    return kernel(grouped, key, value, mask, scale).reshape(rows, 1, heads, size)


def _unsupported(query, key, value, mask) -> str | None:
    """Why the kernel does not apply to these tensors, or None."""
    heads, kv_heads, size = query.shape[1], key.shape[1], query.shape[-1]
    checks = [
        (query.device.type == "cpu", f"it runs on CPU, not {query.device.type}"),
        (query.shape[2] == 1, "it decodes one position"),
        (
            query.dtype in (torch.float32, torch.bfloat16),
            f"it takes float32 or bf16, not {query.dtype}",
        ),
        (key.dtype == value.dtype == query.dtype, "queries, keys and values differ in dtype"),
        (size in HEAD_SIZES, f"it takes head sizes {HEAD_SIZES}, not {size}"),
        (
            heads % kv_heads == 0 and heads // kv_heads <= MAX_GROUP,
            f"it takes 1-{MAX_GROUP} query heads per key head, not {heads}/{kv_heads}",
        ),
        (key.stride(-1) == 1 and value.stride(-1) == 1, "keys/values are not contiguous along D"),
        (
            mask is None
            or (
                mask.dtype == torch.bool
                and mask.dim() == 4
                and mask.shape[1:3] == (1, 1)
                and mask.shape[3] == key.shape[2]
            ),
            "the mask is not one boolean mask over the keys shared by the heads",
        ),
    ]
    return next((why for ok, why in checks if not ok), None)


@functools.cache
def _warn_once(why: str) -> None:
    log.warning("decode attention: PyTorch's SDPA (specforge's CPU kernel unused: %s)", why)


def _build_here(directory: Path) -> None:
    """The build subprocess: record this process as a builder of ``directory``, then build."""
    with builder_marker(directory):
        _load(directory)


if __name__ == "__main__":
    _build_here(Path(sys.argv[1]))


def decode_attention_for(mode: str) -> Callable | None:
    """What a model's forward takes as ``decode_kernel`` for ``mode``: ``None`` (``off``), or
    ``(query, key, value, mask, scaling) -> output or None`` (:func:`kernel_decode_attention`
    in that mode), which the target's grouped attention calls on a one-position step."""
    check_decode_kernel_mode(mode)
    if mode == "off":
        return None
    return functools.partial(kernel_decode_attention, mode=mode)
