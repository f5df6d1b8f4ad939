"""Fine-tuning a draft on disk (``train.from_pretrained``, speculators' ``--from-pretrained``,
SpecForge's ``--ckpt-dir``): training starts from the exported draft itself (its held-out loss
at step 0 is the one it was exported with), keeps its vocabulary map unless told to rebuild it,
and a draft that does not fit the target or the run is refused before any step."""

import json

import pytest
import torch
from safetensors.torch import load_file

from specforge.errors import UserError
from specforge.recipes.export import export
from specforge.recipes.train import train
from tests.helpers import tiny_train_config, write_peaked_target

EXPORT = ("export.dtype=float32", "train.eval_every=100")


@pytest.fixture
def exported(tmp_path, peaked_target_dir):
    """A tiny draft trained 4 steps and exported in float32; returns (target, data, export)."""
    folder, data = peaked_target_dir
    cfg = tiny_train_config(folder, data, tmp_path / "first", "train.max_steps=4", *EXPORT)
    train(cfg)
    return folder, data, export(cfg)


def _eval_losses(out) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "eval"}


def test_fine_tuning_starts_from_the_exported_draft_and_keeps_its_map(tmp_path, exported):
    folder, data, out = exported
    run = tmp_path / "tuned"
    cfg = tiny_train_config(
        folder, data, run, f"train.from_pretrained={out}", "train.max_steps=2", *EXPORT
    )
    result = train(cfg)
    first = _eval_losses(tmp_path / "first")
    tuned = _eval_losses(run)
    assert tuned[0] == pytest.approx(first[4], rel=1e-5)  # the draft it was exported as
    assert tuned[2] != tuned[0]  # and it trains on
    exported_tensors = load_file(out / "model.safetensors")
    saved = load_file(result.checkpoint / "draft.safetensors")
    assert torch.equal(saved["d2t"], exported_tensors["d2t"])


def test_a_new_vocabulary_map_keeps_the_rows_of_the_ids_both_maps_hold(tmp_path, exported):
    folder, data, out = exported
    run = tmp_path / "rebuilt"
    cfg = tiny_train_config(
        folder,
        data,
        run,
        f"train.from_pretrained={out}",
        "train.rebuild_vocab=true",
        "vocab.draft_vocab_size=48",
        "train.max_steps=1",
        "train.lr=1e-12",
        *EXPORT,
    )
    saved = load_file(train(cfg).checkpoint / "draft.safetensors")
    old = load_file(out / "model.safetensors")
    assert saved["d2t"].numel() == 48
    old_ids = (torch.arange(old["d2t"].numel()) + old["d2t"]).tolist()
    new_ids = (torch.arange(48) + saved["d2t"]).tolist()
    shared = sorted(set(old_ids) & set(new_ids))
    assert shared
    for token in shared:
        assert torch.allclose(
            saved["lm_head.weight"][new_ids.index(token)],
            old["lm_head.weight"][old_ids.index(token)],
            atol=1e-6,
        )


def test_a_draft_that_does_not_fit_is_refused_naming_what_differs(tmp_path, exported):
    folder, data, out = exported
    other, _ = write_peaked_target(tmp_path / "wider", hidden=96)
    cases = [
        (other, [], "hidden"),
        (folder, ["target.aux_layer_ids=[0, 1, 2]"], "set target.aux_layer_ids="),
        (folder, ["draft.type=peagle"], "is a eagle3 draft, draft.type is peagle"),
        (folder, ["vocab.draft_vocab_size=40"], "keeps its map of 64 ids"),
    ]
    for index, (target, extra, message) in enumerate(cases):
        cfg = tiny_train_config(
            target, data, tmp_path / f"run{index}", f"train.from_pretrained={out}", *extra
        )
        with pytest.raises(UserError, match=message):
            train(cfg)
        assert not (tmp_path / f"run{index}" / "checkpoints").exists()
    with pytest.raises(UserError, match="is not an export directory"):
        train(tiny_train_config(folder, data, tmp_path / "x", f"train.from_pretrained={data}"))
