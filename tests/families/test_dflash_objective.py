"""The DFlash block objective: anchors where an assistant token follows, targets that read the
token at ``anchor + k`` of assistant positions only, the slot decay, soft targets from the
position before each label, and the accept count a greedy verification would reach."""

import math

import pytest
import torch

from specforge.data.batching import Batch
from specforge.families.dflash.objective import (
    BlockVocabulary,
    DFlashObjective,
    block_loss,
    block_targets,
    greedy_labels,
    sample_anchors,
    slot_weights,
    soft_targets,
)
from specforge.trainer.ttt import TargetDistribution
from tests.families.test_dflash_model import VOCAB, tiny_dflash


def test_anchors_are_followed_by_an_assistant_token_and_never_repeat():
    loss_mask = torch.zeros(2, 12, dtype=torch.bool)
    loss_mask[0, 6:] = True
    loss_mask[1, 9:11] = True
    generator = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(loss_mask, num_anchors=4, generator=generator)
    assert anchors.shape == keep.shape == (2, 4)
    assert keep[0].all() and keep[1].tolist() == [True, True, False, False]
    for row in range(2):
        kept = anchors[row][keep[row]].tolist()
        assert kept == sorted(set(kept))
        assert all(a >= 1 and loss_mask[row, a + 1] for a in kept)
    assert anchors[1][keep[1]].tolist() == [8, 9]  # the only two: 9 and 10 are assistant tokens


def test_targets_read_the_tokens_after_the_anchor_on_assistant_positions():
    input_ids = torch.arange(10)[None] + 100
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
    anchors, keep = torch.tensor([[2, 7]]), torch.tensor([[True, True]])
    labels, counts = block_targets(input_ids, loss_mask, anchors, keep, block_size=4)
    assert labels[0, 0].tolist() == [102, 103, 104, 105]
    assert counts[0, 0].tolist() == [False, True, True, True]
    # past the end: label 0, not counted
    assert labels[0, 1].tolist() == [107, 108, 109, 0]
    assert counts[0, 1].tolist() == [False, True, True, False]
    _, dropped = block_targets(input_ids, loss_mask, anchors, torch.tensor([[True, False]]), 4)
    assert not dropped[0, 1].any()


def test_slot_decay_and_the_loss_weigh_each_counted_slot():
    weights = slot_weights(5, gamma=2.0)
    assert weights[0] == 0 and weights[1] == 1
    assert math.isclose(float(weights[3]), math.exp(-1.0), rel_tol=1e-6)
    logits = torch.randn(1, 1, 3, 7, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[[0, 2, 5]]])
    counts = torch.tensor([[[False, True, True]]])
    result = block_loss(logits, labels, counts, gamma=2.0)
    nll = -logits.log_softmax(-1)[0, 0]
    decay = math.exp(-0.5)
    expected = (nll[1, 2] + decay * nll[2, 5]) / (1 + decay)
    torch.testing.assert_close(result.loss, expected)


def test_accepted_counts_stop_at_the_first_miss_and_give_tau():
    labels = torch.tensor([[[4, 1, 2, 3], [4, 1, 2, 3]]])
    counts = torch.ones(1, 2, 4, dtype=torch.bool)
    counts[..., 0] = False
    logits = torch.full((1, 2, 4, 5), -10.0)
    for block, predicted in enumerate(([0, 1, 2, 0], [0, 1, 4, 3])):
        for slot, token in enumerate(predicted):
            logits[0, block, slot, token] = 10.0
    result = block_loss(logits, labels, counts, gamma=None)
    assert (result.accepted, result.blocks) == (3, 2)  # block 0 misses slot 3, block 1 slot 2
    assert result.tau == 1 + 1.5
    assert result.slot_accuracy == [1.0, 0.5, 0.5]


def test_soft_targets_are_the_targets_softmax_before_each_label():
    target_logits = torch.randn(1, 6, 5, generator=torch.Generator().manual_seed(1))
    probs = soft_targets(target_logits.softmax(-1), torch.tensor([[2]]), block_size=3)
    torch.testing.assert_close(probs[0, 0, 1], target_logits[0, 2].softmax(-1))
    torch.testing.assert_close(probs[0, 0, 2], target_logits[0, 3].softmax(-1))
    # soft targets equal to one-hot labels give the hard loss
    labels = torch.tensor([[[0, 3, 1]]])
    counts = torch.tensor([[[False, True, True]]])
    logits = torch.randn(1, 1, 3, 5, generator=torch.Generator().manual_seed(2))
    one_hot = torch.nn.functional.one_hot(labels, 5).float()
    hard = block_loss(logits, labels, counts, gamma=4.0)
    soft = block_loss(logits, labels, counts, gamma=4.0, target_probs=one_hot)
    torch.testing.assert_close(hard.loss, soft.loss)


def test_greedy_labels_are_the_target_s_argmax_before_each_slot():
    # the target's argmax at each position (-1: not computed, no assistant token follows)
    argmax = torch.tensor([[11, 12, 13, 14, -1, 16, 17]])
    anchors, keep = torch.tensor([[1, 4]]), torch.tensor([[True, True]])
    labels, counts = greedy_labels(argmax, anchors, keep, block_size=4)
    # slot k of the block at 1 is labelled with the argmax at 1 + k - 1
    assert labels[0, 0, 1:].tolist() == [12, 13, 14]
    assert counts[0, 0].tolist() == [False, True, True, True]
    # the block at 4: slot 1 reads position 4 (none), slots 2-3 positions 5-6, nothing past 6
    assert counts[0, 1].tolist() == [False, False, True, True]
    assert labels[0, 1, 2:].tolist() == [16, 17]


def test_soft_labels_are_the_target_s_distribution_before_each_slot():
    """``draft.block_labels: soft``: each counted slot's cross-entropy to the target's whole
    distribution at the position before its token, weighted by slot as the hard loss is."""
    _, draft = tiny_dflash(block_size=4)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB - 1, (1, 12), generator=generator)
    loss_mask = torch.ones(1, 12, dtype=torch.bool)
    loss_mask[0, :4] = False  # a prompt
    batch = Batch(ids, torch.ones(1, 12, dtype=torch.long), loss_mask)
    features = torch.randn(1, 12, draft.fc.in_features, generator=generator)
    target_logits = torch.randn(1, 12, VOCAB, generator=generator)
    dist = TargetDistribution(
        target_logits.softmax(-1), target_logits.argmax(-1), torch.ones(1, 12, dtype=torch.bool)
    )
    objective = DFlashObjective(draft, anchors=16, block_decay=2.0, labels="soft").eval()
    with torch.no_grad():
        soft = objective(batch, features, dist)
        objective.labels = "hard"
        hard = objective(batch, features, dist)
        anchors = torch.arange(3, 11)[None]  # every anchor with an assistant token after it
        logits = draft.train_blocks(features, ids, anchors, torch.ones_like(anchors, dtype=bool))
    total = weights = 0.0
    for j, anchor in enumerate(anchors[0].tolist()):
        for k in range(1, min(4, 13 - anchor)):  # slot k reads position anchor + k - 1 < 12
            weight = math.exp(-(k - 1) / 2.0)
            p = target_logits[0, anchor + k - 1].softmax(-1)
            total += weight * -(p * logits[0, j, k].log_softmax(-1)).sum()
            weights += weight
    torch.testing.assert_close(soft.loss, total / weights)
    assert (soft.accepted, soft.blocks) == (hard.accepted, hard.blocks)
    assert not torch.isclose(soft.loss, hard.loss)
    # a distribution over fewer ids (a hard vocabulary's one) would broadcast: refused
    objective.labels = "soft"
    with pytest.raises(ValueError, match=f"all {VOCAB} ids"):
        objective(batch, features, TargetDistribution(dist.probs[..., :1], dist.argmax, None))


def test_block_vocabulary_computes_what_the_labels_read():
    hard, soft = (BlockVocabulary.of(VOCAB, "cpu", labels) for labels in ("hard", "soft"))
    assert hard.t2d.all() and soft.t2d.all() and len(hard.t2d) == VOCAB
    assert hard.hot_ids.tolist() == [0]
    assert soft.hot_ids.tolist() == list(range(VOCAB))
