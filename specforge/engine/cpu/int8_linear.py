"""Weight-only int8 linear layers for the draft on CPU: half the bytes of its bfloat16 weights.

A draft step in the speculative runtime is a few one-row matrix products whose weights have
just been evicted from the caches by the target's forward, so it costs what reading its weights
from memory costs. Stored as int8 with one bfloat16 scale per output row (the row's largest
magnitude maps to 127) and multiplied by PyTorch's weight-only kernel
(``torch._weight_int8pack_mm``: bfloat16 activations, int8 weights, the op torchao's CPU
weight-only int8 quantization calls), the draft's weights are read once at half the bytes, in
one kernel per layer. Measured on a 2-core Zen 4 EPYC (AVX512-BF16) with SmolLM2-135M's 1-layer
draft (9.8M parameters; ``benchmarks/verify_cost.py``): its extension over 3 accepted tokens
right after a 3-token verification took 2.0 ms, against 5.5 with prepacked bfloat16 weights and
3.3 with prepacked float32 ones (a profile put the bfloat16 draft's linear layers at 3.3 of its
5.5 ms there, the int8 ones at 0.9).

Why not torchao's int8 weight-only quantization: on a CPU it reaches this same kernel, and for
one call per layer it would add a large dependency with its own PyTorch version pins. The op is
private to PyTorch, so ``tests/models/test_private_ops.py`` pins its signature and what it
computes: a PyTorch that changes it fails there first.

Only the draft's proposals change (by int8 rounding of its weights): the target verifies every
proposed token, so the runtime's outputs stay the target's. Over many rows the kernel is slower
than bfloat16's matrix product (300 rows of the 1728-wide ``fc``: 3.9 against 1.5 ms), which
only the draft's prefill over a prompt pays, once per turn.
"""

from __future__ import annotations

import torch
from torch import nn

from specforge.config.resolve import int8_linear_available

INT8_MAX = 127
"""The largest int8 magnitude a row's largest weight maps to (symmetric, no zero point)."""


class Int8Linear(nn.Module):
    """A bias-free linear layer with int8 weights and one scale per output row, computing in the
    scales' dtype (bfloat16). Built from an ``nn.Linear`` by :meth:`from_linear`."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """``linear``'s weight rounded to int8 per output row; its dtype stays the compute
        dtype.

        Raises:
            ValueError: a layer with a bias (the draft's have none).
        """
        if linear.bias is not None:
            raise ValueError(f"Int8Linear takes bias-free layers; {linear} has a bias")
        weight = linear.weight.detach().float()
        # (out, in) -> (out,): a row of zeros keeps a positive scale (its int8 row is zeros)
        scales = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
        qweight = torch.round(weight / scales[:, None]).clamp(-INT8_MAX, INT8_MAX)
        return cls(qweight.to(torch.int8), scales.to(linear.weight.dtype))

    def dequantized_weight(self) -> torch.Tensor:
        """(out, in) the weight the kernel multiplies by, in float32."""
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., in) -> (M, in) -> (M, out) -> (..., out)
        rows = x.reshape(-1, self.in_features).to(self.scales.dtype)
        out = torch._weight_int8pack_mm(rows, self.qweight, self.scales)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(model: nn.Module) -> int:
    """Swap every ``nn.Linear`` of ``model`` (a subclass too, such as a prepacked one) for an
    :class:`Int8Linear` of its weight; returns how many were swapped.

    Raises:
        ValueError: a model whose linear weights are not bfloat16 on the CPU (the only setting
            the kernel was measured fast in: float32 activations took 7x longer than bfloat16's
            default matrix product), or a build without the kernel.
    """
    if not int8_linear_available():
        raise ValueError(f"torch {torch.__version__} has no weight-only int8 kernel")
    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for _, name, child in swaps:
        weight = child.weight
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(
                f"int8 weights need a bfloat16 CPU model; {name} is {weight.dtype} on "
                f"{weight.device}"
            )
    for parent, name, child in swaps:
        setattr(parent, name, Int8Linear.from_linear(child))
    return len(swaps)
