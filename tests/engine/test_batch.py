"""Continuous batching through the engine's row-slot cache (eager here; its decode steps replay
CUDA graphs on a GPU): what the target gives one prompt at a time (fp32, greedy) while rows join
into finished rows' places, follow-up turns grow the cache, and sampled answers do not depend on
their batch."""

import pytest
import torch

from specforge.engine.batch import RowSlotCache, SlotRows, batcher_for, slot_batcher
from specforge.engine.cache import SPAN_STEP
from specforge.engine.generation import ContinuousBatcher, GenerationSettings, Request
from tests.engine.test_generation import PROMPTS, one_at_a_time
from tests.helpers import make_tiny_llama

EOS = [1, 33]  # 33 also ends, so rows end early


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(96, seed=4, eos_token_id=1, initializer_range=0.2).float()


def answers(batcher, pending):
    return {c.key: (c.tokens, c.stopped) for c in batcher.run(pending)}


def test_slot_batching_equals_one_prompt_at_a_time(model):
    settings = GenerationSettings(max_new_tokens=12, eos_ids=EOS, pad_id=0, max_batch_size=3)
    batcher = slot_batcher(model, settings, graphs=False)
    got = answers(batcher, [Request(i, p) for i, p in enumerate(PROMPTS)])
    assert sorted(got) == list(range(len(PROMPTS)))
    stopped_early = 0
    for i, prompt in enumerate(PROMPTS):
        reference = one_at_a_time(model, prompt, 12, EOS)
        tokens, stopped = got[i]
        if stopped:
            reference = reference[: reference.index(tokens[-1]) + 1]
            stopped_early += len(tokens) < 12
        assert tokens == reference, i
        assert stopped == (tokens[-1] in EOS)
    assert stopped_early  # some rows left early and others took their places
    assert batcher.steps > 0 and isinstance(batcher.rows, SlotRows)


def test_follow_up_turns_longer_than_the_cache_grow_it(model):
    """A second turn longer than the cache's rows joins while another row still decodes: the
    cache grows and the running row's keys come along."""
    generator = torch.Generator().manual_seed(0)
    first = {0: torch.randint(2, 96, (200,), generator=generator).tolist(), 1: [5, 9, 2]}
    eos = [one_at_a_time(model, first[1], 20, [])[4]]  # the short prompt's row ends first
    assert eos[0] not in one_at_a_time(model, first[0], 20, [])[:6]
    settings = GenerationSettings(max_new_tokens=20, eos_ids=eos, pad_id=0, max_batch_size=2)
    batcher = slot_batcher(model, settings, graphs=False)
    pending = [Request(("first", i), p) for i, p in first.items()]
    asked, seen = dict(first), []
    for completion in batcher.run(pending):
        turn, i = completion.key
        prompt = first[i] if turn == "first" else asked[i]
        reference = one_at_a_time(model, prompt, 20, eos)
        if completion.stopped:
            reference = reference[: reference.index(eos[0]) + 1]
        assert completion.tokens == reference, completion.key
        seen.append(completion.key)
        if turn == "first":
            asked[i] = first[i] + completion.tokens + [7] * 300
            pending.append(Request(("second", i), asked[i]))
            if i == 1:  # the long first turn still runs
                assert ("first", 0) not in seen
    assert sorted(seen) == [("first", 0), ("first", 1), ("second", 0), ("second", 1)]
    # 200 + 20 slots fit 256; a second turn's 500 + 20 did not
    assert batcher.rows.capacity == 3 * SPAN_STEP


def test_sampled_answers_do_not_depend_on_the_batch(model):
    runs = []
    for batch_size in (1, 3):
        settings = GenerationSettings(
            max_new_tokens=10, eos_ids=EOS, pad_id=0, max_batch_size=batch_size, temperature=1.0
        )
        pending = [Request(i, p, seed=100 + i) for i, p in enumerate(PROMPTS)]
        runs.append(answers(slot_batcher(model, settings, graphs=False), pending))
    assert runs[0] == runs[1]
    greedy = GenerationSettings(max_new_tokens=10, eos_ids=EOS, pad_id=0, max_batch_size=3)
    pending = [Request(i, p) for i, p in enumerate(PROMPTS)]
    assert answers(slot_batcher(model, greedy, graphs=False), pending) != runs[0]


def test_a_cpu_batches_through_transformers(model):
    settings = GenerationSettings(max_new_tokens=4, eos_ids=EOS, pad_id=0)
    assert type(batcher_for(model, settings)) is ContinuousBatcher


def test_a_second_run_starts_from_nothing_the_first_left(model):
    """What a run knows of its rows (their lengths) dies with it: a second run on the same
    batcher answers as a fresh batcher does."""
    settings = GenerationSettings(max_new_tokens=8, eos_ids=EOS, pad_id=0, max_batch_size=3)
    batcher = slot_batcher(model, settings, graphs=False)
    answers(batcher, [Request(i, p) for i, p in enumerate(PROMPTS)])
    again = answers(batcher, [Request(i, p) for i, p in enumerate(PROMPTS[:4])])
    fresh = answers(
        slot_batcher(model, settings, graphs=False),
        [Request(i, p) for i, p in enumerate(PROMPTS[:4])],
    )
    assert again == fresh


def test_a_draining_batch_steps_over_a_smaller_row_bucket(model):
    """Sixteen rows, no prompt left to take a finished row's index: once eight or fewer live,
    they move to the front and the steps cover 8 rows, with every answer unchanged."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 96, (3 + i,), generator=generator).tolist() for i in range(16)]
    settings = GenerationSettings(max_new_tokens=16, eos_ids=EOS, pad_id=0, max_batch_size=16)
    batcher = slot_batcher(model, settings, graphs=False)
    got = answers(batcher, [Request(i, p) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        tokens, stopped = got[i]
        reference = one_at_a_time(model, prompt, 16, EOS)
        assert tokens == (reference[: reference.index(tokens[-1]) + 1] if stopped else reference)
    assert batcher.rows.rows_per_step[16] and batcher.rows.rows_per_step[8]


def test_growing_the_cache_holds_one_layer_twice_at_most():
    """Each layer's old buffers are gone before the next layer's new ones are allocated."""
    import weakref

    like = [torch.zeros(2, 1, 4, 8) for _ in range(3)]
    cache = RowSlotCache(like, rows=2, capacity=SPAN_STEP)
    cache.layers[1].keys[0, 0, 5] = 7.0
    old = [weakref.ref(layer.keys) for layer in cache.layers]
    alive_after = []
    cache.grow(2 * SPAN_STEP, done=lambda i: alive_after.append([o() is not None for o in old]))
    assert alive_after == [[False, True, True], [False, False, True], [False, False, False]]
    assert cache.capacity == 2 * SPAN_STEP and cache.layers[1].keys.shape[2] == 2 * SPAN_STEP + 1
    assert bool((cache.layers[1].keys[0, 0, 5] == 7.0).all())  # what the rows held came along
