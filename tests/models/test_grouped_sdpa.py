"""The bench's grouped-query attention gives the same logits as HF's ``sdpa``, bit for bit."""

import torch
from transformers import DynamicCache

from specforge.models.target import GROUPED_SDPA, use_grouped_sdpa
from tests.helpers import make_tiny_llama


def forward_steps(model, prompt, steps):
    """Prefill, then extend the cache by each of ``steps`` (ids, optional 4D bool mask)."""
    cache = DynamicCache()
    outputs = [model(prompt, past_key_values=cache, use_cache=True).logits]
    for ids, mask in steps:
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        outputs.append(out.logits)
    return outputs


def test_grouped_sdpa_matches_sdpa_for_prefill_decode_verification_and_trees():
    model = make_tiny_llama(96, num_layers=2, seed=5).float()
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert model.config._attn_implementation == "sdpa"
    torch.manual_seed(0)
    prompt = torch.randint(0, 96, (1, 11))
    # a root and two siblings after prompt 11 + decoded 1 + chain 4: each sees the cache, itself
    # and the root
    tree = torch.ones(1, 1, 3, 11 + 1 + 4 + 3, dtype=torch.bool)
    tree[0, 0, :, -3:] = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    steps = [
        (torch.randint(0, 96, (1, 1)), None),  # a decoded token
        (torch.randint(0, 96, (1, 4)), None),  # a chain verification
        (torch.randint(0, 96, (1, 3)), tree),  # a tree verification
    ]
    reference = forward_steps(model, prompt, steps)
    assert use_grouped_sdpa(model) and model.config._attn_implementation == GROUPED_SDPA
    grouped = forward_steps(model, prompt, steps)
    for want, got in zip(reference, grouped, strict=True):
        assert torch.equal(want, got)


def test_only_sdpa_models_are_switched():
    model = make_tiny_llama(96, num_layers=1, seed=1).float()
    model.set_attn_implementation("eager")
    assert not use_grouped_sdpa(model)
    assert model.config._attn_implementation == "eager"
