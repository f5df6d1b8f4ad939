"""oneDNN's prepacked linear: the default's results to float32 rounding, a row's result
independent of the call's other rows, and PyTorch's default wherever it does not apply."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specforge.engine.cpu.packed_linear import (
    MAX_PACKED_ROWS,
    MAX_PACKED_ROWS_AVX512,
    MAX_PACKED_ROWS_BF16,
    PackedLinear,
    default_linears,
    max_packed_rows,
    packed_dtypes,
    packed_linear_available,
    prepack_linears,
)
from specforge.serving.speculative import SpeculativeDecoder
from tests.helpers import greedy_reference, make_tiny_llama, tiny_draft

pytestmark = pytest.mark.skipif(not packed_linear_available(), reason="no oneDNN in this build")


def packed(in_features=96, out_features=160, *, bias=True, seed=0):
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    return linear, PackedLinear.wrap(linear)


@pytest.mark.parametrize("bias", [True, False])
def test_agrees_with_the_default_and_a_row_does_not_depend_on_the_others(bias):
    linear, module = packed(bias=bias)
    x = torch.randn(MAX_PACKED_ROWS, 96)
    with torch.no_grad():
        whole = module(x)
        for rows in (1, 2, 3, 5, 8, MAX_PACKED_ROWS):
            got = module(x[:rows])
            assert got.shape == linear(x[:rows]).shape
            torch.testing.assert_close(got, linear(x[:rows]), rtol=1e-5, atol=1e-5)
            assert torch.equal(got, whole[:rows])  # the same bits whatever shares the call
        # leading dimensions as the models pass them: (B, T, H)
        assert torch.equal(module(x[None, :4]), whole[None, :4])
    assert module._packed is not None  # the packed path ran


def test_a_one_row_call_has_a_many_row_calls_bits_for_wide_inputs_too():
    """oneDNN runs some one-row calls with another kernel (on an AVX-512 CPU: 1152 or more
    inputs, as SmolLM2's down_proj), which rounds differently: a token decoded alone must get
    the bits it gets inside a verification of several tokens."""
    dtypes = [torch.float32] + [torch.bfloat16] * (torch.bfloat16 in packed_dtypes())
    for dtype in dtypes:
        for in_features in (96, 1536):
            linear, module = packed(in_features, 64)
            linear.to(dtype)
            x = torch.randn(3, 1, in_features, dtype=dtype)
            with torch.no_grad():
                whole = module(x[:, 0])
                for row in range(3):
                    assert torch.equal(module(x[row]), whole[row : row + 1])  # (1, in)
                    assert torch.equal(module(x[row, 0]), whole[row])  # (in,)
                torch.testing.assert_close(module(x[0]), linear(x[0]))


def test_prepack_packs_as_many_rows_as_pay_on_this_cpu():
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert max_packed_rows(torch.float32) == (MAX_PACKED_ROWS_AVX512 if avx512 else MAX_PACKED_ROWS)
    assert max_packed_rows(torch.bfloat16) == MAX_PACKED_ROWS_BF16
    model = nn.Sequential(nn.Linear(96, 160))
    assert prepack_linears(model, min_weight=0) == 1
    assert model[0].max_rows == max_packed_rows(torch.float32)


needs_native_bf16 = pytest.mark.skipif(
    torch.bfloat16 not in packed_dtypes(), reason="this CPU has no native bfloat16 for oneDNN"
)


@needs_native_bf16
def test_bfloat16_agrees_with_the_default_row_by_row():
    linear, module = packed()
    linear.to(torch.bfloat16)
    x = torch.randn(MAX_PACKED_ROWS, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        whole = module(x)
        for rows in (1, 3, MAX_PACKED_ROWS):
            got = module(x[:rows])
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, linear(x[:rows]))  # bfloat16's tolerances
            assert torch.equal(got, whole[:rows])
        # a float32 input to a bfloat16 weight is not packed: the default says what it does
        with pytest.raises(RuntimeError):
            module(x.float())
    assert module._packed is not None and module._packed_from is not None
    # prepack_linears packs bfloat16 calls of many rows too (batched regeneration, prefills)
    model = nn.Sequential(nn.Linear(96, 160)).to(torch.bfloat16)
    assert prepack_linears(model, min_weight=0) == 1
    assert model[0].max_rows == MAX_PACKED_ROWS_BF16
    many = torch.randn(4 * MAX_PACKED_ROWS, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(model(many), F.linear(many, model[0].weight, model[0].bias))
    assert model[0]._packed is not None


def test_falls_back_to_the_default_where_packing_does_not_apply():
    linear, module = packed()
    many = torch.randn(MAX_PACKED_ROWS + 1, 96)
    with torch.no_grad():
        assert torch.equal(module(many), linear(many))  # too many rows
        half = torch.randn(3, 96, dtype=torch.float16)
        assert torch.equal(module.to(torch.float16)(half), linear(half))  # another dtype
    assert module._packed is None
    # gradients: the default's autograd, identical results and gradients
    x = torch.randn(3, 96, requires_grad=True)
    module.float()(x).sum().backward()
    want_x_grad, want_w_grad = x.grad.clone(), linear.weight.grad.clone()
    x.grad, linear.weight.grad = None, None
    F.linear(x, linear.weight, linear.bias).sum().backward()
    assert torch.equal(x.grad, want_x_grad) and torch.equal(linear.weight.grad, want_w_grad)
    assert module._packed is None


def test_default_linears_switches_packing_off_for_a_while():
    linear, module = packed()
    parent = nn.Sequential(module)
    x = torch.randn(2, 96)
    with torch.no_grad():
        with default_linears(parent):
            assert torch.equal(module(x), linear(x)) and module._packed is None
        module(x)
    assert module._packed is not None and module.max_rows == MAX_PACKED_ROWS


def test_a_weight_changed_in_place_is_packed_again():
    linear, module = packed()
    x = torch.randn(2, 96)
    with torch.no_grad():
        before = module(x)
        linear.weight.mul_(2)
        after = module(x)
    torch.testing.assert_close(after, 2 * (before - linear.bias) + linear.bias)
    torch.testing.assert_close(after, linear(x), rtol=1e-5, atol=1e-5)


def test_prepack_keeps_parameters_and_tying_and_greedy_decoding():
    target, draft = tiny_draft()
    target.requires_grad_(False)
    target.lm_head.weight = target.model.embed_tokens.weight  # tied, as SmolLM2's
    keys = list(target.state_dict())
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    want = greedy_reference(target, prompt, 24)
    linears = sum(type(m) is nn.Linear for m in target.modules())
    assert prepack_linears(target, min_weight=0) == linears > 0
    assert prepack_linears(draft, min_weight=0) > 0
    assert not any(type(m) is nn.Linear for m in target.modules())
    assert list(target.state_dict()) == keys
    assert target.lm_head.weight is target.model.embed_tokens.weight
    assert greedy_reference(target, prompt, 24) == want
    # the speculative runtime over the packed models is still the target's greedy decoding
    decoder = SpeculativeDecoder(target, draft, aux_layer_ids=[1, 2, 3], num_steps=3)
    tokens, _ = decoder.generate(prompt, max_new_tokens=24)
    assert prompt[0].tolist() + tokens == want
    assert all(m._packed is not None for m in target.modules() if isinstance(m, PackedLinear))


def test_prepack_leaves_other_dtypes_and_small_weights_alone():
    model = make_tiny_llama(96, num_layers=1)
    assert prepack_linears(model.to(torch.float16), min_weight=0) == 0
    assert prepack_linears(model.float()) == 0  # 64-wide: oneDNN's call overhead would lose
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
