"""Which path runs the target's forwards (:func:`specforge.engine.target.build_engine`):
``auto`` falls back where the engine refuses a target, runs the engine eagerly where a compiled
forward would read a tensor on the host (dynamic RoPE) or where compiling does not pay, and
``true`` refuses instead; multi-head latent attention (keys and values of different sizes)
decodes through the engine's cache."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specforge.engine.cache import SlotKVCache
from specforge.engine.draft import DraftEngine
from specforge.engine.host_sync import host_sync
from specforge.engine.target import TargetEngine, build_engine
from specforge.errors import UserError
from specforge.models.eagle3 import Eagle3Config, build_draft_model
from specforge.serving.speculative import SpeculativeDecoder
from tests.architectures import tiny_config
from tests.engine.fake_graphs import FakeCudaGraphs, use_fake_graphs
from tests.helpers import StubDraft, greedy_reference, make_tiny_llama, tiny_draft

VOCAB = 96
AUX = [1, 1, 0]


def tiny_target(model_type_or_config) -> torch.nn.Module:
    """A random fp32 target with peaked next-token distributions, in eval mode, frozen."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_type_or_config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.15)
    return model.requires_grad_(False)


def dynamic_rope_llama() -> torch.nn.Module:
    """A Llama whose RoPE rescales past 32 positions (``rope_type: dynamic``): transformers'
    rotary module compares the positions with its cached length in Python."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    config._attn_implementation = "sdpa"
    return tiny_target(config)


def test_auto_falls_back_to_transformers_where_the_engine_refuses_and_true_refuses(caplog):
    window = tiny_target(tiny_config("mistral_window", VOCAB, eos_token_id=2))
    with caplog.at_level(logging.WARNING, logger="specforge.engine.target"):
        engine, path = build_engine(window, aux_layer_ids=AUX, compile="auto", tokens=10**6)
    assert engine is None and path.path == "transformers"
    # the refusal names what is windowed, and is said once
    assert "sliding_window 16" in path.why
    assert [r.getMessage() for r in caplog.records] == [
        f"the target decodes through transformers: {path.why}"
    ]
    with pytest.raises(UserError, match="sliding_window 16"):
        build_engine(window, aux_layer_ids=AUX, compile="true", tokens=10**6)


def test_dynamic_rope_is_found_before_compiling_and_decodes_eagerly():
    target = dynamic_rope_llama()
    engine = TargetEngine(target, aux_layer_ids=AUX, compile=False)
    sync = engine.host_sync()
    assert sync is not None and sync.module == "model.rotary_emb (LlamaRotaryEmbedding)"
    with pytest.raises(UserError, match="rotary_emb .* reads a tensor on the host"):
        build_engine(target, aux_layer_ids=AUX, compile="true", tokens=10**6)
    # auto: the eager engine, which decodes past the rescaling point as the model does
    engine, path = build_engine(target, aux_layer_ids=AUX, compile="auto", tokens=10**9)
    assert path.path == "eager engine" and "rotary_emb" in path.why
    assert not engine.stats.compiled
    prompt = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    reference = greedy_reference(target, prompt, 30)[20:]
    assert engine.generate(prompt, max_new_tokens=30) == reference


def test_a_draft_that_reads_the_host_runs_eagerly_beside_the_targets_graphs(monkeypatch, caplog):
    """A draft whose RoPE rescales (dynamic) cannot be captured: the runtime finds it before any
    capture, names the layer, and runs the draft's forwards eagerly while the target's forwards
    replay graphs (the suite's CPU model of them: a capture that syncs would raise)."""
    use_fake_graphs(monkeypatch)
    target, plain = tiny_draft(seed=5)
    config = Eagle3Config.from_target(target.config, draft_vocab_size=32)
    config.max_position_embeddings = 24
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    draft = build_draft_model(
        config,
        target_embedding=target.get_input_embeddings().weight,
        target_lm_head=target.get_output_embeddings().weight,
        d2t=plain.d2t,
        t2d=plain.t2d,
        seed=5,
    )
    assert DraftEngine(plain, graphs=True).host_sync() is None
    sync = DraftEngine(draft, graphs=True).host_sync()
    assert sync is not None and sync.module == "rotary_emb (LlamaRotaryEmbedding)"
    engine = TargetEngine(target, aux_layer_ids=AUX, compile=True)
    with caplog.at_level(logging.WARNING):
        decoder = SpeculativeDecoder(target, draft, aux_layer_ids=AUX, num_steps=3, engine=engine)
    assert engine.graphs and decoder.draft_engine is None
    assert "the draft's forwards run eagerly" in caplog.text and "rotary_emb" in caplog.text
    prompt = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    tokens, _ = decoder.generate(prompt, max_new_tokens=12)  # past the rescaling point
    assert tokens == greedy_reference(target, prompt, 12)[20:]


def test_a_plain_loop_makes_no_host_sync_and_the_detector_sees_item():
    target = make_tiny_llama(VOCAB, num_layers=2, seed=3)
    assert TargetEngine(target, aux_layer_ids=AUX, compile=False).host_sync() is None
    found = host_sync(target, lambda: target.model.embed_tokens.weight.sum().item())
    assert found is not None and found.op == "aten::_local_scalar_dense" and found.module == "?"


def test_auto_compiles_only_where_the_run_repays_it(monkeypatch):
    target = make_tiny_llama(VOCAB, num_layers=2, seed=3).requires_grad_(False)
    short, path = build_engine(target, aux_layer_ids=AUX, compile="auto", tokens=64)
    assert path.path == "eager engine" and not short.stats.compiled
    assert "~64 tokens" in path.why and "would save" in path.why
    long, path = build_engine(target, aux_layer_ids=AUX, compile="auto", tokens=10**9)
    assert path.path == "compiled" and long.stats.compiled
    forced, path = build_engine(target, aux_layer_ids=AUX, compile="true", tokens=1)
    assert path.path == "compiled" and forced.stats.compiled
    plain, path = build_engine(target, aux_layer_ids=AUX, compile="false", tokens=10**9)
    assert path.path == "eager engine" and not plain.stats.compiled
    monkeypatch.setenv("PATH", "")  # no C++ compiler to be found: inductor's CPU code needs one
    _, path = build_engine(target, aux_layer_ids=AUX, compile="auto", tokens=10**9)
    assert path.path == "eager engine" and "C++ compiler" in path.why


def test_latent_attention_keys_and_values_of_different_sizes_decode_through_the_engine():
    target = tiny_target(tiny_config("deepseek_v3", VOCAB, eos_token_id=2))
    engine = TargetEngine(target, aux_layer_ids=AUX, compile=False)
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    reference = greedy_reference(target, prompt, 24)
    assert engine.generate(prompt, max_new_tokens=24) == reference[9:]
    layer = engine._pool.buffers[0]
    assert layer[0].shape[-1] != layer[1].shape[-1]  # keys and values: their own head sizes
    # the runtime verifies through the same cache (chain with accepted tokens)
    stub = StubDraft(reference, lambda t: t % 3 == 0, VOCAB)
    decoder = SpeculativeDecoder(target, stub, aux_layer_ids=AUX, num_steps=3, engine=engine)
    tokens, stats = decoder.generate(prompt, max_new_tokens=24)
    assert tokens == reference[9:] and max(stats.accepted_per_round) >= 2


def test_the_engine_compiling_a_target_it_cannot_compile_refuses_where_it_compiles():
    """The host-sync guard lives in ``compile``: ``TargetEngine(..., compile=True)`` on a
    dynamic-RoPE target refuses naming the layer instead of failing in dynamo later."""
    with pytest.raises(UserError, match="rotary_emb .* reads a tensor on the host"):
        TargetEngine(dynamic_rope_llama(), aux_layer_ids=AUX, compile=True)


def test_an_error_in_the_engine_is_a_bug_not_a_refusal(monkeypatch):
    """Only what the model's own code raises is a refusal (the target decodes through
    transformers); an error the engine raises propagates, so an engine regression cannot
    hide as a slower path."""

    def broken(self, slots, span):
        raise RuntimeError("injected engine bug")

    target = make_tiny_llama(VOCAB, num_layers=2, seed=0).float()
    monkeypatch.setattr(SlotKVCache, "write_at", broken)
    with pytest.raises(RuntimeError, match="injected engine bug"):
        build_engine(target, aux_layer_ids=AUX, compile="auto", tokens=10)


def test_a_failed_capture_under_auto_falls_back_to_the_eager_engine(monkeypatch, caplog):
    """On a GPU ``auto`` captures graphs; a capture that fails (here the suite's CPU model of
    CUDA graphs, told to fail) leaves the run on the eager engine with one warning naming the
    reason, outputs unchanged; with ``true`` it raises."""
    use_fake_graphs(monkeypatch)

    def failing(self, inputs, cache):
        raise RuntimeError("CUDA error: capture failed (injected)")

    monkeypatch.setattr(FakeCudaGraphs, "_capture", failing)
    target = make_tiny_llama(VOCAB, num_layers=2, seed=0).float()
    prompt = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(1))
    reference = greedy_reference(target, prompt, 12)[20:]
    with caplog.at_level(logging.WARNING, logger="specforge.engine.target"):
        engine, path = build_engine(target, aux_layer_ids=AUX, compile="auto", tokens=10)
        assert path.path == "compiled"
        assert engine.generate(prompt, max_new_tokens=12) == reference
        assert engine.generate(prompt, max_new_tokens=12) == reference
    warned = [r.getMessage() for r in caplog.records if "compiled engine failed" in r.getMessage()]
    assert len(warned) == 1 and "capture failed (injected)" in warned[0]
    assert engine.stats.as_dict()["fallback"].endswith("capture failed (injected)")
    assert not engine.stats.compiled
    engine, _ = build_engine(target, aux_layer_ids=AUX, compile="true", tokens=10)
    with pytest.raises(RuntimeError, match="capture failed"):
        engine.generate(prompt, max_new_tokens=12)
