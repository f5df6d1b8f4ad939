"""The draft's optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from specforge.config import TrainConfig


def lr_factor(
    step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float, time_fraction: float = 0.0
) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at ``max_steps``, or sooner
    when ``time_fraction`` (the share of a wall-clock budget spent) is further along."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = max((step - warmup_steps) / max(max_steps - warmup_steps, 1), time_fraction)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def set_lr(
    optimizer: torch.optim.Optimizer, tc: TrainConfig, step: int, time_fraction: float = 0.0
) -> float:
    """Set the learning rate of optimizer step ``step`` on every parameter group (``time_fraction``:
    the share of ``train.max_minutes`` spent); returns it."""
    lr = tc.lr * lr_factor(
        step,
        warmup_steps=tc.warmup_steps,
        max_steps=tc.max_steps,
        min_lr_ratio=tc.min_lr_ratio,
        time_fraction=time_fraction,
    )
    return apply_lr(optimizer, lr)


def apply_lr(optimizer: torch.optim.Optimizer, lr: float) -> float:
    """Set ``lr`` on every parameter group; returns it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def build_optimizer(params: list[torch.nn.Parameter], tc: TrainConfig, world_size: int):
    """AdamW (fused: runs on CPU and CUDA, ~4x the default's speed on the draft); its state
    sharded across ranks (ZeRO-1, ``ZeroRedundancyOptimizer``) with ``train.zero_optimizer``."""
    adamw = {"lr": tc.lr, "weight_decay": tc.weight_decay, "fused": True}
    if tc.zero_optimizer and world_size > 1:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, **adamw)
    return torch.optim.AdamW(params, **adamw)
