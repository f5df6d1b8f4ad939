"""Hardware ``auto`` values made concrete for the running machine, and dtype names as torch
dtypes: the one config module that imports torch (and probes the hardware)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from specforge.config.base import ConfigError
from specforge.errors import UserError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
"""Config dtype names -> torch dtypes (the one table every stage uses)."""


def bfloat16_is_fast(device: str) -> bool:
    """Whether bfloat16 matmuls outrun float32 ones on ``device``: a CUDA GPU with bfloat16
    support, or a CPU with bfloat16 dot-product instructions: AMX tiles (Intel Sapphire Rapids
    and later) or AVX512-BF16 (AMD Zen 4/5, Intel Cooper Lake). Without either, a CPU emulates
    bfloat16 and runs it slower than float32."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if kind == "cpu":
        probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
        return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)
    return False


def int8_linear_available() -> bool:
    """Whether this PyTorch has the weight-only int8 kernel that ``bench.draft_quantize: int8``
    multiplies with (:mod:`specforge.engine.cpu.int8_linear`)."""
    return hasattr(torch, "_weight_int8pack_mm")


def resolve_auto_dtype(name: str, device: str) -> str:
    """``name``, or for ``auto`` the faster of ``bfloat16`` / ``float32`` on ``device``
    (:func:`bfloat16_is_fast`)."""
    if name != "auto":
        return name
    return "bfloat16" if bfloat16_is_fast(device) else "float32"


def resolve_draft_quantize(name: str, draft_dtype: str, device: str) -> str:
    """``bench.draft_quantize`` made concrete: ``auto`` is ``int8`` for a bfloat16 draft on a
    CPU that runs bfloat16 fast, where this PyTorch has the kernel, else ``none``.

    Raises:
        ConfigError: ``int8`` with another draft dtype or device.
    """
    on_cpu = torch.device(device).type == "cpu"
    if name == "auto":
        fits = on_cpu and draft_dtype == "bfloat16" and bfloat16_is_fast(device)
        return "int8" if fits and int8_linear_available() else "none"
    if name == "int8" and not (on_cpu and draft_dtype == "bfloat16"):
        raise ConfigError(
            f"bench.draft_quantize int8 needs bench.draft_dtype bfloat16 on a CPU; got "
            f"{draft_dtype!r} on {device!r}"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name.

    Raises:
        UserError: an unknown name.
    """
    if name not in TORCH_DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def resolve_auto(cfg: Any) -> Any:
    """``cfg`` (a :class:`~specforge.config.SpecForgeConfig`) with its hardware-dependent
    ``auto`` values made concrete for the running machine: ``target.dtype``, ``train.dtype``
    and ``train.compile`` (the draft trains on the target's device), ``bench.draft_dtype`` and
    ``bench.draft_quantize``; ``engine.compile`` depends on the target and the run too, and is
    resolved when the engine is built (:func:`specforge.engine.target.build_engine`). A loaded
    config keeps ``auto``, so it means the same on every machine; each stage resolves it when
    it starts and records the result in its outputs. Concrete values are kept as they are.

    Raises:
        ConfigError: ``bench.draft_quantize: int8`` with a draft dtype or device it cannot run.
    """
    device = cfg.target.device
    draft_dtype = resolve_auto_dtype(cfg.bench.draft_dtype, device)
    return dataclasses.replace(
        cfg,
        target=dataclasses.replace(cfg.target, dtype=resolve_auto_dtype(cfg.target.dtype, device)),
        train=dataclasses.replace(
            cfg.train,
            dtype=resolve_auto_dtype(cfg.train.dtype, device),
            compile=resolve_train_compile(cfg.train.compile, device),
        ),
        bench=dataclasses.replace(
            cfg.bench,
            draft_dtype=draft_dtype,
            draft_quantize=resolve_draft_quantize(cfg.bench.draft_quantize, draft_dtype, device),
        ),
    )


def resolve_train_compile(value: str, device: str) -> str:
    """``train.compile``'s ``auto`` for ``device``: ``false`` (see :class:`TrainConfig`)."""
    del device  # measured the same way on a CPU and a GPU so far
    return "false" if value == "auto" else value
