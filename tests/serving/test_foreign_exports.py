"""Drafts exported by SpecForge 0.2.0 and saved by speculators 0.9.0 load as they are
(``tests/fixtures/``, made by those tools' own draft classes and exporters: ``make.py`` in
each): SpecForge's ``--to hf`` layout (the draft's embedding inside, no
``target_hidden_size``) and ``--to sglang`` layout (bfloat16, no embedding), and speculators'
layout (``speculators_config``, the layer under ``transformer_layer_config``, ``layers.0.``
weights) pass the export checks, are recognised as EAGLE-3, and give the tool's own logits;
training's warm start reads them too."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from specforge.families.dispatch import export_checks, family_of_export
from specforge.models.eagle3 import DraftKVCache
from specforge.serving.export import load_exported_draft
from tests.helpers import make_tiny_llama

FIXTURES = Path(__file__).parents[1] / "fixtures" / "specforge_0_2_0"
REFERENCE = load_file(FIXTURES / "reference.safetensors")
SPECULATORS = Path(__file__).parents[1] / "fixtures" / "speculators_0_9_0"
TARGET = make_tiny_llama(96).config
"""A target of the fixture's geometry (its embedding: the reference's)."""


def _logits(draft, reference=REFERENCE) -> torch.Tensor:
    positions = torch.arange(reference["tokens"].shape[1])[None]
    with torch.no_grad():
        fused = draft.fuse(reference["fused"].to(draft.fc.weight.dtype))
        logits, _ = draft(reference["tokens"], fused, positions, cache=DraftKVCache())
    return logits.float()


@pytest.mark.parametrize(("layout", "tolerance"), [("hf", 1e-5), ("sglang", 0.02)])
def test_a_specforge_export_loads_as_it_is_and_gives_specforges_logits(layout, tolerance):
    folder = FIXTURES / layout
    assert family_of_export(folder).name == "eagle3"
    assert all(c["problem"] is None for c in export_checks(folder, TARGET))
    draft = load_exported_draft(
        folder, target_config=TARGET, target_embedding=REFERENCE["embedding"]
    )
    reference = REFERENCE["logits"]
    difference = (_logits(draft) - reference).abs().max() / reference.abs().max()
    assert difference < tolerance  # hf: float32 as SpecForge ran it; sglang: its bf16 copy
    assert torch.equal(draft.d2t, load_file(folder / "model.safetensors")["d2t"])


def test_a_specforge_export_is_a_warm_start():
    """What ``train.from_pretrained`` loads (EAGLE-3's ``load_trainable``), trainable."""
    from specforge.families import family

    head = SimpleNamespace(config=TARGET, embed_tokens=REFERENCE["embedding"])
    draft, config = family("eagle3").load_trainable(FIXTURES / "hf", head)
    assert config.target_hidden_size == 64 and draft.training
    assert draft.fc.weight.requires_grad and not draft.embed_tokens.weight.requires_grad
    assert (_logits(draft) - REFERENCE["logits"]).abs().max() < 1e-4


def test_a_speculators_draft_loads_as_it_is_and_gives_its_own_logits():
    folder, reference = SPECULATORS / "draft", load_file(SPECULATORS / "reference.safetensors")
    assert family_of_export(folder).name == "eagle3"
    assert all(c["problem"] is None for c in export_checks(folder, TARGET))
    draft = load_exported_draft(
        folder, target_config=TARGET, target_embedding=reference["embedding"]
    )
    difference = (_logits(draft, reference) - reference["logits"]).abs().max()
    assert difference / reference["logits"].abs().max() < 1e-5
    saved = load_file(folder / "model.safetensors")
    assert torch.equal(draft.d2t, saved["d2t"])
    assert torch.equal(
        draft.midlayer.self_attn.q_proj.weight, saved["layers.0.self_attn.q_proj.weight"]
    )
