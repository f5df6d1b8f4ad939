import pytest
import torch

from specforge.data.chat import TokenizedSample
from specforge.data.hidden_states import (
    check_disk_space,
    check_manifest_matches,
    forward_batches,
    last_hidden_positions,
    plan_shards,
    sample_bytes,
)
from specforge.errors import UserError


def sample(name, length, masked_from):
    mask = torch.zeros(length, dtype=torch.bool)
    mask[masked_from:] = True
    return TokenizedSample(name, torch.arange(length), mask)


def test_last_hidden_is_kept_where_the_shifted_loss_mask_holds():
    mask = torch.tensor([0, 0, 1, 1, 0, 1], dtype=torch.bool)
    # position p feeds the loss when token p + 1 is under the mask
    assert last_hidden_positions(mask).tolist() == [False, True, True, False, True, False]


def test_shards_are_sorted_by_length_and_filled_to_the_budget():
    samples = [sample(f"s{i}", 10 + (i * 7) % 23, 5) for i in range(20)]
    per = [
        sample_bytes(
            len(s.input_ids),
            int(last_hidden_positions(s.loss_mask).sum()),
            hidden_size=8,
            itemsize=2,
        )
        for s in samples
    ]
    budget = 3 * max(per)
    plan = plan_shards(samples, header={}, hidden_size=8, itemsize=2, shard_bytes=budget)
    order = [i for shard in plan.shards for i in shard]
    assert sorted(order) == list(range(20))
    lengths = [len(samples[i].input_ids) for i in order]
    assert lengths == sorted(lengths, reverse=True)
    assert all(size <= budget for size in plan.shard_bytes)
    assert plan.shard_bytes == [sum(per[i] for i in shard) for shard in plan.shards]
    # the plan is a function of the samples, not of their order
    again = plan_shards(samples[::-1], header={}, hidden_size=8, itemsize=2, shard_bytes=budget)
    ids = [[samples[i].id for i in shard] for shard in plan.shards]
    assert ids == [[samples[::-1][i].id for i in shard] for shard in again.shards]


def test_forward_batches_respect_the_token_budget():
    lengths = [50, 40, 40, 30, 10, 10, 10, 10]
    batches = forward_batches(lengths, batch_tokens=100, max_batch_size=3)
    assert [list(b) for b in batches] == [[0, 1], [2, 3], [4, 5, 6], [7]]
    assert all(lengths[b.start] * len(b) <= 100 for b in batches)


def test_not_enough_disk_is_refused_with_both_figures(tmp_path):
    check_disk_space(tmp_path, 1024)
    with pytest.raises(UserError, match=r"needs about .* GiB more in .* but only .* GiB are free"):
        check_disk_space(tmp_path, 2**60)


def test_manifest_mismatch_names_every_field():
    manifest = {"target": {"config_hash": "a", "tokenizer_hash": "b"}, "aux_layer_ids": [1, 2, 3]}
    check_manifest_matches(manifest, {"target.config_hash": "a", "aux_layer_ids": [1, 2, 3]}, "D")
    with pytest.raises(
        ValueError,
        match=r"target.tokenizer_hash: captured 'b', given 'c'.*"
        r"aux_layer_ids: captured \[1, 2, 3\], given \[0, 1, 2\]",
    ):
        check_manifest_matches(
            manifest, {"target.tokenizer_hash": "c", "aux_layer_ids": [0, 1, 2]}, "D"
        )
