"""The family registry: every option another family reads is refused for the chosen one when a
stage starts (before the target or the data is read), naming the key; exports and checkpoints
find their family again."""

import pytest

from specforge.config import ConfigError
from specforge.errors import UserError
from specforge.families import REGISTRY, family
from specforge.families.dispatch import check_options, family_of_export
from specforge.recipes.train import train
from tests.helpers import tiny_train_config

IGNORED = [
    ("dflash", "train.ttt_length=4"),
    ("dflash", "train.step_weight=0.5"),
    ("dflash", "train.init_from_target=true"),
    ("dflash", "train.freeze_lm_head=true"),
    ("dflash", "vocab.draft_vocab_size=128"),
    ("dflash", "train.loss=lk"),
    ("dflash", "train.target_temperature=0"),
    ("dflash", "draft.variant=eagle3.1"),
    ("dflash", "train.on_policy.steps=2"),
    ("dflash", "train.from_pretrained=outputs/export"),
    ("eagle3", "draft.dflash.block_size=4"),
    ("eagle3", "draft.dflash.block_labels=soft"),
    ("eagle3", "draft.dflash.anchors=8"),
    ("eagle3", "draft.mask_token_id=3"),
    ("eagle3", "draft.dflash.draft_layers=2"),
    ("eagle3", "draft.dflash.target_layers=3"),
    ("eagle3", "draft.dflash.block_decay=2.0"),
    ("peagle", "draft.dflash.block_size=4"),
    ("peagle", "draft.dflash.anchors=8"),
]
"""Each family-only option listed as silently ignored before the registry, set for a family
that does not read it."""


@pytest.mark.parametrize(("chosen", "setting"), IGNORED)
def test_an_option_of_another_family_is_refused_before_anything_loads(tmp_path, chosen, setting):
    key = setting.split("=")[0]
    cfg = tiny_train_config(
        tmp_path / "no-target",
        tmp_path / "no-data.jsonl",
        tmp_path / "o",
        f"draft.type={chosen}",
        setting,
    )
    with pytest.raises(ConfigError, match=f"{key}=.* does nothing for draft.type {chosen}"):
        train(cfg)  # neither the target nor the data exists: the refusal comes first
    assert not (tmp_path / "o").exists()


def test_every_family_accepts_its_own_options():
    for name in REGISTRY:
        own = tiny_train_config("t", "d.jsonl", "o", f"draft.type={name}")
        check_options(own)  # the tiny recipe's settings are each family's own


def test_an_unknown_family_and_an_offline_block_draft_are_refused():
    with pytest.raises(UserError, match="'eagle9' is not a draft family"):
        check_options(tiny_train_config("t", "d.jsonl", "o", "draft.type=eagle9"))
    block = tiny_train_config("t", "d.jsonl", "o", "draft.type=dflash", "data.mode=offline")
    with pytest.raises(ConfigError, match="draft.type dflash trains online"):
        check_options(block)


def test_an_export_of_no_family_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["MedusaModel"]}')
    with pytest.raises(UserError, match="MedusaModel"):
        family_of_export(tmp_path)
    assert family("peagle").extends == "eagle3"


def test_every_shipped_recipe_reads_only_its_family_options():
    from importlib.resources import files

    from specforge.config import SHIPPED_RECIPES, load_config

    recipes = sorted(p for p in files(SHIPPED_RECIPES).iterdir() if p.name.endswith(".yaml"))
    types = set()
    for recipe in recipes:
        cfg = load_config(str(recipe))
        check_options(cfg)
        types.add(cfg.draft.type)
    assert types == set(REGISTRY)  # a recipe for every family
