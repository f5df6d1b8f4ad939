"""A DFlash draft through the runtime: trained briefly on the target's own greedy text with the
block objective, it serves those prompts with long accepted blocks (training's blocks are
serving's), every output the target's, through transformers and through the engine; and the
runtime refuses what a block cannot do."""

import pytest
import torch

from specforge.engine.target import TargetEngine
from specforge.errors import UserError
from specforge.families import family
from specforge.families.dflash.model import DFlashConfig, build_dflash_model
from specforge.families.dflash.objective import block_loss, block_targets, sample_anchors
from specforge.models.target import target_hidden_states
from specforge.serving.speculative import SpeculativeDecoder
from tests.helpers import greedy_reference, make_tiny_llama

VOCAB, PROMPT, NEW, BLOCK = 96, 4, 36, 4

DFLASH = family("dflash")


@pytest.fixture(scope="module")
def trained():
    """A peaked tiny target, 24 of its greedy continuations, and a one-layer DFlash draft
    trained 150 steps on them (a few seconds)."""
    target = make_tiny_llama(VOCAB, num_layers=6, seed=0, initializer_range=0.3).float()
    target.requires_grad_(False)
    config = DFlashConfig.from_target(
        target.config, mask_token_id=VOCAB - 1, num_hidden_layers=1, block_size=BLOCK
    )
    draft = build_dflash_model(
        config,
        target_embedding=target.get_input_embeddings().weight,
        target_lm_head=target.get_output_embeddings().weight,
        target_norm=target.model.norm.weight,
    )
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB - 1, (1, PROMPT), generator=generator) for _ in range(24)]
    ids = torch.cat([torch.tensor([greedy_reference(target, p, NEW)]) for p in prompts])
    with torch.no_grad():
        features = target_hidden_states(
            target, ids, aux_layer_ids=config.target_layer_ids
        ).aux_hidden_states
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, :PROMPT] = False
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    torch.manual_seed(0)
    for _ in range(150):
        anchors, keep = sample_anchors(loss_mask, 8, generator)
        logits = draft.train_blocks(features, ids, anchors, keep)
        labels, counts = block_targets(ids, loss_mask, anchors, keep, BLOCK)
        result = block_loss(logits, labels, counts, gamma=None)
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
    assert result.tau > 3.0  # the blocks are learnt
    return target, draft.eval(), prompts[:4], ids[:4]


@pytest.mark.parametrize("through", ["transformers", "engine"])
def test_a_trained_dflash_draft_serves_its_blocks_losslessly(trained, through):
    target, draft, prompts, references = trained
    layers = draft.config.target_layer_ids
    engine = None
    if through == "engine":
        engine = TargetEngine(target, aux_layer_ids=layers, compile=False)
    decoder = SpeculativeDecoder(
        target,
        draft,
        proposer=DFLASH.proposer,
        aux_layer_ids=layers,
        num_steps=BLOCK - 1,
        engine=engine,
    )
    for prompt, reference in zip(prompts, references, strict=True):
        tokens, stats = decoder.generate(prompt, max_new_tokens=NEW)
        assert tokens == reference[PROMPT:].tolist()
        # blocks as trained: most rounds accept all three proposals
        assert stats.tau > 2.5 and max(stats.accepted_per_round) == BLOCK - 1


def test_a_dflash_draft_refuses_auto_trees_and_depths_past_its_block(trained):
    target, draft, _, _ = trained
    layers = draft.config.target_layer_ids
    for settings in ({"num_steps": "auto"}, {"num_steps": 4}, {"topk": 2, "num_draft_tokens": 4}):
        with pytest.raises(UserError, match="a DFlash draft proposes one block a round"):
            SpeculativeDecoder(
                target, draft, proposer=DFLASH.proposer, aux_layer_ids=layers, **settings
            )
