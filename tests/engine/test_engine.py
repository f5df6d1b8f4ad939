"""The engine: a cache written by slot and the target's forward over a bounded set of shapes,
eager and compiled, equal to transformers' own decoding (greedy, float32) for the target alone
and for the speculative runtime (chain, tree, ``auto``), within two compiled graphs."""

import functools
import logging

import pytest
import torch

from specforge.engine.cache import SPAN_STEP, SlotKVCache, gather_cache, key_span
from specforge.engine.cpu import decode_kernel, row_buckets
from specforge.engine.cpu.packed_linear import PackedLinear
from specforge.engine.cpu.row_buckets import row_buckets_missing
from specforge.engine.generation import ContinuousBatcher, GenerationSettings, Request
from specforge.engine.prompt_lookup import longest_match, ngram_candidates
from specforge.engine.target import TargetEngine, build_engine
from specforge.errors import UserError
from specforge.serving.speculative import SpeculativeDecoder
from tests.helpers import EVERY_KERNEL_PLAN, greedy_reference, make_tiny_llama, tiny_draft

VOCAB = 96
AUX = [1, 1, 0]


def prompt_lookup_generate(engine, prompt, *, max_new_tokens, num_tokens, eos_token_ids=()):
    """Prompt-lookup decoding through the runtime's loop (the bench's baseline): the tokens
    and the verification rounds."""
    decoder = SpeculativeDecoder.prompt_lookup(engine, num_tokens)
    tokens, stats = decoder.generate(
        prompt, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids
    )
    return tokens, stats.verifications


@pytest.fixture(scope="module")
def target():
    # frozen, as load_target's: the compiled engine packs the layers' weights
    model = make_tiny_llama(VOCAB, num_layers=4, seed=3, initializer_range=0.2).float()
    return model.requires_grad_(False)


@pytest.fixture(scope="module")
def compiled(target):
    """One compiled engine for the module's tests: its graphs are built once, by the first."""
    # every kernel of a row plan, whichever this CPU measures fastest
    return TargetEngine(target, aux_layer_ids=AUX, compile=True, row_buckets=EVERY_KERNEL_PLAN)


def prompts(count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, 3 + 4 * i), generator=generator) for i in range(count)]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_the_target_alone_decodes_as_hf_generate(target, compiled, compile):
    engine = compiled if compile else TargetEngine(target, aux_layer_ids=AUX, compile=False)
    for prompt in prompts(4):
        # 300 new tokens cross a key span (256 slots)
        reference = greedy_reference(target, prompt, 300)[prompt.shape[1] :]
        assert engine.generate(prompt, max_new_tokens=300) == reference
    assert {span for _, span in engine.stats.shapes} == {SPAN_STEP, 2 * SPAN_STEP}


@pytest.mark.parametrize(
    ("num_steps", "topk", "num_draft_tokens"),
    [(4, 1, None), (3, 2, 6), ("auto", 1, None)],
    ids=["chain", "tree", "auto"],
)
def test_the_runtime_through_the_compiled_engine_is_lossless(
    target, compiled, num_steps, topk, num_draft_tokens
):
    _, draft = tiny_draft(seed=5)
    decoder = SpeculativeDecoder(
        target,
        draft,
        aux_layer_ids=AUX,
        num_steps=num_steps,
        topk=topk,
        num_draft_tokens=num_draft_tokens,
        engine=compiled,
    )
    for prompt in prompts(6, seed=1):
        reference = greedy_reference(target, prompt, 40)[prompt.shape[1] :]
        tokens, stats = decoder.generate(prompt, max_new_tokens=40)
        assert tokens == reference
        assert stats.emitted == len(tokens) - 1


def test_a_multi_turn_run_compiles_no_more_than_the_bounded_shapes(target, compiled):
    """Prompts of many lengths, growing as turns do, chains of every depth: one graph for one
    token and one for several, whatever the lengths (the prompt's forward runs eagerly)."""
    _, draft = tiny_draft(seed=5)
    decoder = SpeculativeDecoder(target, draft, aux_layer_ids=AUX, num_steps=3, engine=compiled)
    history = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(7))
    for _turn in range(4):
        tokens, _ = decoder.generate(history, max_new_tokens=90)
        compiled.generate(history, max_new_tokens=20)
        prompt_lookup_generate(compiled, history, max_new_tokens=20, num_tokens=4)
        history = torch.cat([history, torch.tensor([tokens]), history[:, :7]], 1)
    assert history.shape[1] > SPAN_STEP  # the turns crossed a span
    assert compiled.stats.compilations <= 2
    assert len(compiled.stats.shapes) > compiled.stats.compilations
    # float32 on a CPU: every layer's linears ran their calls through the row plan
    linears = sum(isinstance(m, torch.nn.Linear) for m in compiled.layers.modules())
    assert linears > 0 and compiled.stats.row_buckets == (0 if row_buckets_missing() else linears)


def test_row_plans_go_to_the_engines_own_layers_never_the_models():
    """The compiled engine swaps and repacks linears in its own copy of the layers, which shares
    their weights: the model HF ``generate`` (the bench's reference) runs keeps its modules."""
    model = make_tiny_llama(VOCAB, num_layers=2, seed=3).float().requires_grad_(False)
    before = {name: type(module) for name, module in model.named_modules()}
    engine = TargetEngine(model, aux_layer_ids=AUX, compile=True, row_buckets=EVERY_KERNEL_PLAN)
    assert {name: type(module) for name, module in model.named_modules()} == before
    if row_buckets_missing():
        assert engine.layers is model.model.layers and engine.stats.row_buckets == 0
        return
    assert engine.layers is not model.model.layers
    ours, theirs = engine.layers[0].mlp.up_proj, model.model.layers[0].mlp.up_proj
    assert isinstance(ours, PackedLinear) and ours._plan is not None
    assert type(theirs) is torch.nn.Linear and ours.weight is theirs.weight


def test_without_the_cpu_kernels_every_path_keeps_pytorchs_own(monkeypatch, caplog):
    """The CPU kernels are optional: where their C++ cannot be built, the compiled engine keeps
    the model's layers (no row plan), decode attention in ``auto`` falls back to SDPA with a
    warning (``on`` refuses), and batched generation decodes as HF ``generate``."""
    why = "building it failed (RuntimeError: no C++ compiler)"
    monkeypatch.setattr(row_buckets, "row_buckets_missing", lambda: why)
    monkeypatch.setattr(decode_kernel, "load_decode_kernel", lambda: (None, why))
    model = make_tiny_llama(VOCAB, num_layers=2, seed=3).float().requires_grad_(False)
    engine = TargetEngine(model, aux_layer_ids=AUX, compile=True)
    assert engine.stats.row_buckets == 0 and engine.layers is model.model.layers
    query, key = torch.randn(1, 4, 1, 64), torch.randn(1, 4, 9, 64)
    attend = functools.partial(decode_kernel.kernel_decode_attention, query, key, key, None)
    with caplog.at_level(logging.WARNING):
        assert attend(None, mode="auto") is None
    assert "no C++ compiler" in caplog.text
    with pytest.raises(UserError, match="no C\\+\\+ compiler"):
        attend(None, mode="on")
    settings = GenerationSettings(max_new_tokens=6, eos_ids=[], pad_id=0, decode_kernel="auto")
    prompt = prompts(1)[0]
    [completion] = ContinuousBatcher(model, settings).run([Request(0, prompt[0].tolist())])
    assert completion.tokens == greedy_reference(model, prompt, 6)[prompt.shape[1] :]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_prompt_lookup_through_the_engine_decodes_as_hf_generate(target, compiled, compile):
    """Proposals from the sequence's own n-grams, verified by the engine: the target's greedy
    output, in fewer rounds than tokens where the output repeats itself."""
    engine = compiled if compile else TargetEngine(target, aux_layer_ids=AUX, compile=False)
    emitted = rounds = 0
    for prompt in prompts(5, seed=2):
        prompt = torch.cat([prompt, prompt], 1)  # a prompt that repeats (what lookup reads)
        reference = greedy_reference(target, prompt, 60)[prompt.shape[1] :]
        tokens, turn_rounds = prompt_lookup_generate(
            engine, prompt, max_new_tokens=60, num_tokens=4
        )
        assert tokens == reference
        emitted, rounds = emitted + len(tokens) - 1, rounds + turn_rounds
    assert rounds < emitted  # some proposals were accepted


def test_prompt_lookup_competing_with_the_draft_stays_lossless(target, compiled):
    """Greedy ``auto`` with ``lookup_tokens``: a round verifies prompt lookup's tokens where
    their measured acceptance promises more than the draft's; the output stays the target's,
    and those rounds stay out of the draft's acceptance per position."""
    _, draft = tiny_draft(seed=5)
    decoder = SpeculativeDecoder(
        target, draft, aux_layer_ids=AUX, num_steps="auto", lookup_tokens=4, engine=compiled
    )
    lookup_rounds = 0
    for prompt in prompts(5, seed=2):
        prompt = torch.cat([prompt, prompt], 1)
        reference = greedy_reference(target, prompt, 60)[prompt.shape[1] :]
        tokens, stats = decoder.generate(prompt, max_new_tokens=60)
        assert tokens == reference
        assert all(0 <= rate <= 1 for rate in stats.acceptance_per_position)
        lookup_rounds += len(stats.lookup_rounds)
    assert lookup_rounds > 0
    with pytest.raises(UserError, match="lookup_tokens needs num_steps auto"):
        SpeculativeDecoder(target, draft, aux_layer_ids=AUX, num_steps=3, lookup_tokens=4)


def test_prompt_lookup_stops_at_an_end_token_and_at_the_budget(target, compiled):
    prompt = prompts(3, seed=4)[2]
    reference = greedy_reference(target, prompt, 30)[prompt.shape[1] :]
    eos = reference[12]
    ends = reference[: reference.index(eos) + 1]
    tokens, _ = prompt_lookup_generate(
        compiled, prompt, max_new_tokens=30, num_tokens=6, eos_token_ids=[eos]
    )
    assert tokens == ends
    for budget in (1, 2, 7):
        tokens, rounds = prompt_lookup_generate(
            compiled, prompt, max_new_tokens=budget, num_tokens=6
        )
        assert tokens == reference[:budget] and rounds <= budget - 1


def test_ngram_candidates_follow_transformers_prompt_lookup():
    """The longest n-gram first, its earliest occurrence with a continuation, at most
    ``num_tokens``; nothing when only the last n-gram itself matches."""
    sequence = torch.tensor([1, 2, 3, 9, 2, 3, 4, 2, 3])
    assert ngram_candidates(sequence, num_tokens=2).tolist() == [9, 2]
    assert ngram_candidates(sequence, num_tokens=2, max_ngram=1).tolist() == [9, 2]
    assert ngram_candidates(torch.tensor([5, 6, 7, 8, 5, 6]), num_tokens=3).tolist() == [7, 8, 5]
    # no earlier (4, 3): the unigram 3's continuation
    assert ngram_candidates(torch.tensor([1, 2, 3, 4, 3]), num_tokens=5).tolist() == [4, 3]
    for sequence, count in (([1, 2, 3], 5), ([7], 3), ([1, 2, 1], 0)):
        assert ngram_candidates(torch.tensor(sequence), num_tokens=count).tolist() == []


def test_longest_match_takes_the_occurrence_whose_context_matches_furthest_back():
    """Greedy ``auto``'s proposals: the earlier occurrence of the last token with the longest
    matching context (the earliest on a tie), and that length; where transformers' prompt
    lookup takes the earliest occurrence of the last two tokens."""
    sequence = torch.tensor([5, 2, 3, 9, 1, 2, 3, 4, 1, 2, 3])
    assert ngram_candidates(sequence, num_tokens=2).tolist() == [9, 1]
    proposal, matched = longest_match(sequence, num_tokens=2)
    assert (proposal.tolist(), matched) == ([4, 1], 3)  # "1 2 3" again
    proposal, matched = longest_match(sequence, num_tokens=2, max_match=2)
    assert (proposal.tolist(), matched) == ([9, 1], 2)  # a tie at 2: the earliest
    proposal, matched = longest_match(torch.tensor([3, 3, 3, 3]), num_tokens=5)
    assert (proposal.tolist(), matched) == ([3], 3)
    for sequence, count in (([1, 2, 3], 5), ([7], 3), ([1, 2, 1], 0)):
        proposal, matched = longest_match(torch.tensor(sequence), num_tokens=count)
        assert (proposal.tolist(), matched) == ([], 0)


def test_the_cache_is_written_by_slot_and_gathers_a_path():
    cache = SlotKVCache(num_layers=1, capacity=8)
    keys = torch.arange(5.0).reshape(1, 1, 5, 1)
    with pytest.raises(RuntimeError, match="before write_at"):
        cache.update(keys, keys, 0)
    cache.write_at(torch.arange(5), 8)
    written, _ = cache.update(keys, keys + 10, 0)
    assert written.shape[2] == 8  # the span the forward reads
    cache.length = 5
    gather_cache(cache, 2, [0, 2])  # keep slots 0, 1, then 2 and 4 (then crop)
    assert cache.length == 4
    assert cache.layers[0].keys[0, 0, :4, 0].tolist() == [0, 1, 2, 4]
    assert cache.layers[0].values[0, 0, :4, 0].tolist() == [10, 11, 12, 14]
    cache.crop(-1)
    assert cache.get_seq_length() == 3
    assert key_span(1, 512) == SPAN_STEP and key_span(257, 300) == 300


def test_a_forward_past_the_capacity_is_an_error(target):
    engine = TargetEngine(target, aux_layer_ids=AUX, compile=False)
    cache = engine.new_cache(10)
    with pytest.raises(ValueError, match="capacity of 256"):
        engine.forward(torch.zeros(1, 257, dtype=torch.long), cache)


def test_sequences_take_the_engine_buffers_in_turn(target):
    """Every sequence writes to the same buffers (what a CUDA graph replays over), a longer one
    to larger ones, and a cache whose buffers a newer one took refuses to run, rather than
    reading another sequence's keys."""
    engine = TargetEngine(target, aux_layer_ids=AUX, compile=False)
    short, longer = prompts(2)
    first = engine.new_cache(20)
    engine.forward(short, first)
    address = first.layers[0].keys.data_ptr()
    second = engine.new_cache(20)
    logits, _ = engine.forward(short, second)
    assert second.layers[0].keys.data_ptr() == address
    with pytest.raises(RuntimeError, match="taken by a newer cache"):
        engine.forward(short[:, :1], first)
    with pytest.raises(RuntimeError, match="taken by a newer cache"):
        gather_cache(first, 1, [0])
    # the reused buffers start from zeros: the same logits as a fresh engine's
    fresh = TargetEngine(target, aux_layer_ids=AUX, compile=False)
    assert torch.equal(logits, fresh.forward(short, fresh.new_cache(20))[0])
    third = engine.new_cache(SPAN_STEP + 1)  # more slots than the buffers hold
    engine.forward(longer, third)
    assert third.layers[0].keys.shape[2] == 2 * SPAN_STEP + 1
    assert engine.generate(longer, max_new_tokens=5) == fresh.generate(longer, max_new_tokens=5)


def test_a_target_that_is_not_the_plain_loop_is_refused(target):
    """A decoder that scales its embeddings inside its own forward (as Gemma's do) is not what
    the engine's loop runs: refused, not served with other outputs."""
    import copy

    scaled = copy.deepcopy(target)
    decoder = scaled.model
    plain_forward = decoder.forward

    def forward(*args, inputs_embeds=None, input_ids=None, **kwargs):
        embeds = decoder.embed_tokens(input_ids) * 2.0
        return plain_forward(*args, inputs_embeds=embeds, **kwargs)

    decoder.forward = forward
    with pytest.raises(UserError, match="not the plain layer loop"):
        TargetEngine(scaled, aux_layer_ids=AUX, compile=False)


def test_a_target_whose_attention_reads_masks_otherwise_is_refused():
    """Eager attention adds its mask: the engine's boolean mask would mean something else."""
    eager = make_tiny_llama(VOCAB, num_layers=4, seed=3)
    eager.set_attn_implementation("eager")
    with pytest.raises(UserError, match="attention is 'eager'"):
        TargetEngine(eager, aux_layer_ids=AUX, compile=False)
    engine, path = build_engine(eager, aux_layer_ids=AUX, compile="false", tokens=100)
    assert engine is None and path.path == "transformers" and "'eager'" in path.why
