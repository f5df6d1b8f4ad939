"""Lossless greedy speculative decoding: the output equals the target's own greedy decoding."""

import pytest
import torch

from specforge.engine.cpu.int8_linear import int8_linear_available, quantize_linears
from specforge.engine.cpu.packed_linear import prepack_linears
from specforge.serving.speculative import SpeculativeDecoder
from tests.helpers import StubDraft, greedy_reference, make_tiny_llama, tiny_draft

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return make_tiny_llama(VOCAB, num_layers=4, seed=3, initializer_range=0.2).float()


@pytest.mark.parametrize("num_steps", [1, 3, 5])
@pytest.mark.parametrize("agree", ["always", "never", "sometimes"])
def test_stub_drafts_are_lossless(target, num_steps, agree):
    wrong_at = {
        "always": lambda t: False,
        "never": lambda t: True,
        "sometimes": lambda t: t % 3 == 0,
    }[agree]
    for seed in range(4):
        torch.manual_seed(seed)
        prompt = torch.randint(0, VOCAB, (1, 5 + seed))
        reference = greedy_reference(target, prompt, 24)
        decoder = SpeculativeDecoder(
            target,
            StubDraft(reference, wrong_at, VOCAB),
            aux_layer_ids=[1, 1, 0],
            num_steps=num_steps,
        )
        tokens, stats = decoder.generate(prompt, max_new_tokens=24)
        assert tokens == reference[prompt.shape[1] :]
        assert stats.emitted == 23 and stats.verifications == len(stats.accepted_per_round)
        if agree == "always":
            assert all(a == num_steps for a in stats.accepted_per_round[:-1])
            assert stats.tau > num_steps  # close to num_steps + 1
        if agree == "never":
            assert set(stats.accepted_per_round) == {0} and stats.tau == 1.0


def test_trained_shape_draft_is_lossless_on_many_prompts(target):
    _, draft = tiny_draft(seed=5)
    for seed in range(10):
        torch.manual_seed(100 + seed)
        prompt = torch.randint(0, VOCAB, (1, 3 + seed))
        reference = greedy_reference(target, prompt, 20)
        decoder = SpeculativeDecoder(target, draft, aux_layer_ids=[1, 1, 0], num_steps=4)
        tokens, stats = decoder.generate(prompt, max_new_tokens=20)
        assert tokens == reference[prompt.shape[1] :]
        # every round but the last emits its accepted tokens plus the bonus; the last may be cut
        per_round = [a + 1 for a in stats.accepted_per_round]
        assert sum(per_round[:-1]) < stats.emitted <= sum(per_round)
        assert stats.emitted == len(tokens) - 1  # the first token comes from the prefill
        # the phases are timed inside the whole generation
        assert 0 < stats.draft_seconds and 0 < stats.verify_seconds
        assert stats.draft_seconds + stats.verify_seconds < stats.seconds


def test_eos_inside_an_accepted_block_stops_exactly(target):
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6))
    reference = greedy_reference(target, prompt, 30)[6:]
    eos = reference[9]
    stop = reference.index(eos)
    decoder = SpeculativeDecoder(
        target,
        StubDraft(greedy_reference(target, prompt, 30), lambda t: False, VOCAB),
        aux_layer_ids=[1, 1, 0],
        num_steps=5,
    )
    tokens, stats = decoder.generate(prompt, max_new_tokens=30, eos_token_ids=[eos])
    assert tokens == reference[: stop + 1]
    short, _ = decoder.generate(prompt, max_new_tokens=4, eos_token_ids=[])
    assert short == reference[:4]


def test_no_round_verifies_past_the_turns_budget(target):
    """A round emits at most its verified tokens and the target's own: the last rounds verify
    only what the budget can still use (23 tokens after the prefill's: 6 + 6 + 6, then a chain
    of 4 and the target's token), a tree's levels too."""
    torch.manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6))
    reference = greedy_reference(target, prompt, 30)
    decoder = SpeculativeDecoder(
        target,
        StubDraft(reference, lambda t: False, VOCAB, sure=30.0),
        aux_layer_ids=[1, 1, 0],
        num_steps=5,
    )
    for budget, depths in ((24, [5, 5, 5, 4]), (8, [5, 0]), (2, [0])):
        tokens, stats = decoder.generate(prompt, max_new_tokens=budget)
        assert tokens == reference[prompt.shape[1] :][:budget]
        assert stats.depth_per_round == depths
    trees = SpeculativeDecoder(
        target,
        StubDraft(reference, lambda t: False, VOCAB, sure=30.0),
        aux_layer_ids=[1, 1, 0],
        num_steps=3,
        topk=2,
        num_draft_tokens=6,
    )
    for budget, depths in ((6, [3, 0]), (4, [2]), (9, [3, 3])):
        tokens, stats = trees.generate(prompt, max_new_tokens=budget)
        assert tokens == reference[prompt.shape[1] :][:budget]
        assert stats.depth_per_round == depths


def test_acceptance_statistics():
    from specforge.serving.stats import SpecStats

    stats = SpecStats(num_steps=3, verifications=4, emitted=9, accepted_per_round=[3, 0, 1, 1])
    assert stats.tau == 9 / 4
    assert stats.histogram == {0: 1, 1: 2, 3: 1}
    assert stats.acceptance_per_position == [3 / 4, 1 / 3, 1.0]
    # varying depths (num_steps auto): a position counts only in rounds that verified it
    stats.depth_per_round = [3, 0, 1, 2]
    assert stats.acceptance_per_position == [3 / 3, 1 / 2, 1.0]
    assert stats.depth_histogram == {0: 1, 1: 1, 2: 1, 3: 1}


def test_merged_statistics_add_counts_and_times_and_keep_round_indices_apart():
    from specforge.serving.stats import SpecStats

    first = SpecStats(num_steps=3, verifications=2, emitted=5, accepted_per_round=[3, 0])
    first.depth_per_round, first.lookup_rounds, first.seconds = [3, 1], [1], 0.5
    second = SpecStats(num_steps=3, verifications=3, emitted=4, accepted_per_round=[1, 0, 0])
    second.depth_per_round, second.sibling_hit_rounds = [1, 1, 0], [0, 2]
    second.seconds, second.dormant_rounds = 0.25, 1
    first.merge(second)
    assert (first.verifications, first.emitted, first.seconds) == (5, 9, 0.75)
    assert first.accepted_per_round == [3, 0, 1, 0, 0]
    assert first.depth_per_round == [3, 1, 1, 1, 0]
    assert first.lookup_rounds == [1] and first.sibling_hit_rounds == [2, 4]
    assert first.dormant_rounds == 1 and first.num_steps == 3


@pytest.mark.parametrize(
    ("topk", "num_steps", "num_draft_tokens"), [(2, 3, 6), (3, 4, 12), (4, 2, 9)]
)
@pytest.mark.parametrize("agree", ["always", "never", "sometimes"])
def test_tree_drafting_is_lossless(target, topk, num_steps, num_draft_tokens, agree):
    wrong_at = {
        "always": lambda t: False,
        "never": lambda t: True,
        "sometimes": lambda t: t % 2 == 0,
    }[agree]
    for seed in range(3):
        torch.manual_seed(seed)
        prompt = torch.randint(0, VOCAB, (1, 4 + seed))
        reference = greedy_reference(target, prompt, 20)
        decoder = SpeculativeDecoder(
            target,
            StubDraft(reference, wrong_at, VOCAB),
            aux_layer_ids=[1, 1, 0],
            num_steps=num_steps,
            topk=topk,
            num_draft_tokens=num_draft_tokens,
        )
        tokens, stats = decoder.generate(prompt, max_new_tokens=20)
        assert tokens == reference[prompt.shape[1] :]
        if agree == "always":
            assert stats.tau > 1.5


def test_tree_with_a_random_draft_is_lossless(target):
    _, draft = tiny_draft(seed=7)
    for seed in range(6):
        torch.manual_seed(200 + seed)
        prompt = torch.randint(0, VOCAB, (1, 3 + seed))
        reference = greedy_reference(target, prompt, 20)
        decoder = SpeculativeDecoder(
            target, draft, aux_layer_ids=[1, 1, 0], num_steps=3, topk=3, num_draft_tokens=8
        )
        tokens, _ = decoder.generate(prompt, max_new_tokens=20)
        assert tokens == reference[prompt.shape[1] :]


@pytest.mark.parametrize("weights", ["plain", "packed", "int8"])
def test_a_bfloat16_draft_beside_a_float32_target_is_lossless(target, weights):
    """``bench.draft_dtype`` and ``bench.draft_quantize``: the draft may run in another dtype
    than the target's, with int8 weights; chains, trees and ``auto`` (with siblings) all stay
    the target's greedy decoding."""
    _, draft = tiny_draft(seed=5)
    draft.to(torch.bfloat16)
    if weights == "packed" and prepack_linears(draft, min_weight=0) == 0:
        pytest.skip("this CPU has no native bfloat16 for oneDNN")
    if weights == "int8":
        if not int8_linear_available():
            pytest.skip("no int8 kernel in this build")
        quantize_linears(draft)
    settings = [
        {"num_steps": 3},
        {"num_steps": 3, "topk": 3, "num_draft_tokens": 8},
        {"num_steps": "auto"},
    ]
    for seed in range(4):
        torch.manual_seed(300 + seed)
        prompt = torch.randint(0, VOCAB, (1, 3 + seed))
        reference = greedy_reference(target, prompt, 20)[prompt.shape[1] :]
        for setting in settings:
            decoder = SpeculativeDecoder(target, draft, aux_layer_ids=[1, 1, 0], **setting)
            tokens, stats = decoder.generate(prompt, max_new_tokens=20)
            assert tokens == reference, setting
            assert stats.verifications > 0


def test_tree_of_width_one_is_the_chain(target):
    _, draft = tiny_draft(seed=5)
    torch.manual_seed(1)
    prompt = torch.randint(0, VOCAB, (1, 8))
    chain = SpeculativeDecoder(target, draft, aux_layer_ids=[1, 1, 0], num_steps=4)
    tree = SpeculativeDecoder(
        target, draft, aux_layer_ids=[1, 1, 0], num_steps=4, topk=2, num_draft_tokens=2
    )  # keeps one node: a 1-token chain
    one = SpeculativeDecoder(target, draft, aux_layer_ids=[1, 1, 0], num_steps=1)
    a, stats_a = one.generate(prompt, max_new_tokens=16)
    b, stats_b = tree.generate(prompt, max_new_tokens=16)
    assert a == b and stats_a.accepted_per_round == stats_b.accepted_per_round
    assert chain.generate(prompt, max_new_tokens=16)[0] == a


def test_bad_tree_settings_are_rejected(target):
    _, draft = tiny_draft()
    with pytest.raises(ValueError, match="num_draft_tokens <= 7"):
        SpeculativeDecoder(
            target, draft, aux_layer_ids=[1, 1, 0], num_steps=2, topk=2, num_draft_tokens=50
        )


@pytest.mark.parametrize("kind", ["dynamic", "growing"])
@pytest.mark.parametrize(
    "rows", [[0, 2, 3], [0, 1], [0]], ids=["rows move", "rows in place", "root only"]
)
def test_gather_cache_keeps_the_prefix_and_the_accepted_rows_in_order(kind, rows):
    from transformers import DynamicCache

    from specforge.engine.cache import gather_cache
    from specforge.models.kv_cache import growing_cache

    cache = DynamicCache() if kind == "dynamic" else growing_cache()
    keys = torch.arange(2 * 3 * 9 * 4, dtype=torch.float32).reshape(2, 3, 9, 4)
    cache.update(keys.clone(), -keys.clone(), 0)
    gather_cache(cache, 5, rows)  # a root at 5 and the accepted tree rows after it
    expected = keys[:, :, [0, 1, 2, 3, 4, *[5 + r for r in rows]]]
    assert torch.equal(cache.layers[0].keys, expected)
    assert torch.equal(cache.layers[0].values, -expected)
    assert cache.get_seq_length() == 5 + len(rows)
    # the next append lands right after the kept rows
    more = torch.full((2, 3, 1, 4), -1.0)
    cache.update(more, -more, 0)
    assert torch.equal(cache.layers[0].keys, torch.cat([expected, more], 2))
    assert cache.get_seq_length() == 6 + len(rows)


def test_merged_tree_puts_siblings_beside_the_chain_and_shares_common_prefixes():
    from specforge.serving.tree import merged_tree

    tree, paths = merged_tree([[10, 11, 12], [20], [21]], "cpu")
    assert tree.tokens.tolist() == [10, 11, 12, 20, 21]  # the chain first: its rows stay put
    assert tree.parents.tolist() == [-1, 0, 1, -1, -1]
    assert tree.depths.tolist() == [1, 2, 3, 1, 1]
    assert paths == [[0, 1, 2], [3], [4]]
    # a proposal that shares the chain's first two tokens branches off after them
    tree, paths = merged_tree([[10, 11, 12], [10, 11, 30, 31], [20], [10]], "cpu")
    assert tree.tokens.tolist() == [10, 11, 12, 30, 31, 20]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 3, -1]
    assert tree.depths.tolist() == [1, 2, 3, 3, 4, 1]
    assert paths == [[0, 1, 2], [0, 1, 3, 4], [5], [0]]


def test_pruned_tree_puts_the_greedy_chain_first_and_parents_before_children():
    from specforge.serving.tree import prune

    # node: parent, depth, cumulative log-probability
    parents = [-1, -1, 0, 0, 1, 2]
    depths = [1, 1, 2, 2, 2, 3]
    scores = [-0.1, -1.0, -0.3, -2.0, -1.2, -0.5]
    tree = prune(list(range(100, 106)), parents, depths, scores, 5, torch.device("cpu"))
    # kept: the five best (node 3 dropped), depth first with each node's best child first
    assert tree.tokens.tolist() == [100, 102, 105, 101, 104]
    assert tree.parents.tolist() == [-1, 0, 1, -1, 3]
    assert tree.depths.tolist() == [1, 2, 3, 1, 2]


def test_a_tree_verification_leaves_other_threads_masks_alone(target):
    """While one thread verifies a tree, another thread's forward on a model of the same
    attention implementation builds its ordinary causal mask: the tree lives in a context
    variable, not in transformers' process-wide mask registry."""
    import threading

    from specforge.serving.tree import tree_attention

    other = make_tiny_llama(VOCAB, num_layers=4, seed=5, initializer_range=0.2).float()
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = other(ids).logits
    inside, done, seen = threading.Event(), threading.Event(), {}

    def plain_forward():
        inside.wait()
        with torch.no_grad():
            seen["logits"] = other(ids).logits
        done.set()

    thread = threading.Thread(target=plain_forward)
    thread.start()
    visible = torch.eye(3, dtype=torch.bool)  # three siblings: none sees another
    with tree_attention(target, torch.tensor([4, 4, 4]), visible, prefix=4):
        inside.set()
        assert done.wait(60)
        with torch.no_grad():
            target(torch.randint(0, VOCAB, (1, 7)))  # the tree's own forward, masked as a tree
    thread.join()
    torch.testing.assert_close(seen["logits"], expected, rtol=0, atol=0)
