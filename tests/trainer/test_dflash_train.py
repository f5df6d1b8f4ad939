"""``specforge train`` with ``draft.type: dflash``: the block draft trains online on the
target's greedy tokens (its held-out ``tau_pred`` rising), resumes exactly, is exported in the
engines' DFlash layout and served losslessly by ``specforge bench``; offline mode is refused."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from specforge.cli import main
from specforge.errors import UserError
from specforge.recipes.train import train
from tests.helpers import bench_tiny_export, tiny_train_config

DFLASH = [
    "draft.type=dflash",
    "draft.dflash.block_size=4",
    "draft.dflash.anchors=8",
    "train.eval_every=100",
]


def test_a_dflash_draft_trains_exports_and_serves(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    out = tmp_path / "run"
    result = train(tiny_train_config(folder, data, out, *DFLASH, "train.max_steps=30"))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if m["split"] == "eval"]
    assert evals[-1]["tau_pred"] > evals[0]["tau_pred"] and "acc_2" in evals[-1]
    state = json.loads((result.checkpoint / "trainer_state.json").read_text())
    assert state["draft_type"] == "dflash"
    saved = load_file(result.checkpoint / "draft.safetensors")
    assert "lm_head.weight" not in saved and "embed_tokens.weight" not in saved  # the target's
    export = tmp_path / "export"
    assert main(["export", str(result.checkpoint), str(export), "--dtype", "float32"]) == 0
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == state["aux_layer_ids"]
    report = bench_tiny_export(tmp_path, folder, export, "--num-steps", "3")
    assert report["all_match"] is True and report["settings"]["draft_family"] == "dflash"


def test_dflash_training_resumes_exactly(tmp_path, peaked_target_dir, caplog):
    folder, data = peaked_target_dir
    steps = [*DFLASH, "train.max_steps=6", "train.save_every=3"]
    # more target layers than the tiny target has: read what it has, and say so
    with caplog.at_level(logging.WARNING, logger="specforge.families.dflash"):
        full = train(
            tiny_train_config(
                folder, data, tmp_path / "full", *steps, "draft.dflash.target_layers=100"
            )
        )
    assert (
        "draft.dflash.target_layers 100: the target has 4 layers, so the draft reads 1"
        in caplog.text
    )
    steps.append("draft.dflash.target_layers=100")
    interrupted = tmp_path / "interrupted"
    train(tiny_train_config(folder, data, interrupted, *steps), stop_after_step=3)
    resumed = train(tiny_train_config(folder, data, interrupted, *steps, "train.resume=true"))
    a = load_file(full.checkpoint / "draft.safetensors")
    b = load_file(resumed.checkpoint / "draft.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)


def test_dflash_offline_training_is_refused_before_any_work(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    cfg = tiny_train_config(folder, data, tmp_path / "run", *DFLASH, "data.mode=offline")
    with pytest.raises(UserError, match="draft.type dflash trains online"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_soft_block_labels_train_through_the_target_s_whole_vocabulary(tmp_path, peaked_target_dir):
    folder, data = peaked_target_dir
    out = tmp_path / "run"
    soft = [*DFLASH, "draft.dflash.block_labels=soft", "train.max_steps=30"]
    train(tiny_train_config(folder, data, out, *soft))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if m["split"] == "eval"]
    assert evals[-1]["tau_pred"] > evals[0]["tau_pred"]
