import torch

from specforge.data.batching import collate
from specforge.data.chat import TokenizedSample, scored_positions
from specforge.trainer.state_cache import TargetStateCache


def sample(sample_id: str, ids: list[int], masked_from: int) -> TokenizedSample:
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[masked_from:] = True
    return TokenizedSample(sample_id, torch.tensor(ids), mask)


def states(batch, seed: int):
    generator = torch.Generator().manual_seed(seed)
    rows, length = batch.input_ids.shape
    aux = torch.randn(rows, length, 6, generator=generator)
    last = torch.randn(rows, length, 2, generator=generator)
    argmax = torch.randint(0, 100, (rows, length), generator=generator)
    return aux, last, argmax


def test_kept_states_rebuild_a_batch_in_another_order_and_padding():
    """Rows kept from one padded batch rebuild another batch of them: the aux layers at every
    real token, the final hidden state and the target's argmax wherever the loss reads it."""
    a, b = sample("a", [5, 6, 7, 8, 9], 2), sample("b", [5, 6, 7], 1)
    first = collate([a, b])
    aux, last, argmax = states(first, 0)
    cache = TargetStateCache(budget_bytes=1 << 20)
    assert cache.lookup(first) is None
    cache.store(first, aux, last, argmax)
    again = collate([b, a])  # b first: padded to a's length now
    kept_aux, kept_last, kept_argmax = cache.lookup(again)
    assert (cache.hits, cache.misses) == (1, 1)
    torch.testing.assert_close(kept_aux[0, :3], aux[1, :3], rtol=0, atol=0)
    torch.testing.assert_close(kept_aux[1], aux[0], rtol=0, atol=0)
    scored = scored_positions(again.loss_mask, again.attention_mask)
    torch.testing.assert_close(kept_last[1][scored[1]], last[0][scored[1]], rtol=0, atol=0)
    torch.testing.assert_close(kept_last[0][scored[0]], last[1, :3][scored[0, :3]], rtol=0, atol=0)
    assert torch.equal(kept_argmax[1][scored[1]], argmax[0][scored[1]])
    assert torch.equal(kept_argmax[0][scored[0]], argmax[1, :3][scored[0, :3]])


def test_another_conversation_under_a_kept_id_is_a_miss():
    """A file that reuses a kept id for other tokens gets the target's states, never the
    kept conversation's."""
    cache = TargetStateCache(budget_bytes=1 << 20)
    first = collate([sample("q1", [1, 2, 3, 4], 1)])
    cache.store(first, *states(first, 0))
    for other in ([1, 2, 3, 5], [1, 2, 3]):
        assert cache.lookup(collate([sample("q1", other, 1)])) is None
    mixed = collate([sample("q1", [1, 2, 3, 4], 1), sample("q2", [1, 2], 1)])
    assert cache.lookup(mixed) is None  # one row not kept: the target runs for the batch


def test_conversations_are_kept_until_the_budget_is_spent():
    cache = TargetStateCache(budget_bytes=0)
    batch = collate([sample("a", [1, 2, 3], 1)])
    cache.store(batch, *states(batch, 0))
    assert len(cache) == 0 and cache.lookup(batch) is None
    one = TargetStateCache(budget_bytes=1 << 20)
    one.store(batch, *states(batch, 0))
    budget = one.used_bytes
    cache = TargetStateCache(budget_bytes=budget)
    both = collate([sample("a", [1, 2, 3], 1), sample("b", [4, 5, 6], 1)])
    cache.store(both, *states(both, 1))
    assert len(cache) == 1 and cache.used_bytes <= budget
