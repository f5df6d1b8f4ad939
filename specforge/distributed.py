"""torchrun process groups: which rank am I, and the frozen target's FSDP2 sharding.

Every stage runs unchanged under ``torchrun --nproc_per_node=N`` (and ``--nnodes``): it joins
the process group torchrun describes in the environment (gloo on CPU; on CUDA, nccl for CUDA
tensors and gloo for CPU ones).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from specforge.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    owns_group: bool = False
    """This stage joined the process group (and leaves it in :meth:`close`)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def agreed_max(self, value: float) -> float:
        """The largest of every rank's ``value`` (ranks that decide by a clock agree)."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor.item())

    def close(self) -> None:
        """Leave the process group if this stage joined it."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False

    def device(self, device: str) -> str:
        """This rank's device: ``cuda`` becomes ``cuda:<local_rank>`` under torchrun."""
        if device.startswith("cuda") and self.world_size > 1:
            return f"cuda:{self.local_rank}"
        return device


def check_device(device: str) -> None:
    """Refuse a device that is not present, before any loading.

    Raises:
        UserError: naming the device.
    """
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise UserError(f"unknown device {device!r} (cpu, cuda, cuda:1, ...)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} is not available here (no CUDA GPU); use cpu")


def setup_distributed(device: str) -> Distributed:
    """Join the torchrun process group when there is one (gloo on CPU; nccl and gloo on CUDA)."""
    check_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Distributed()
    # on CUDA, nccl for CUDA tensors and gloo for CPU ones (the metrics' counts, the clock)
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(backend=backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return Distributed(dist.get_rank(), world_size, local_rank, owns_group)


def shard_decoder_layers(layers: nn.ModuleList, device: str) -> None:
    """Shard each frozen decoder layer's weights across the ranks with FSDP2 ``fully_shard``.

    Each layer's full weights exist only while it runs (all-gathered in its forward, freed
    after). The embedding, final norm and ``lm_head`` are left whole: the draft copies the
    embedding and the loss reads ``lm_head`` directly.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.split(":")[0], (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    local = sum(p.to_local().numel() for p in layers.parameters())
    full = sum(p.numel() for p in layers.parameters())
    logger.info(
        "target decoder layers sharded with FSDP2 over %d ranks: %d of %d parameters here",
        dist.get_world_size(),
        local,
        full,
    )
