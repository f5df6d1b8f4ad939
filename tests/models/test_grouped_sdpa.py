"""The bench's grouped-query attention gives the same logits as HF's ``sdpa``, bit for bit
(bf16's unmasked decode step, which HF does not pack, up to rounding; before transformers packed
a decode step's heads itself, up to a float32 rounding)."""

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations import sdpa_attention

from specforge.models.kv_cache import cache_kwargs
from specforge.models.target import GROUPED_SDPA, use_grouped_sdpa
from tests.helpers import make_tiny_llama


def forward_steps(model, prompt, steps):
    """Prefill, then extend the cache by each of ``steps`` (ids, optional 4D bool mask)."""
    cache = DynamicCache()
    outputs = [model(prompt, use_cache=True, **cache_kwargs(model, cache)).logits]
    for ids, mask in steps:
        out = model(ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
        outputs.append(out.logits)
    return outputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_sdpa_matches_sdpa_for_prefill_decode_verification_and_trees(dtype):
    """bf16 too: a decode step with a mask packs the query heads as HF's sdpa does (its CPU
    flash kernel is ~6x slower in bf16 for one query position than for a group's three); bf16
    packs without a mask as well, where HF does not."""
    model = make_tiny_llama(96, num_layers=2, seed=5).to(dtype)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert model.config._attn_implementation == "sdpa"
    torch.manual_seed(0)
    prompt = torch.randint(0, 96, (1, 11))
    # a root and two siblings after prompt 11 + decoded 2 + chain 4: each sees the cache, itself
    # and the root
    tree = torch.ones(1, 1, 3, 11 + 2 + 4 + 3, dtype=torch.bool)
    tree[0, 0, :, -3:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    steps = [
        (torch.randint(0, 96, (1, 1)), None),  # a decoded token
        (torch.randint(0, 96, (1, 1)), torch.ones(1, 1, 1, 13, dtype=torch.bool)),  # with a mask
        (torch.randint(0, 96, (1, 4)), None),  # a chain verification
        (torch.randint(0, 96, (1, 3)), tree),  # a tree verification
    ]
    reference = forward_steps(model, prompt, steps)
    # transformers' sdpa packs a single query's heads per key/value head from the release that
    # added pack_gqa on, as the grouped attention does
    hf_packs_gqa = hasattr(sdpa_attention, "pack_gqa")
    assert use_grouped_sdpa(model) and model.config._attn_implementation == GROUPED_SDPA
    grouped = forward_steps(model, prompt, steps)
    for index, (want, got) in enumerate(zip(reference, grouped, strict=True)):
        if dtype == torch.bfloat16 and index == 1:
            # the unmasked decode step: HF runs enable_gqa, bf16 here packs (the same sums;
            # equal on the CPU this was written on, close by construction anywhere)
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)
        elif hf_packs_gqa or dtype == torch.bfloat16:
            assert torch.equal(want, got)
        else:
            # transformers before pack_gqa repeats the key/value heads for every step: the
            # same attention summed in another order, a float32 rounding apart
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_only_sdpa_models_are_switched():
    model = make_tiny_llama(96, num_layers=1, seed=1).float()
    model.set_attn_implementation("eager")
    assert not use_grouped_sdpa(model)
    assert model.config._attn_implementation == "eager"


def test_row_spans_read_only_real_columns_and_change_nothing():
    """A decode step over left-padded rows: spans that skip each span's padding columns give the
    logits that attending every column gives (and dropping real columns would show)."""
    model = make_tiny_llama(96, num_layers=2, seed=3).float()
    assert use_grouped_sdpa(model)
    torch.manual_seed(1)
    lengths = [13, 4, 9, 1]
    width = max(lengths)
    ids = torch.randint(1, 96, (len(lengths), width))
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)

    def decode(spans):
        cache = DynamicCache()
        model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(model, cache))
        step_mask = torch.cat([mask, torch.ones(len(lengths), 1, dtype=mask.dtype)], 1)
        return model(
            torch.randint(1, 96, (len(lengths), 1), generator=torch.Generator().manual_seed(2)),
            attention_mask=step_mask,
            position_ids=mask.sum(-1, keepdim=True),
            **cache_kwargs(model, cache),
            row_spans=spans,
        ).logits

    full = decode([(0, len(lengths), width + 1)])
    spans = decode([(0, 1, 14), (1, 3, 10), (3, 4, 2)])
    # the same sums over fewer masked blocks: equal up to float32 rounding (~1e-7 here)
    torch.testing.assert_close(spans, full, rtol=0, atol=1e-6)
    assert not torch.equal(decode([(0, 4, 8)]), full)  # columns a row needs, dropped: wrong
