"""The engine where compiled means CUDA graphs: the replayed forwards decode as the eager engine
and transformers do (the target alone, the draft's forwards, and the runtime's chain, tree and
``auto``; batched decode steps), and a longer sequence's new buffers are captured again rather
than replayed stale. On a CUDA device, and on the CPU through the suite's model of CUDA graphs
(:mod:`tests.engine.fake_graphs`: recorded once, replayed without the Python around them,
outputs poisoned by every other graph's replay)."""

import pytest
import torch

from specforge.engine.batch import SlotRows, batcher_for, slot_batcher
from specforge.engine.cache import SPAN_STEP
from specforge.engine.draft import DraftEngine
from specforge.engine.generation import GenerationSettings, Request
from specforge.engine.graphs import CudaGraphs
from specforge.engine.target import TargetEngine
from specforge.serving.speculative import SpeculativeDecoder
from tests.engine.fake_graphs import use_fake_graphs
from tests.engine.test_generation import PROMPTS
from tests.helpers import greedy_reference, make_tiny_llama, tiny_draft

VOCAB = 96
AUX = [1, 1, 0]


@pytest.fixture(params=["cuda", "cpu"], ids=["cuda", "cpu-model"])
def device(request, monkeypatch):
    """A CUDA device, or the CPU with graphs modelled (:mod:`tests.engine.fake_graphs`)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if request.param == "cpu":
        use_fake_graphs(monkeypatch)
    return torch.device(request.param)


@pytest.fixture
def target(device):
    model = make_tiny_llama(VOCAB, num_layers=4, seed=3, initializer_range=0.2)
    return model.float().to(device)


def prompts(count: int, device, seed: int = 0):
    """``count`` random prompts of 3, 7, ... tokens (fewer on the CPU model: replays there are
    eager-speed, so one or two carry the same checks)."""
    count = count if device.type == "cuda" else max(1, count // 3)
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB, (1, 3 + 4 * i), generator=generator).to(device)
        for i in range(count)
    ]


def test_the_target_alone_replays_as_it_decodes_eagerly(target):
    graphs = TargetEngine(target, aux_layer_ids=AUX, compile=True)
    eager = TargetEngine(target, aux_layer_ids=AUX, compile=False)
    assert isinstance(graphs._run, CudaGraphs)
    for prompt in prompts(3, target.device):
        # 300 new tokens cross a key span (256 slots)
        expected = eager.generate(prompt, max_new_tokens=300)
        assert graphs.generate(prompt, max_new_tokens=300) == expected
        assert expected == greedy_reference(target, prompt, 300)[prompt.shape[1] :]
    captured = graphs._run.captures
    assert captured == len(graphs._run.graphs) == 2  # one token at spans of 256 and 512
    longer = torch.randint(0, VOCAB, (1, 540), generator=torch.Generator().manual_seed(4))
    longer = longer.to(target.device)
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
        draft.to(target.device),
        aux_layer_ids=AUX,
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
        engine=TargetEngine(target, aux_layer_ids=AUX, compile=True),
    )
    assert (decoder.draft_engine is not None) == (topk == 1)  # a chain's draft replays too
    for prompt in prompts(6, target.device, seed=1):
        reference = greedy_reference(target, prompt, 40)[prompt.shape[1] :]
        tokens, stats = decoder.generate(prompt, max_new_tokens=40)
        assert tokens == reference
        assert stats.emitted == len(tokens) - 1


def test_the_drafts_forwards_replay_as_they_run_eagerly(device):
    """The same kernels replayed: the draft engine's outputs equal its eager ones exactly."""
    target, draft = tiny_draft(seed=5)
    draft = draft.to(device)
    engines = [DraftEngine(draft, graphs=graphs) for graphs in (True, False)]
    caches = [engine.new_cache(64) for engine in engines]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, 40), generator=generator).to(device)
    aux = torch.randn(1, 40, 3 * target.config.hidden_size, generator=generator).to(device)
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
    assert isinstance(batcher.rows, SlotRows) and batcher.rows.graphs
    prompts = PROMPTS + [prompt * 40 for prompt in PROMPTS]  # up to 800 tokens
    eager = slot_batcher(target, settings, graphs=False)
    answers = [
        {c.key: c.tokens for c in run.run([Request(i, p) for i, p in enumerate(prompts)])}
        for run in (batcher, eager)
    ]
    assert answers[0] == answers[1]


def test_a_prepared_runtime_captures_nothing_over_mt_bench_like_turns(target):
    """Captures stay out of timed turns: prepared for the longest sequence of a run, the
    runtime decodes prompts of MT-Bench's first- and second-turn lengths (up to 400 tokens,
    two key spans) without capturing a graph, its outputs the target's own."""
    _, draft = tiny_draft(seed=5)
    engine = TargetEngine(target, aux_layer_ids=AUX, compile=True)
    decoder = SpeculativeDecoder(
        target, draft.to(target.device), aux_layer_ids=AUX, num_steps=3, engine=engine
    )
    lengths, new_tokens = [90, 400, 60, 180], 16
    built = decoder.prepare(max(lengths) + new_tokens)
    captured = engine._run.captures + decoder.draft_engine.captures
    assert built == captured > 0
    generator = torch.Generator().manual_seed(2)
    for length in lengths:
        prompt = torch.randint(0, VOCAB, (1, length), generator=generator).to(target.device)
        tokens, _ = decoder.generate(prompt, max_new_tokens=new_tokens)
        assert tokens == engine.generate(prompt, max_new_tokens=new_tokens)
    assert engine._run.captures + decoder.draft_engine.captures == captured
