"""What the recipes ask of a draft family, dispatched on the registry
(:mod:`specforge.families`): the family of a checkpoint or an export, loading a checkpoint's
draft, the depth an export drafts at, an export's checks, refusing another family's options
and starting from a published draft.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from specforge.config import ConfigError, VocabConfig
from specforge.data.vocab import VocabMap
from specforge.errors import UserError
from specforge.families import REGISTRY, families, family
from specforge.families.base import DraftFamily, draft_vocabulary
from specforge.io import read_json, read_safetensors
from specforge.models.eagle3 import load_draft_weights
from specforge.serving.export import check_as_written, engine_defaults, engine_tensors
from specforge.trainer.checkpoint import read_trainer_state

logger = logging.getLogger(__name__)


def family_of_checkpoint(state: dict[str, Any]) -> DraftFamily:
    """The family a checkpoint's trainer state records (``draft_type``; ``eagle3`` before the
    key was written)."""
    return family(state.get("draft_type", "eagle3"))


def load_checkpoint_draft(path: str | Path, target_embedding=None):
    """The draft saved in checkpoint ``path``, of the family its trainer state records. A
    checkpoint holds no copy of the target's tensors (a draft's ``frozen_weights``):
    ``target_embedding`` (V, Ht) fills the embedding, else the caller must (the draft's
    proposals mean nothing until then).

    Raises:
        UserError: not a checkpoint, or weights that do not fit its saved geometry.
    """
    path = Path(path)
    found = family_of_checkpoint(read_trainer_state(path))
    config_path = path / "draft_config.json"
    model = found.new_model(read_json(config_path), str(config_path))
    load_draft_weights(model, read_safetensors(path / "draft.safetensors"), str(path))
    if target_embedding is not None:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target_embedding)
    return model


def family_of_export(export_dir: str | Path) -> DraftFamily:
    """The family whose layout an export's ``config.json`` has: a family that extends another
    is asked before the one it extends.

    Raises:
        UserError: no ``config.json``, or a layout no family recognises.
    """
    config_path = Path(export_dir) / "config.json"
    if not config_path.is_file():
        raise UserError(f"{export_dir} is not an export directory (no config.json)")
    exported = engine_defaults(read_json(config_path))
    extended = {f.extends for f in families()}
    for found in sorted(families(), key=lambda f: f.name in extended):
        if found.recognizes(exported):
            return found
    raise UserError(
        f"{config_path}: architectures {exported.get('architectures')} is no draft family's "
        f"export (one of {sorted(REGISTRY)})"
    )


def check_options(cfg) -> None:
    """Refuse a family-only option set for another family: a key of a ``draft.*`` or
    ``train.*`` option (a family's whole section ``draft.<name>``: each of its keys) that
    differs from its default while ``draft.type``'s family does not read it.

    Raises:
        ConfigError: naming the key, its value and the families that read it; or a family
            that trains online only with ``data.mode: offline``.
    """
    chosen = family(cfg.draft.type)
    if cfg.data.mode == "offline" and not chosen.offline:
        raise ConfigError(
            f"draft.type {chosen.name} trains online (data.mode online): a capture holds "
            "EAGLE-3's three aux layers, not the layers this draft reads"
        )
    readers: dict[str, list[str]] = {}
    for found in families():
        for key in found.options:
            readers.setdefault(key, []).append(found.name)
    for key, names in readers.items():
        if chosen.name in names:
            continue
        section, name = key.split(".", 1)
        for leaf, value, default in _set_values(getattr(cfg, section), name, section):
            if value != default:
                raise ConfigError(
                    f"{leaf}={value!r} does nothing for draft.type {chosen.name} (read by "
                    f"{', '.join(names)}): remove it, or set draft.type to one of those"
                )


def _set_values(section, dotted: str, where: str):
    """``(key, value, default)`` of a field (nested: ``on_policy.steps``) of a config
    ``section`` named ``where``, or of each field of a section it names."""
    head, _, rest = dotted.partition(".")
    value, where = getattr(section, head), f"{where}.{head}"
    if rest:
        return _set_values(value, rest, where)
    if dataclasses.is_dataclass(value):
        return [
            found
            for spec in dataclasses.fields(value)
            for found in _set_values(value, spec.name, where)
        ]
    spec = {f.name: f for f in dataclasses.fields(section)}[head]
    default = spec.default
    if default is dataclasses.MISSING:
        default = spec.default_factory()
    return [(where, value, default)]


def drafting_depth(export_dir: str | Path, num_steps: int | str, topk: int) -> int | str:
    """The depth the built-in runtime drafts an export at: ``num_steps``, or under ``auto`` for
    a family that has no ``auto``, the family's own depth (logged). Settings the family cannot
    run are refused here, from the export's ``config.json`` alone, before any model loads.

    Raises:
        UserError: a tree for a family without trees, or a chain deeper than it drafts.
    """
    found = family_of_export(export_dir)
    capabilities = found.capabilities
    config = found.draft_config(Path(export_dir))
    if num_steps == "auto" and not capabilities.auto_depth:
        num_steps = capabilities.default_depth(config)
        logger.info(
            "a %s draft has no auto depth: it drafts %d tokens a round", found.name, num_steps
        )
    deepest = capabilities.max_depth(config)
    if topk > 1 and not capabilities.trees:
        raise UserError(f"a {found.name} draft drafts chains only (topk 1), got topk {topk}")
    if deepest is not None and isinstance(num_steps, int) and num_steps > deepest:
        raise UserError(
            f"a {found.name} draft ({export_dir}) drafts at most {deepest} tokens a round, "
            f"got num_steps {num_steps}"
        )
    return num_steps


def export_checks(export_dir: str | Path, target_config) -> list[dict[str, str | None]]:
    """An export's contract, check by check (the files as written, then its family's checks):
    ``{"check": what, "problem": None or why}``."""
    export_dir = Path(export_dir)
    exported = engine_defaults(read_json(export_dir / "config.json"))
    tensors = engine_tensors(read_safetensors(export_dir / "model.safetensors"))
    checks = [
        (
            "files as written (the checksums of config.json and model.safetensors in "
            "specforge-export.json)",
            lambda: check_as_written(export_dir),
        ),
        *family_of_export(export_dir).export_checks(export_dir, exported, tensors, target_config),
    ]
    report = []
    for name, check in checks:
        try:
            check()
            report.append({"check": name, "problem": None})
        except (UserError, ValueError) as err:
            report.append({"check": name, "problem": str(err)})
    return report


def pretrained_draft(cfg, source, samples, device):
    """The draft ``train.from_pretrained`` names, to train further: its family's
    (``draft.type`` must be it), checked against the target and this run's aux layers, with its
    vocabulary map, or a new one from ``samples`` (``train.rebuild_vocab``: ``lm_head`` keeps
    the draft's rows of the ids both maps hold and takes the target's for the others). Returns
    ``(draft, draft_config, vocab_map)`` as a family's ``build`` does.

    Raises:
        UserError: no export there, another family's, a family that cannot start from an
            export, or a draft that does not fit the target (naming what differs).
    """
    path = Path(cfg.train.from_pretrained)
    if not (path / "config.json").is_file():
        raise UserError(
            f"train.from_pretrained {path} is not an export directory (no config.json): give "
            "what specforge export wrote"
        )
    found, chosen = family_of_export(path), family(cfg.draft.type)
    if found.name != chosen.name:
        raise UserError(
            f"train.from_pretrained {path} is a {found.name} draft, draft.type is "
            f"{chosen.name}: set --draft-type {found.name}"
        )
    if chosen.load_trainable is None:
        raise UserError(f"a {chosen.name} draft cannot start from an export yet ({path})")
    aux = found.aux_layer_ids(path, source.head.config)
    if list(aux) != list(source.aux_layer_ids):
        raise UserError(
            f"train.from_pretrained {path} reads the target's layers {list(aux)}, this run "
            f"{list(source.aux_layer_ids)}: set target.aux_layer_ids={list(aux)}"
        )
    draft, config = chosen.load_trainable(path, source.head)
    vocab = VocabMap(draft.d2t.clone(), draft.t2d.clone())
    if cfg.train.rebuild_vocab:
        draft, config, vocab = _with_new_vocabulary(cfg, source, samples, draft, vocab)
    elif cfg.vocab.draft_vocab_size not in (vocab.draft_vocab_size, VocabConfig().draft_vocab_size):
        raise UserError(
            f"vocab.draft_vocab_size {cfg.vocab.draft_vocab_size}: train.from_pretrained {path} "
            f"keeps its map of {vocab.draft_vocab_size} ids (set train.rebuild_vocab=true for a "
            "new one)"
        )
    draft.lm_head.weight.requires_grad_(not cfg.train.freeze_lm_head)
    if cfg.train.init_from_target:
        logger.info("train.init_from_target does not apply: the draft starts from %s", path)
    logger.info(
        "starting from %s (%s, %d draft ids%s)",
        path,
        found.name,
        vocab.draft_vocab_size,
        ", a new vocabulary map" if cfg.train.rebuild_vocab else "",
    )
    return draft.to(device), config, vocab


def _with_new_vocabulary(cfg, source, samples, draft, old: VocabMap):
    """``draft`` over a new vocabulary map of ``samples`` (``vocab.draft_vocab_size`` ids):
    a new draft of the same geometry with its weights, ``lm_head``'s rows moved to the new
    ids where the old map had them, the target's rows (logit scale folded in) elsewhere."""
    new = draft_vocabulary(cfg, source, samples)
    config = dataclasses.replace(draft.config, draft_vocab_size=new.draft_vocab_size)
    head = source.head.lm_head.detach().float().cpu() * source.head.transform.scale
    rows = head[new.hot_ids].clone()
    position = {int(t): i for i, t in enumerate(old.hot_ids.tolist())}
    kept = [(i, position[int(t)]) for i, t in enumerate(new.hot_ids.tolist()) if int(t) in position]
    if kept:
        to, fro = (torch.tensor(side) for side in zip(*kept, strict=True))
        rows[to] = draft.lm_head.weight.detach()[fro]
    state = {k: v for k, v in draft.state_dict().items() if k not in ("lm_head.weight", "d2t")}
    rebuilt = type(draft)(config)
    rebuilt.load_state_dict({**state, "lm_head.weight": rows, "d2t": new.d2t, "t2d": new.t2d})
    logger.info(
        "train.rebuild_vocab: %d of %d draft ids kept their lm_head rows",
        len(kept),
        new.draft_vocab_size,
    )
    return rebuilt.train(), config, new
