"""The engine on a CUDA device, where compiled means CUDA graphs: the replayed forwards decode as
the eager engine and transformers do (the target alone, the draft's forwards, and the runtime's
chain, tree and ``auto``; batched decode steps), and a longer sequence's new buffers are
captured again rather than replayed stale. Skipped without a GPU."""

import pytest
import torch

from specforge.engine.batch import SlotBatcher, batcher_for
from specforge.engine.cache import SPAN_STEP
from specforge.engine.draft import DraftEngine
from specforge.engine.generation import GenerationSettings, Request
from specforge.engine.graphs import CudaGraphs
from specforge.engine.target import TargetEngine
from specforge.serving.speculative import SpeculativeDecoder
from tests.engine.test_generation import PROMPTS
from tests.helpers import greedy_reference, make_tiny_llama, tiny_draft

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB = 96
AUX = [1, 1, 0]


@pytest.fixture(scope="module")
def target():
    model = make_tiny_llama(VOCAB, num_layers=4, seed=3, initializer_range=0.2)
    return model.float().to("cuda")


def prompts(count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (1, 3 + 4 * i), generator=generator).to("cuda")
        for i in range(count)
    ]


def test_the_target_alone_replays_as_it_decodes_eagerly(target):
    graphs = TargetEngine(target, aux_layer_ids=AUX, compile=True)
    eager = TargetEngine(target, aux_layer_ids=AUX, compile=False)
    assert isinstance(graphs._run, CudaGraphs)
    for prompt in prompts(3):
        # 300 new tokens cross a key span (256 slots)
        expected = eager.generate(prompt, max_new_tokens=300)
        assert graphs.generate(prompt, max_new_tokens=300) == expected
        assert expected == greedy_reference(target, prompt, 300)[prompt.shape[1] :]
    captured = graphs._run.captures
    assert captured == len(graphs._run.graphs) == 2  # one token at spans of 256 and 512
    longer = torch.cat(prompts(3), 1).repeat(1, 30)
    assert longer.shape[1] + 40 > 2 * SPAN_STEP  # more slots than the buffers hold
    assert graphs.generate(longer, max_new_tokens=40) == eager.generate(longer, max_new_tokens=40)
    assert graphs._run.captures > captured  # captured again over the new buffers


@pytest.mark.parametrize(
    ("num_steps", "topk", "num_draft_tokens"),
    [(4, 1, None), (3, 2, 6), ("auto", 1, None)],
    ids=["chain", "tree", "auto"],
)
def test_the_runtime_over_cuda_graphs_is_lossless(target, num_steps, topk, num_draft_tokens):
    _, draft = tiny_draft(seed=5)
    decoder = SpeculativeDecoder(
        target,
        draft.to("cuda"),
        aux_layer_ids=AUX,
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
        engine=TargetEngine(target, aux_layer_ids=AUX, compile=True),
    )
    assert (decoder.draft_engine is not None) == (topk == 1)  # a chain's draft replays too
    for prompt in prompts(6, seed=1):
        reference = greedy_reference(target, prompt, 40)[prompt.shape[1] :]
        tokens, stats = decoder.generate(prompt, max_new_tokens=40)
        assert tokens == reference
        assert stats.emitted == len(tokens) - 1


def test_the_drafts_forwards_replay_as_they_run_eagerly():
    """The same kernels replayed: the draft engine's outputs equal its eager ones exactly."""
    target, draft = tiny_draft(seed=5)
    draft = draft.to("cuda")
    engines = [DraftEngine(draft, graphs=graphs) for graphs in (True, False)]
    caches = [engine.new_cache(64) for engine in engines]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, 40), generator=generator).to("cuda")
    aux = torch.randn(1, 40, 3 * target.config.hidden_size, generator=generator).to("cuda")
    outputs = [[] for _ in engines]
    for engine, cache, out in zip(engines, caches, outputs, strict=True):
        _, hidden = engine.forward(tokens[:, :30], aux[:, :30], cache, extend=True)
        for k in range(2):  # the step graph captured, then replayed
            logits, hidden = engine.forward(tokens[:, 30 + k : 31 + k], hidden, cache, extend=False)
            out += [logits, hidden]
        cache.crop(31)
        for _ in range(2):  # an extension graph captured, then replayed
            start = cache.length
            logits, hidden = engine.forward(
                tokens[:, start : start + 3], aux[:, start : start + 3], cache, extend=True
            )
            out += [logits, hidden]
    for ours, eager in zip(*outputs, strict=True):
        assert torch.equal(ours, eager)
    assert engines[0]._step.captures == engines[0]._extend.captures == 1


def test_batched_decode_steps_replay_as_they_run_eagerly(target):
    """Continuous batching on a GPU replays its decode steps: the same answers as its eager
    steps, while rows join, leave and the cache grows for longer prompts."""
    settings = GenerationSettings(max_new_tokens=12, eos_ids=[1, 33], pad_id=0, max_batch_size=3)
    batcher = batcher_for(target, settings)
    assert isinstance(batcher, SlotBatcher) and batcher.graphs
    prompts = PROMPTS + [prompt * 40 for prompt in PROMPTS]  # up to 800 tokens
    eager = SlotBatcher(target, settings, graphs=False)
    answers = [
        {c.key: c.tokens for c in run.run([Request(i, p) for i, p in enumerate(prompts)])}
        for run in (batcher, eager)
    ]
    assert answers[0] == answers[1]
