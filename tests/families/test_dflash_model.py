"""The DFlash block draft: training's blocks (many per sequence, under the block mask) equal
serving's block (one after a cached context), its mask means what it says, and its config
refuses what cannot run."""

import pytest
import torch

from specforge.errors import UserError
from specforge.families.dflash.model import (
    DFlashCache,
    DFlashConfig,
    block_mask,
    build_dflash_model,
    default_target_layer_ids,
)
from tests.helpers import make_tiny_llama

VOCAB = 96


def tiny_dflash(block_size: int = 4, layers: int = 2, seed: int = 0):
    """A tiny target and a DFlash draft built from it (random layers, the target's head)."""
    target = make_tiny_llama(VOCAB, num_layers=6, seed=seed)
    config = DFlashConfig.from_target(
        target.config,
        mask_token_id=VOCAB - 1,
        num_hidden_layers=layers,
        block_size=block_size,
    )
    draft = build_dflash_model(
        config,
        target_embedding=target.get_input_embeddings().weight,
        target_lm_head=target.get_output_embeddings().weight,
        seed=seed,
    )
    with torch.no_grad():  # norms away from 1: a mix-up of which norm reads what shows
        for name, param in draft.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    return target, draft.eval()


def test_training_blocks_equal_serving_blocks_after_a_cached_context():
    _, draft = tiny_dflash(block_size=4)
    width = len(draft.config.target_layer_ids) * draft.config.hidden_size
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(1, 24, width, generator=generator)
    input_ids = torch.randint(0, VOCAB - 1, (1, 24), generator=generator)
    anchors = torch.tensor([[1, 7, 13, 20]])
    with torch.no_grad():
        trained = draft.train_blocks(features, input_ids, anchors, torch.ones(1, 4, dtype=bool))
        for j, anchor in enumerate(anchors[0].tolist()):
            cache = DFlashCache(draft.config.num_hidden_layers)
            split = anchor // 2  # the context arrives in two pieces, as rounds extend it
            draft(features[:, :split], input_ids[:, split - 1 if split else 0], cache=cache)
            served = draft(features[:, split:anchor], input_ids[:, anchor], cache=cache)
            assert cache.length == anchor
            torch.testing.assert_close(served, trained[:, j, 1:], rtol=1e-5, atol=1e-5)


def test_the_block_mask_sees_the_context_before_the_anchor_and_the_own_block():
    anchors, keep = torch.tensor([[2, 5]]), torch.tensor([[True, False]])
    mask = block_mask(anchors, keep, context=6, block_size=3)[0, 0]
    assert mask.shape == (6, 6 + 6)
    # block 0 (anchor 2): context positions 0 and 1, then its own three slots
    assert mask[0].tolist() == [True, True, False, False, False, False] + [True] * 3 + [False] * 3
    assert torch.equal(mask[0], mask[2])
    # block 1 is not kept: its own slots only
    assert mask[3].tolist() == [False] * 6 + [False] * 3 + [True] * 3


def test_a_block_depends_on_no_context_at_or_after_its_anchor():
    _, draft = tiny_dflash(block_size=3)
    width = len(draft.config.target_layer_ids) * draft.config.hidden_size
    features = torch.randn(1, 12, width, generator=torch.Generator().manual_seed(1))
    input_ids = torch.randint(0, VOCAB - 1, (1, 12), generator=torch.Generator().manual_seed(2))
    anchors, keep = torch.tensor([[4, 8]]), torch.ones(1, 2, dtype=bool)
    changed = features.clone()
    changed[:, 4:] += 1.0  # the anchor's own state and later ones
    with torch.no_grad():
        before = draft.train_blocks(features, input_ids, anchors, keep)
        after = draft.train_blocks(changed, input_ids, anchors, keep)
    torch.testing.assert_close(before[:, 0], after[:, 0])
    assert not torch.allclose(before[:, 1], after[:, 1])


def test_config_refuses_what_cannot_run_and_spreads_target_layers():
    # SGLang's rule for a config without target_layer_ids: halves round to even
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(8, count=3) == [1, 3, 5]
    assert default_target_layer_ids(30, count=1) == [15]
    with pytest.raises(UserError, match="5 target layers need a target with >= 8 layers"):
        default_target_layer_ids(6)
    target = make_tiny_llama(VOCAB, num_layers=6)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        DFlashConfig.from_target(target.config, mask_token_id=1, block_size=1)
    with pytest.raises(ValueError, match="mask_token_id must be in 0..95, got 96"):
        DFlashConfig.from_target(target.config, mask_token_id=VOCAB)
    config = DFlashConfig.from_target(target.config, mask_token_id=3)
    assert config.target_layer_ids == [1, 2, 3]  # as many as a 6-layer target has, up to 5
    with pytest.raises(UserError, match="unknown DFlash config keys \\['bogus'\\]"):
        DFlashConfig.from_dict({**config.to_dict(), "bogus": 1}, "draft_config.json")
