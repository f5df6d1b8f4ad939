"""The CPU decode attention kernel gives SDPA's attention (float32 to its rounding, bf16 within
bf16's), over strided cache views and masks with holes, and is used only where asked."""

import pytest
import torch
import torch.nn.functional as F

from specforge.data.kv_cache import decode_kernel_mode
from specforge.errors import UserError
from specforge.models.decode_kernel import kernel_decode_attention
from tests.helpers import kernel_or_skip


def decode_inputs(rows, heads, kv_heads, size, columns, dtype, seed=0):
    """A decode query and views of wider key/value buffers (as the growing cache holds them),
    a mask with left padding per row and a hole."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, 1, size, generator=generator).to(dtype)
    buffers = torch.randn(2, rows, kv_heads, columns + 40, size, generator=generator).to(dtype)
    key, value = buffers[0][:, :, :columns], buffers[1][:, :, :columns]
    mask = torch.ones(rows, 1, 1, columns, dtype=torch.bool)
    for row in range(rows):
        mask[row, ..., : (row * 7) % columns] = False  # left padding, none in row 0
    mask[-1, ..., columns // 2] = False  # a hole
    return query, key, value, mask


def sdpa(query, key, value, mask):
    """HF's result layout (B, 1, H, D), computed in float32."""
    out = F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize(
    "dtype, heads, kv_heads, size",
    [
        (torch.float32, 9, 3, 64),
        (torch.float32, 4, 4, 128),
        (torch.float32, 32, 4, 128),
        (torch.bfloat16, 9, 3, 64),
        (torch.bfloat16, 16, 2, 64),
    ],
)
def test_kernel_gives_sdpas_attention(dtype, heads, kv_heads, size):
    kernel_or_skip()
    query, key, value, mask = decode_inputs(6, heads, kv_heads, size, 53, dtype)
    with decode_kernel_mode("on"):
        out = kernel_decode_attention(query, key, value, mask, None)
    assert out.dtype == dtype and out.shape == (6, 1, heads, size)
    reference = sdpa(query, key, value, mask)
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)


def test_kernel_takes_a_scale_and_a_missing_or_broadcast_mask():
    kernel_or_skip()
    query, key, value, _ = decode_inputs(3, 9, 3, 64, 20, torch.float32)
    reference = F.scaled_dot_product_attention(query, key, value, enable_gqa=True, scale=0.3)
    with decode_kernel_mode("on"):
        unmasked = kernel_decode_attention(query, key, value, None, 0.3)
        broadcast = torch.ones(1, 1, 1, 20, dtype=torch.bool)
        shared = kernel_decode_attention(query, key, value, broadcast, 0.3)
    for out in (unmasked, shared):
        torch.testing.assert_close(out, reference.transpose(1, 2), atol=2e-6, rtol=2e-6)


def test_kernel_runs_only_where_asked():
    query, key, value, mask = decode_inputs(2, 9, 3, 64, 10, torch.float32)
    assert kernel_decode_attention(query, key, value, mask, None) is None  # outside a block
    with decode_kernel_mode("off"):
        assert kernel_decode_attention(query, key, value, mask, None) is None
    with decode_kernel_mode("auto"):  # a head size it lacks: SDPA instead
        assert (
            kernel_decode_attention(query[..., :32], key[..., :32], value[..., :32], mask, None)
            is None
        )


def test_kernel_on_refuses_what_it_cannot_run():
    query, key, value, mask = decode_inputs(2, 9, 3, 32, 10, torch.float32)
    with decode_kernel_mode("on"), pytest.raises(UserError, match="head sizes.*not 32"):
        kernel_decode_attention(query, key, value, mask, None)
    with pytest.raises(ValueError, match="one of .*'sometimes'"):
        with decode_kernel_mode("sometimes"):
            pass
