"""Decode attention on CPU through a small C++ kernel (``csrc/decode_attention.cpp``), built on
first use with ``torch.utils.cpp_extension`` and cached by PyTorch (``~/.cache/torch_extensions``
or ``TORCH_EXTENSIONS_DIR``).

Why: self-distillation's continuous batching decodes one position for hundreds of rows a step,
and PyTorch's CPU flash kernel runs that shape as many tiny matrix products: on a 2-core Zen 4
EPYC, bf16, 256 rows with ~180 of 300 cached keys real, a layer's attention took 6.0 ms through
SDPA (16-row spans) and 2.7 ms here; 128 rows 3.1 and 0.95 ms. Per row and key head the kernel
reads each unmasked key and value row once (converting bf16 to float32 in registers), scores the
group's query heads against it in float32, and takes the softmax in float32 (SDPA's CPU kernel
rounds the probabilities to bf16 before weighting the values), so results agree with SDPA to
float rounding (tested).

It applies to x86-64 CPUs where PyTorch reports AVX-512, float32 or bfloat16, head size 64 or
128, 1-8 query heads per key head, and a boolean mask shared by the heads. Elsewhere, or where
it cannot be built (no C++ compiler or ninja), attention stays PyTorch's; ``regenerate.
decode_kernel: on`` turns that fallback into an error naming the reason.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specforge.data.kv_cache import current_decode_kernel_mode
from specforge.errors import UserError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
HEAD_SIZES = (64, 128)
MAX_GROUP = 8
"""Query heads per key head the kernel is built for (``1..MAX_GROUP``)."""
BUILD_FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp"]
"""AVX-512F intrinsics (no ``-march=native``: the cached build must not depend on the CPU that
built it beyond AVX-512F); OpenMP as PyTorch's own ``at::parallel_for`` runs it."""


@functools.cache
def load_decode_kernel() -> tuple[Callable | None, str | None]:
    """``(kernel, None)``, or ``(None, why it is unavailable)``; built once per process (PyTorch
    reuses a build whose source and flags are unchanged)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine().lower() not in ("x86_64", "amd64") or not capability.startswith("AVX512"):
        return None, f"it needs an x86-64 CPU with AVX-512 (PyTorch reports {capability})"
    from torch.utils.cpp_extension import load

    start = time.perf_counter()
    try:
        module = load(
            name="specforge_decode_attention",
            sources=[str(SOURCE)],
            extra_cflags=BUILD_FLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # no compiler or ninja, a failed build: PyTorch's attention
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return None, f"building it failed ({type(error).__name__}: {reason})"
    log.info("decode attention kernel ready in %.1f s", time.perf_counter() - start)
    return module.decode_attention, None


def kernel_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor | None:
    """Attention of one query position ``query`` (B, H, 1, D) over ``key``/``value``
    (B, H_kv, S, D) with ``mask`` (B or 1, 1, 1, S) bool or None, as HF's attention returns it:
    (B, 1, H, D). None where :func:`~specforge.data.kv_cache.decode_kernel_mode` is ``off``, and
    in ``auto`` off a CPU or where the kernel does not apply (with a warning, once per reason);
    ``on`` raises there instead."""
    mode = current_decode_kernel_mode()
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
