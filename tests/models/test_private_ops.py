"""The private PyTorch ops two CPU layers are built on, pinned: ``PackedLinear`` calls oneDNN's
``torch.ops.mkldnn`` pair and, inside compiled graphs (through ``specforge::bucket_linear``),
that pair and MKL's ``torch.ops.mkl`` pair (the ops inductor emits for frozen CPU graphs), and
``Int8Linear`` calls ``torch._weight_int8pack_mm``. Private ops may change between PyTorch
releases; where one vanishes or changes its signature the layers would fall back or fail at run
time, so these tests fail first, naming the op (the modules' docstrings say why we keep them)."""

import platform

import pytest
import torch

from specforge.config.resolve import int8_linear_available
from specforge.engine.cpu.packed_linear import packed_linear_available

PINNED = {
    "mkldnn::_linear_pointwise": (
        "mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, "
        "str? algorithm) -> Tensor Y"
    ),
    "mkldnn::_reorder_linear_weight": (
        "mkldnn::_reorder_linear_weight(Tensor self, int? batch_size=None) -> Tensor Y"
    ),
    "mkl::_mkl_linear": (
        "mkl::_mkl_linear(Tensor X, Tensor MKL_W, Tensor ORI_W, Tensor? B, int batch_size) "
        "-> Tensor"
    ),
    "mkl::_mkl_reorder_linear_weight": (
        "mkl::_mkl_reorder_linear_weight(Tensor X, int batch_size) -> Tensor"
    ),
    "aten::_weight_int8pack_mm": (
        "aten::_weight_int8pack_mm(Tensor self, Tensor mat2, Tensor scales) -> Tensor"
    ),
}


def schema(qualified: str) -> str:
    namespace, name = qualified.split("::")
    return str(getattr(getattr(torch.ops, namespace), name).default._schema)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN x86 CPU build")
@pytest.mark.parametrize("op", sorted(PINNED))
def test_the_private_ops_keep_their_signatures(op):
    assert packed_linear_available() and int8_linear_available()
    assert torch.backends.mkl.is_available()
    assert schema(op) == PINNED[op]


def test_the_ops_compute_what_the_layers_assume():
    """The reordered-weight linear equals ``F.linear``; the int8 product equals the product
    with the dequantized weights (``scales`` per output row)."""
    torch.manual_seed(0)
    x, weight = torch.randn(3, 64), torch.randn(32, 64)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 4)
    out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    torch.testing.assert_close(out, torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4)
    for rows in (4, 8):  # MKL's weight packed for a row count, called with that many rows
        mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        bias = torch.randn(32)
        out = torch.ops.mkl._mkl_linear(x[:1].expand(rows, -1), mkl_packed, weight, bias, rows)
        want = torch.nn.functional.linear(x[:1], weight, bias).expand(rows, -1)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    qweight = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
    scales = torch.rand(32, dtype=torch.bfloat16) / 64
    rows = torch.randn(3, 64, dtype=torch.bfloat16)
    reference = rows.float() @ (qweight.float() * scales.float()[:, None]).T
    product = torch._weight_int8pack_mm(rows, qweight, scales).float()
    torch.testing.assert_close(product, reference, rtol=2e-2, atol=2e-2)
