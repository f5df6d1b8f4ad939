"""The draft through the engine (eager here; replayed as CUDA graphs on a GPU,
``test_cuda_graphs.py``): a slot cache and a masked key span give the draft's own outputs, and
the runtime's chains over it stay the target's greedy output."""

import pytest
import torch

from specforge.engine.cache import crop_cache
from specforge.engine.draft import DraftEngine
from specforge.engine.target import TargetEngine
from specforge.models.eagle3 import DraftKVCache
from specforge.serving.speculative import SpeculativeDecoder
from tests.helpers import greedy_reference, tiny_draft

AUX = [1, 1, 0]


@pytest.fixture(scope="module")
def models():
    target, draft = tiny_draft(seed=5)
    return target, draft


def test_the_draft_engine_gives_the_drafts_own_outputs(models):
    """An extension over a prompt, three steps, a crop back and another extension: the same
    logits and states as the draft's forward over its growing cache (float32 roundings of a
    longer, masked key span apart)."""
    target, draft = models
    engine = DraftEngine(draft, graphs=False)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 96, (1, 40), generator=generator)
    aux = torch.randn(1, 40, 3 * target.config.hidden_size, generator=generator)
    ours, theirs = engine.new_cache(64), DraftKVCache()

    def reference(ids, states, start, extend):
        positions = torch.arange(start, start + ids.shape[1])[None]
        hidden = draft.fuse(states) if extend else states
        with torch.no_grad():
            logits, hidden = draft(ids, hidden, positions, cache=theirs, logits_to_keep=1)
        return logits[0, -1], hidden[:, -1:]

    def check(ids, states, extend):
        start = theirs.length
        logits, hidden = engine.forward(ids, states, ours, extend=extend)
        expected_logits, expected_hidden = reference(ids, states, start, extend)
        torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(hidden, expected_hidden, rtol=0, atol=1e-5)
        return logits, hidden

    _, hidden = check(tokens[:, :30], aux[:, :30], extend=True)
    for k in range(3):
        _, hidden = check(tokens[:, 30 + k : 31 + k], hidden, extend=False)
    for cache in (ours, theirs):
        crop_cache(cache, 31)
    check(tokens[:, 31:34], aux[:, 31:34], extend=True)
    assert ours.length == theirs.length == 34


@pytest.mark.parametrize("num_steps", [4, "auto"], ids=["chain", "auto"])
def test_the_runtime_over_the_draft_engine_is_lossless(models, num_steps):
    target, draft = models
    decoder = SpeculativeDecoder(
        target,
        draft,
        aux_layer_ids=AUX,
        num_steps=num_steps,
        engine=TargetEngine(target, aux_layer_ids=AUX, compile=False),
        draft_engine=DraftEngine(draft, graphs=False),
    )
    generator = torch.Generator().manual_seed(1)
    accepted = 0
    for length in (3, 9, 17):
        prompt = torch.randint(0, 96, (1, length), generator=generator)
        reference = greedy_reference(target, prompt, 40)[length:]
        tokens, stats = decoder.generate(prompt, max_new_tokens=40)
        assert tokens == reference
        accepted += sum(stats.accepted_per_round)
    if num_steps != "auto":  # (a random draft's auto mostly sleeps)
        assert accepted > 0  # the draft's proposals were used


def test_graphs_need_a_cuda_device(models):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, not cpu"):
        DraftEngine(models[1], graphs=True)
