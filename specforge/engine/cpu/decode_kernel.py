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

The build runs in a subprocess with a time limit (its whole process group killed past it), so
a stuck build cannot hang the stage. Every process that builds or loads the kernel holds an
``flock`` on the folder's ``specforge.lock`` (:func:`exclusive`), waiting a bounded time for
another holder; the OS releases it when its holder dies. A build killed half-way (a resumed
run's usual history) leaves PyTorch's own ``lock`` file behind, on which PyTorch's ``load``
would wait forever: found while holding the flock, it can only be a killed build's, and is
removed.
"""

from __future__ import annotations

import contextlib
import fcntl
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
from specforge.processes import start_group, stop_group

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


LOCK_NAME = "specforge.lock"
"""The file whose ``flock`` every process that builds or loads the kernel in a folder holds."""


@contextlib.contextmanager
def exclusive(directory: Path, timeout_s: float):
    """Hold ``directory``'s lock (an ``fcntl.flock`` on :data:`LOCK_NAME`), waiting at most
    ``timeout_s`` seconds for another holder. The OS releases it when its holder dies, however
    it dies, so no lock outlives a killed process; and since every builder and loader holds it,
    a PyTorch build ``lock`` found while holding it was left by a killed build.

    Raises:
        UserError: another process held it for ``timeout_s`` seconds.
    """
    path = directory / LOCK_NAME
    deadline = time.monotonic() + timeout_s
    with path.open("a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UserError(
                        f"waited {timeout_s:.0f} s for another process building or loading the "
                        f"kernel in {directory} (it holds {path})"
                    ) from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _clear_stale_baton(directory: Path) -> None:
    """Remove PyTorch's build ``lock`` in ``directory``, which PyTorch's ``load`` would wait on
    forever; only ever called while holding :func:`exclusive`, when it can only be a killed
    build's."""
    baton = directory / "lock"
    if baton.exists():
        baton.unlink(missing_ok=True)
        log.warning("removed a stale build lock in %s (its build was stopped)", directory)


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
    with exclusive(directory, timeout_s):
        _clear_stale_baton(directory)
        if not (directory / f"{NAME}.so").is_file():
            _build(directory, timeout_s)
        return _load(directory)


def _build(directory: Path, timeout_s: float) -> None:
    """Build the kernel in a subprocess (its process group killed after ``timeout_s``, its
    leftover build lock cleared); the caller holds :func:`exclusive`.

    Raises:
        UserError: the build failed or ran past ``timeout_s``.
    """
    log.info("building the CPU decode attention kernel (first use) in %s", directory)
    start = time.perf_counter()
    builder = start_group(  # its compiler processes go with it on a timeout
        [sys.executable, "-m", __name__, str(directory)],
        death_signal=signal.SIGKILL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = builder.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(builder, grace=0)
        _clear_stale_baton(directory)
        raise UserError(f"building it took more than {timeout_s:.0f} s") from None
    if builder.returncode != 0:
        last = (output or "").strip().splitlines()[-1:] or [f"exit {builder.returncode}"]
        raise UserError(f"building it failed ({last[0]})")
    log.info("decode attention kernel built in %.1f s", time.perf_counter() - start)


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


if __name__ == "__main__":  # the build subprocess (its parent holds the lock)
    _load(Path(sys.argv[1]))


def decode_attention_for(mode: str) -> Callable | None:
    """What a model's forward takes as ``decode_kernel`` for ``mode``: ``None`` (``off``), or
    ``(query, key, value, mask, scaling) -> output or None`` (:func:`kernel_decode_attention`
    in that mode), which the target's grouped attention calls on a one-position step."""
    check_decode_kernel_mode(mode)
    if mode == "off":
        return None
    return functools.partial(kernel_decode_attention, mode=mode)
