"""Host syncs inside a forward that is to be captured: operations whose result the host reads
(``.item()``, ``bool(tensor)``, ``nonzero``, ``equal``, a copy from a device to the CPU).

A CUDA graph cannot capture them ("operation not permitted when stream is capturing") and
``torch.compile(fullgraph=True)`` stops at the branch they feed (transformers' dynamic RoPE
compares a position tensor with its cached length in Python). :func:`host_sync` runs a
function once, eagerly, under a :class:`~torch.utils._python_dispatch.TorchDispatchMode` that
sees every ATen operation, and returns the first such operation with the module that ran it,
so the engine can refuse (or fall back) before it compiles or captures anything.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = frozenset(
    {
        "aten::_local_scalar_dense",  # .item(), bool(), int(), float() of a tensor
        "aten::is_nonzero",
        "aten::nonzero",  # an output whose size depends on the data
        "aten::equal",
        "aten::allclose",
    }
)
"""ATen operations whose result the host waits for, whatever the device."""


@dataclass(frozen=True)
class HostSync:
    """Where a forward read a tensor's value on the host."""

    op: str
    """The ATen operation (``aten::_local_scalar_dense``, ...)."""
    module: str
    """The innermost module that ran it, by its name in the model and class
    (``model.rotary_emb (LlamaRotaryEmbedding)``), or ``?`` outside any module."""

    def __str__(self) -> str:
        return f"{self.module} reads a tensor on the host ({self.op})"


class _Found(Exception):
    def __init__(self, sync: HostSync):
        super().__init__(str(sync))
        self.sync = sync


class _SyncDetector(TorchDispatchMode):
    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names = names

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in SYNCING_OPS or _copies_to_host(name, args, kwargs):
            raise _Found(HostSync(name, self._module()))
        return func(*args, **kwargs)

    def _module(self) -> str:
        frame = inspect.currentframe()
        while frame is not None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and (id(owner) in self.names or not self.names):
                return f"{self.names.get(id(owner), '?')} ({type(owner).__name__})"
            frame = frame.f_back
        return "?"


def _copies_to_host(name: str, args, kwargs) -> bool:
    """A copy whose source is on an accelerator and whose destination is the CPU."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name == "aten::copy_" and len(tensors) >= 2:
        return tensors[0].device.type == "cpu" and tensors[1].device.type != "cpu"
    if name == "aten::_to_copy" and tensors:
        device = kwargs.get("device")
        return tensors[0].device.type != "cpu" and device is not None and device.type == "cpu"
    return False


def host_sync(model: nn.Module | None, run, *args, **kwargs) -> HostSync | None:
    """Run ``run(*args, **kwargs)`` once, eagerly, and return the first host sync it makes (the
    modules of ``model`` name where; any module by its class without one), or ``None``. The run
    stops at that operation: whatever it wrote before stays written (run it on a scratch
    cache)."""
    modules = [] if model is None else model.named_modules()
    names = {id(module): name or type(model).__name__ for name, module in modules}
    try:
        with _SyncDetector(names):
            run(*args, **kwargs)
    except _Found as found:
        return found.sync
    return None
