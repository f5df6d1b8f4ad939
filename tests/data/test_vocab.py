import logging

import pytest
import torch

from specforge.data.chat import end_of_turn_ids
from specforge.data.vocab import (
    VocabMap,
    build_vocab_map,
    count_token_frequencies,
    load_vocab_map,
    save_vocab_map,
)


def test_counts_only_masked_tokens():
    ids = torch.tensor([5, 5, 7, 9, 9, 9])
    mask = torch.tensor([False, True, True, True, True, False])
    counts = count_token_frequencies([(ids, mask), (ids, mask)], vocab_size=12)
    assert counts.tolist() == [0, 0, 0, 0, 0, 2, 0, 2, 0, 4, 0, 0]
    with pytest.raises(ValueError, match="token id 12 is outside vocab_size=12"):
        count_token_frequencies([(torch.tensor([12]), torch.tensor([True]))], vocab_size=12)


def test_top_k_by_count_ties_by_id_and_maps():
    counts = torch.tensor([0, 3, 7, 3, 0, 9, 3, 1])
    vocab_map = build_vocab_map(counts, 4)
    # 5 (9), 2 (7), then the tie at 3 among ids 1, 3, 6 -> 1 (smaller id first)
    assert sorted(vocab_map.hot_ids.tolist()) == [1, 2, 3, 5]
    assert vocab_map.d2t.tolist() == [1 - 0, 2 - 1, 3 - 2, 5 - 3]
    assert vocab_map.t2d.tolist() == [False, True, True, True, False, True, False, False]
    assert torch.equal(torch.arange(4) + vocab_map.d2t, vocab_map.hot_ids)


def test_end_of_turn_tokens_are_always_included():
    counts = torch.tensor([0, 3, 7, 3, 0, 9, 3, 1])
    vocab_map = build_vocab_map(counts, 3, always_include=[4])  # id 4 never seen
    assert vocab_map.hot_ids.tolist() == [2, 4, 5]  # the least frequent pick (1) made room


def test_larger_than_seen_fills_unseen_ids_in_order(caplog):
    counts = torch.tensor([0, 0, 5, 0, 2, 0])
    with caplog.at_level(logging.INFO):
        vocab_map = build_vocab_map(counts, 4)
    assert vocab_map.hot_ids.tolist() == [0, 1, 2, 4]
    assert "exceeds the 2 distinct assistant tokens seen" in caplog.text


def test_deterministic_and_roundtrip(tmp_path):
    torch.manual_seed(0)
    counts = torch.randint(0, 5, (1000,))
    first = build_vocab_map(counts, 100, always_include=[999])
    second = build_vocab_map(counts.clone(), 100, always_include=[999])
    assert torch.equal(first.d2t, second.d2t) and torch.equal(first.t2d, second.t2d)
    path = tmp_path / "vocab.safetensors"
    save_vocab_map(first, path)
    loaded = load_vocab_map(path)
    assert torch.equal(loaded.d2t, first.d2t) and torch.equal(loaded.t2d, first.t2d)
    assert loaded.d2t.dtype == torch.long and loaded.t2d.dtype == torch.bool
    assert loaded.draft_vocab_size == 100 and loaded.vocab_size == 1000


@pytest.mark.parametrize("size", [0, 9])
def test_bad_sizes(size):
    with pytest.raises(ValueError, match=f"draft_vocab_size must be in 1..8, got {size}"):
        build_vocab_map(torch.ones(8, dtype=torch.long), size)


def test_check_catches_inconsistent_maps():
    with pytest.raises(ValueError, match="same target id"):
        VocabMap(d2t=torch.tensor([1, 0]), t2d=torch.tensor([False, True, False])).check()
    with pytest.raises(ValueError, match="t2d does not mark"):
        VocabMap(d2t=torch.tensor([0, 0]), t2d=torch.tensor([True, False, True])).check()


def test_end_of_turn_ids(tiny_tokenizer):
    class GenerationConfig:
        eos_token_id = [7, tiny_tokenizer.eos_token_id]

    assert end_of_turn_ids(tiny_tokenizer, GenerationConfig()) == sorted(
        {7, tiny_tokenizer.eos_token_id}
    )
