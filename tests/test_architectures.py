"""Every architecture in the matrix (:mod:`tests.architectures`) either runs the whole pipeline
correctly or is refused before work starts with a message naming what it lacks: prepare with
self-distillation -> 2 online training steps -> capture -> 2 offline steps -> export contract
-> chain and tree greedy decoding equal to the target's own ``generate`` (fp32), with a stub
draft that gets tokens accepted so the caches are cropped and gathered -> the user's
``specforge bench`` through the CLI with its defaults (few tokens), every output identical ->
where the engine claims to run the target, chain decoding through the compiled engine (one
row of each shape the loop compiles differently, :data:`COMPILED`). The first few run in every
CI run; the long tail is marked ``slow``."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from specforge.cli import main
from specforge.config import load_config
from specforge.data.vocab import load_vocab_map
from specforge.engine.target import TargetEngine
from specforge.errors import UserError
from specforge.models.adapter import (
    draft_rope_parameters,
    text_config,
)
from specforge.models.target import load_target
from specforge.recipes.capture import capture
from specforge.recipes.export import export
from specforge.recipes.prepare import prepare
from specforge.recipes.train import train
from specforge.serving.export import load_exported_draft
from specforge.serving.speculative import SpeculativeDecoder
from tests.architectures import ARCHITECTURES, WINDOW, save_tiny_target
from tests.helpers import StubDraft, greedy_reference, make_tiny_tokenizer

FAST = {"llama", "gemma3_text", "granite", "gpt_oss", "gemma3", "qwen3_next", "llama4_text"}
"""Run in every CI run: a plain Llama, sliding windows with soft-capping and nested RoPE,
logit scaling, eager attention with sinks, a multimodal layout, a refused recurrent hybrid,
chunked attention."""

COMPILED = {"llama", "qwen3", "mixtral", "olmo2", "deepseek_v3", "granite", "phi", "gemma"}
"""The rows whose chain decoding also runs through the compiled engine: one of each shape the
layer loop compiles differently (plain, per-head q/k norms, experts, post-norms, multi-head
latent attention, logit scaling, a LayerNorm with bias and partial RoPE, scaled embeddings);
every other row runs the same loop eagerly through ``specforge bench``."""
REFUSED_SERVING = {"qwen3_next": "linear_attention", "lfm2": "conv", "jamba": "linear_attention"}
"""Architectures the runtime refuses (recurrent state cannot be cropped), and the word the
refusal names; everything before serving works for them."""

CONVERSATIONS = [
    [
        {"role": "user", "content": f"question {i}: the sliding window covers how many tokens?"},
        {"role": "assistant", "content": "an old answer that self-distillation replaces"},
    ]
    for i in range(6)
]


def matrix(name):
    marks = [] if name in FAST else [pytest.mark.slow]
    return pytest.param(name, marks=marks, id=name)


def config_for(folder, tmp_path, *extra):
    data = tmp_path / "data.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    return load_config(
        None,
        [
            f"target.name_or_path={folder}",
            "target.dtype=float32",
            f"data.inputs={json.dumps([str(data)])}",
            f"output_dir={tmp_path / 'run'}",
            f"prepare.output={tmp_path / 'prepared.jsonl'}",
            "regenerate.enabled=true",
            "regenerate.max_new_tokens=24",
            "regenerate.batch_size=3",
            "vocab.draft_vocab_size=64",
            "train.dtype=float32",
            "train.eval_fraction=0.2",
            "train.ttt_length=2",
            "train.log_every=1",
            "train.eval_every=1000",
            "train.warmup_steps=1",
            "train.init_from_target=true",
            "capture.dtype=float32",
            f"capture.output={tmp_path / 'capture'}",
            "export.dtype=float32",
            *extra,
        ],
    )


def check_greedy_equality(model, draft_vocab: int, name: str) -> None:
    """Chain and tree decoding with a stub draft equal the target's greedy ``generate`` over
    prompts and outputs longer than the window."""
    for seed in range(2):
        torch.manual_seed(seed)
        prompt = torch.randint(3, draft_vocab, (1, WINDOW + 4 + seed))
        reference = greedy_reference(model, prompt, 2 * WINDOW)
        for topk, steps, size in ((1, 3, None), (2, 3, 6)):
            stub = StubDraft(reference, lambda t: t % 4 == 0, draft_vocab)
            decoder = SpeculativeDecoder(
                model,
                stub,
                aux_layer_ids=[1, 1, 0],
                num_steps=steps,
                topk=topk,
                num_draft_tokens=size,
            )
            tokens, stats = decoder.generate(prompt, max_new_tokens=2 * WINDOW)
            assert tokens == reference[prompt.shape[1] :], f"{name} topk={topk} diverged"
            assert max(stats.accepted_per_round) >= 2  # crop / gather ran on accepted tokens


@pytest.mark.parametrize("name", [matrix(n) for n in ARCHITECTURES])
def test_architecture_runs_the_pipeline_or_is_refused(name, tmp_path, capsys):
    folder = save_tiny_target(name, make_tiny_tokenizer(), tmp_path / "target")
    prepared = tmp_path / "prepared.jsonl"
    # prepare: the target answers every user turn itself, and writes the draft vocabulary
    vocab_output = tmp_path / "vocab.safetensors"
    prepare(config_for(folder, tmp_path, f"prepare.vocab_output={vocab_output}"))
    rows = [json.loads(line) for line in prepared.read_text().splitlines()]
    assert len(rows) == len(CONVERSATIONS)
    vocab_map = load_vocab_map(vocab_output)
    assert vocab_map.t2d.numel() == text_config(AutoConfig.from_pretrained(folder)).vocab_size
    assert all(r["messages"][-1]["content"] != CONVERSATIONS[0][1]["content"] for r in rows)
    # 2 online steps, capture, 2 offline steps
    online = config_for(folder, tmp_path, f"train.data_path={prepared}", "train.max_steps=2")
    assert train(online).checkpoint is not None
    capture(online)
    offline = config_for(
        folder,
        tmp_path,
        f"train.data_path={prepared}",
        "train.max_steps=2",
        "data.mode=offline",
        f"output_dir={tmp_path / 'offline'}",
    )
    assert train(offline).checkpoint is not None
    # export contract: SiLU, the target's full-attention RoPE, loadable against the target
    out = export(config_for(folder, tmp_path, f"export.output={tmp_path / 'export'}"))
    model, _ = load_target(online.target)
    exported = json.loads((out / "config.json").read_text())
    assert exported["hidden_act"] == "silu"
    assert exported["rope_parameters"] == draft_rope_parameters(model.config)
    load_exported_draft(
        out, target_config=model.config, target_embedding=model.get_input_embeddings().weight
    )
    # serving: lossless chain and tree, or a refusal before generation
    vocab = text_config(model.config).vocab_size
    if name in REFUSED_SERVING:
        with pytest.raises(UserError, match=REFUSED_SERVING[name]):
            SpeculativeDecoder(
                model, StubDraft([], lambda t: False, vocab), aux_layer_ids=[1, 1, 0]
            )
        # the user's command refuses in one line
        assert main(["bench", f"target.name_or_path={folder}", f"bench.draft={out}"]) == 2
        assert REFUSED_SERVING[name] in capsys.readouterr().err.splitlines()[-1]
        return
    check_greedy_equality(model, vocab, name)
    path = check_user_bench(folder, out, tmp_path / "bench")
    if path != "transformers" and name in COMPILED:
        check_compiled_engine(model, vocab, name)


def check_user_bench(folder, export_dir, output) -> str:
    """``specforge bench`` as a user runs it, defaults but for its length: every output the
    target's; returns the engine path it recorded."""
    code = main(
        [
            "bench",
            f"target.name_or_path={folder}",
            f"bench.draft={export_dir}",
            f"bench.output={output}",
            "bench.limit=1",
            "bench.max_new_tokens=8",
        ]
    )
    assert code == 0
    result = json.loads((output / "bench.json").read_text())
    assert result["all_match"] is True and result["engine_all_match"] in (True, None)
    assert result["engine"]["path"] in ("eager engine", "transformers") and result["engine"]["why"]
    return result["engine"]["path"]


def check_compiled_engine(model, vocab: int, name: str) -> None:
    """Chain decoding through the compiled engine (no row buckets: they are a CPU kernel's
    detail) equals the target's greedy ``generate``: a verification graph and a decoding graph."""
    # dynamo counts the graphs of one code object (the engine's layer loop) across the test
    # process's engines; a user's process builds one
    torch._dynamo.reset()
    engine = TargetEngine(model, aux_layer_ids=[1, 1, 0], compile=True, row_buckets=False)
    torch.manual_seed(0)
    prompt = torch.randint(3, vocab, (1, WINDOW + 4))
    reference = greedy_reference(model, prompt, WINDOW)
    stub = StubDraft(reference, lambda t: t % 4 == 0, vocab)
    decoder = SpeculativeDecoder(model, stub, aux_layer_ids=[1, 1, 0], num_steps=3, engine=engine)
    tokens, _ = decoder.generate(prompt, max_new_tokens=WINDOW)
    assert tokens == reference[prompt.shape[1] :], f"{name} diverged through the compiled engine"
    assert engine.stats.compilations >= 1


def test_synthesis_on_a_recurrent_target_is_refused_before_generating(tmp_path):
    folder = save_tiny_target("lfm2", make_tiny_tokenizer(), tmp_path / "target")
    with pytest.raises(UserError, match="synthesize: lfm2.*conv layers"):
        prepare(config_for(folder, tmp_path, "synthesize.count=4"))
    assert not (tmp_path / "prepared.jsonl").exists()
