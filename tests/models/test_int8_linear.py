"""Weight-only int8 linear layers: the weight within half a quantization step, the product the
dequantized weight's, a row's result independent of the call's other rows, and refusals of
what the kernel was not measured for."""

import pytest
import torch
from torch import nn

from specforge.engine.cpu.int8_linear import (
    INT8_MAX,
    Int8Linear,
    int8_linear_available,
    quantize_linears,
)
from tests.helpers import tiny_draft

pytestmark = pytest.mark.skipif(not int8_linear_available(), reason="no int8 kernel in this build")


def bfloat16_linear(in_features=96, out_features=160, *, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)


def test_each_row_is_rounded_to_int8_within_half_a_step():
    linear = bfloat16_linear()
    with torch.no_grad():
        linear.weight[3].zero_()  # a row of zeros keeps a usable scale
    module = Int8Linear.from_linear(linear)
    assert module.qweight.dtype == torch.int8 and module.scales.dtype == torch.bfloat16
    weight = linear.weight.float()
    # every row but the zero one reaches +-127 at its largest weight
    largest = module.qweight.abs().amax(dim=1)
    assert largest[3] == 0 and bool((largest[torch.arange(160) != 3] == INT8_MAX).all())
    # scales are stored in bfloat16, so the bound is half a step plus the scale's rounding
    step = module.scales.float()[:, None]
    error = (module.dequantized_weight() - weight).abs()
    assert bool((error <= 0.5 * step + weight.abs() * 2**-8 + 1e-12).all())


def test_the_product_is_the_dequantized_weights_and_a_row_does_not_depend_on_the_others():
    linear = bfloat16_linear()
    module = Int8Linear.from_linear(linear)
    x = torch.randn(2, 8, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        whole = module(x)
        assert whole.shape == (2, 8, 160) and whole.dtype == torch.bfloat16
        reference = x.float() @ module.dequantized_weight().T
        torch.testing.assert_close(whole.float(), reference, rtol=2e-2, atol=2e-2)
        for rows in (1, 2, 3):
            # the same bits whatever shares the call
            assert torch.equal(module(x[0, :rows]), whole[0, :rows])


def test_quantize_linears_swaps_every_linear_and_keeps_the_draft_working():
    _, draft = tiny_draft(seed=3)
    draft.to(torch.bfloat16)
    expected = sum(isinstance(m, nn.Linear) for m in draft.modules())
    assert quantize_linears(draft) == expected > 0
    assert not any(isinstance(m, nn.Linear) for m in draft.modules())
    aux = torch.randn(1, 4, 3 * draft.config.target_hidden_size)  # float32, as the target's
    assert draft.fuse(aux).dtype == torch.bfloat16


def test_quantize_refuses_a_float32_model_and_a_bias():
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    with pytest.raises(ValueError, match=r"bfloat16 CPU model; 0 is torch.float32"):
        quantize_linears(model)
    assert isinstance(model[0], nn.Linear)  # nothing swapped
    with pytest.raises(ValueError, match="bias"):
        Int8Linear.from_linear(nn.Linear(64, 64).to(torch.bfloat16))
