"""Row buckets: a compiled CPU graph's linear layers over a few rows (a verification of 2-16
tokens, a small batch) read each weight once, as over one row.

Why: a graph ``torch.compile`` builds calls PyTorch's default product, MKL's ``sgemm``, which
from 4 rows on switches to a kernel that repacks the weight on every call. On a 2-core AVX-512
Xeon without AVX512-BF16, SmolLM2's 576x576 projections over its 30 layers took 3.3 ms at 1-3
rows and 11.9-12.4 ms at 4-8, so through the compiled engine verifying 4-8 tokens cost
1.7-2.0 target tokens (``docs/results/verify_cost_engine_cpu.json``) and a chain of 5 ran
slower than the target alone. MKL can pack a weight once for a fixed row count (the
``torch.ops.mkl`` pair inductor emits for frozen float32 graphs); a call of exactly that many
rows then reads the weight once: 2.6-2.9 ms at 4-16 rows there.

How: :func:`bucket_linears` gives every linear layer of the engine's decoder two packed copies
of its weight, for :data:`~specforge.models.packed_linear.ROW_BUCKETS` (8 and 16) rows. Inside a
compiled graph, a float32 call of 2 or more rows runs ``specforge::bucket_linear``
(``csrc/bucket_linear.cpp``): 4 to 16 rows padded with zeros to the first bucket that holds
them, through that bucket's packing; up to 3 rows, where the default reads the weight once too,
and more than 16 through the default. The op is opaque to inductor, which cannot lower the
packed product with a weight that is an input rather than a frozen constant, and it keeps the
row count dynamic, so the engine's graphs stay the same two. It is C++ (built with the decode
attention kernel, :mod:`specforge.engine.decode_kernel`): a Python kernel cost ~0.1 ms a call,
20 ms a forward of SmolLM2's 210 layers. One-row graphs keep the default, the fastest at one
row. Linear layers of other classes (quantized ones, say) are left as they are.

Exactness: a row's result does not depend on the rows that share its bucket (tested); it
differs from the default's by float32 rounding, as the default's one-row and many-row kernels
already do from each other, so a verification's logits agree with one-token decoding to
rounding, as before. Where it does not apply (no MKL, no AVX-512 build of the kernel module,
another dtype, a trainable weight, or packed copies beyond :data:`MAX_BUCKET_BYTES`) the
layers keep the default.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from specforge.engine.decode_kernel import load_kernel_module
from specforge.models.packed_linear import ROW_BUCKETS, PackedLinear, bucketable

logger = logging.getLogger(__name__)

MAX_BUCKET_BYTES = 4 << 30
"""Packed copies of a model's weights (one per bucket) may take at most this much memory: a
target of up to about 500M float32 weights."""


def _bucket_linear_shape(x, weight, bias, default_rows, small, small_rows, large, large_rows):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@functools.cache
def row_buckets_missing() -> str | None:
    """Why row buckets cannot run in this process, or ``None`` (the op is then loaded, its
    shapes known to ``torch.compile``)."""
    if not torch.backends.mkl.is_available() or not hasattr(torch.ops.mkl, "_mkl_linear"):
        return "this PyTorch build has no MKL"
    module, missing = load_kernel_module()
    if module is None:
        return missing
    module.register_bucket_linear()
    torch.library.register_fake("specforge::bucket_linear", _bucket_linear_shape)
    return None


def bucket_linears(model: nn.Module) -> int:
    """Give every ``nn.Linear`` of a frozen float32 CPU ``model`` row buckets
    (:meth:`~specforge.models.packed_linear.PackedLinear.pack_row_buckets`; a plain
    ``nn.Linear`` is wrapped first, its eager calls left to the default). Returns how many
    layers: 0 where the weights are not all frozen float32 on the CPU, where their packed
    copies would take more than :data:`MAX_BUCKET_BYTES`, or where the op is missing (logged)."""
    linears = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in (nn.Linear, PackedLinear)  # another subclass computes otherwise
    ]
    weights = [child.weight for _, _, child in linears]
    frozen = all(bucketable(w) for w in weights)
    copies = sum(w.numel() * w.element_size() for w in weights) * len(ROW_BUCKETS)
    if not linears or not frozen or copies > MAX_BUCKET_BYTES:
        return 0
    missing = row_buckets_missing()
    if missing:
        logger.info("row buckets unused (few-row calls keep PyTorch's product): %s", missing)
        return 0
    for parent, name, child in linears:
        if type(child) is nn.Linear:
            child = PackedLinear.wrap(child, max_rows=0)
            setattr(parent, name, child)
        child.pack_row_buckets()
    return len(linears)
