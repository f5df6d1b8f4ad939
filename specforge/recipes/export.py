"""The ``export`` recipe: a training checkpoint -> the directory SGLang and vLLM load
(:mod:`specforge.serving.export` holds the contract and the writer).

The target is the one the checkpoint was trained against (its config and tokenizer; no weights
are loaded). ``trust_remote_code`` comes only from this run's own config or flag, never from the
checkpoint's saved config.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from specforge.config import SpecForgeConfig, TargetConfig, from_dict
from specforge.errors import UserError
from specforge.io import iter_jsonl
from specforge.models.target import load_target_config, load_tokenizer
from specforge.recipes.stage import start_stage
from specforge.serving.advice import sglang_advice
from specforge.serving.export import write_export
from specforge.serving.export_dflash import write_dflash_export
from specforge.trainer.checkpoint import (
    checkpoint_problem,
    latest_checkpoint,
    load_draft,
    read_trainer_state,
)

logger = logging.getLogger(__name__)


def checkpoint_to_export(cfg: SpecForgeConfig) -> Path:
    """``export.checkpoint``, else the newest checkpoint under ``<output_dir>/checkpoints``.

    Raises:
        UserError: there is none.
    """
    if cfg.export.checkpoint:
        return Path(cfg.export.checkpoint)
    newest = latest_checkpoint(Path(cfg.output_dir) / "checkpoints")
    if newest is None:
        raise UserError(
            f"no checkpoint under {cfg.output_dir}/checkpoints: train first, or name one "
            "(specforge export CHECKPOINT OUTPUT)"
        )
    return newest


def trained_target(state: dict, cfg: SpecForgeConfig) -> TargetConfig:
    """The target a checkpoint was trained against, with this run's ``trust_remote_code``."""
    saved = state["config"]["target"]
    known = {f.name for f in dataclasses.fields(TargetConfig)}
    target = from_dict(TargetConfig, {k: v for k, v in saved.items() if k in known}, "target.")
    return dataclasses.replace(target, trust_remote_code=cfg.target.trust_remote_code)


def training_advice(checkpoint: Path) -> dict | None:
    """SGLang launch advice from the last held-out evaluation of the run that wrote
    ``checkpoint`` (``<output_dir>/metrics.jsonl`` beside ``checkpoints/``), or ``None``."""
    metrics = checkpoint.parent.parent / "metrics.jsonl"
    if not metrics.is_file():
        return None
    evals = [
        r
        for _, r in iter_jsonl(metrics, strict=False)
        if isinstance(r, dict) and r.get("split") == "eval"
    ]
    if not evals:
        return None
    rates = []
    while f"cond_acc_{len(rates)}" in evals[-1]:
        rates.append(evals[-1][f"cond_acc_{len(rates)}"])
    if not rates:
        return None
    return sglang_advice(
        rates, f"the training evaluation (step {evals[-1]['step']}, held-out conversations)"
    )


def export(cfg: SpecForgeConfig) -> Path:
    """Export the checkpoint ``cfg`` names to ``cfg.export_dir``; returns the directory.

    Raises:
        UserError: no checkpoint, a checkpoint whose files differ from the checksums it
            recorded or that does not fit, or an output directory that holds something other
            than a previous export.
    """
    cfg = start_stage(cfg)
    checkpoint = checkpoint_to_export(cfg)
    state = read_trainer_state(checkpoint)
    if (problem := checkpoint_problem(checkpoint)) is not None:
        raise UserError(f"cannot export {checkpoint}: {problem}")
    target = trained_target(state, cfg)
    model = load_draft(checkpoint)
    if state.get("draft_type") == "dflash":
        out = write_dflash_export(
            cfg.export_dir,
            model=model,
            target_config=load_target_config(target),
            dtype=cfg.export.dtype,
            tokenizer=load_tokenizer(target),
        )
        logger.info("exported %s -> %s (DFlash)", checkpoint, out)
        return out
    out = write_export(
        cfg.export_dir,
        model=model,
        target_config=load_target_config(target),
        aux_layer_ids=state["aux_layer_ids"],
        dtype=cfg.export.dtype,
        tokenizer=load_tokenizer(target),
        advice=training_advice(checkpoint),
    )
    logger.info("exported %s -> %s", checkpoint, out)
    return out
