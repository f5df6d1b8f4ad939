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

from specforge.config import ENGINE_OPTIONS, BenchConfig, SpecForgeConfig, TargetConfig, from_dict
from specforge.errors import UserError
from specforge.families.dispatch import (
    export_checks,
    family_of_checkpoint,
    family_of_export,
    load_checkpoint_draft,
)
from specforge.io import iter_jsonl, read_json, write_json_atomic
from specforge.models.adapter import text_config
from specforge.models.target import load_target_config, load_tokenizer
from specforge.recipes.bench_vllm import check_vllm_source
from specforge.recipes.stage import start_stage
from specforge.serving.advice import sglang_advice
from specforge.serving.export import MARKER
from specforge.trainer.checkpoint import checkpoint_problem, latest_checkpoint, read_trainer_state

logger = logging.getLogger(__name__)

DEFAULT_CHECK_STEPS = 5
"""The chain depth the engine check serves an export at under ``bench.num_steps: auto`` (vLLM
serves a fixed depth) when its family has no depth of its own (``default_depth``)."""


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
    if cfg.export.verify_engine == "vllm":
        check_vllm_source(cfg.bench)
    checkpoint = checkpoint_to_export(cfg)
    state = read_trainer_state(checkpoint)
    if (problem := checkpoint_problem(checkpoint)) is not None:
        raise UserError(f"cannot export {checkpoint}: {problem}")
    target = trained_target(state, cfg)
    draft_family = family_of_checkpoint(state)
    out = draft_family.write_export(
        cfg.export_dir,
        model=load_checkpoint_draft(checkpoint),
        target_config=load_target_config(target),
        aux_layer_ids=state["aux_layer_ids"],
        dtype=cfg.export.dtype,
        tokenizer=load_tokenizer(target),
        advice=training_advice(checkpoint),
    )
    logger.info("exported %s -> %s (%s)", checkpoint, out, draft_family.name)
    if cfg.export.verify_engine == "vllm":
        check_with_vllm(dataclasses.replace(cfg, target=target), out)
    return out


def check_with_vllm(cfg: SpecForgeConfig, export_dir: Path) -> dict:
    """The engine gate on a fresh export (``export.verify_engine``): the export's contract
    checked, then the built-in runtime and vLLM on the same few questions at the same chain
    depth; the outcome is recorded in the export's ``specforge-export.json`` (``engine_check``)
    and returned.

    Raises:
        UserError: vLLM cannot be reached or launched; or the gate fails (recorded first): a
            check of the export's contract fails (then nothing is served), or vLLM's accept
            length falls more than ``bench.agreement_margin`` below the built-in runtime's.
    """
    checks = export_checks(export_dir, text_config(load_target_config(cfg.target)))
    problems = [c["problem"] for c in checks if c["problem"]]
    record = {"engine": "vllm", "failed_checks": [c["check"] for c in checks if c["problem"]]}
    if not problems:
        record |= _served_against_builtin(cfg, export_dir)
    record["passed"] = not problems and record["agrees"]
    marker = export_dir / MARKER
    write_json_atomic(marker, {**read_json(marker), "engine_check": record})
    if problems:
        raise UserError(f"the engine check of {export_dir} failed, not served: {problems}")
    if not record["agrees"]:
        raise UserError(
            f"the engine check of {export_dir} failed: vLLM's accept length "
            f"{record['engine_tau']:.3f} is {record['gap']:.0%} below the built-in runtime's "
            f"{record['builtin_tau']:.3f} on the same {record['turns']} turns (margin "
            f"{record['margin']:.0%}), with every export check passed: the gap is in how the "
            f"engine serves the draft (the reports: {record['reports']})"
        )
    logger.info(
        "vLLM %s serves the export at accept length %.3f, the built-in runtime's %.3f",
        record["version"],
        record["engine_tau"],
        record["builtin_tau"],
    )
    return record


def _served_against_builtin(cfg: SpecForgeConfig, export_dir: Path) -> dict:
    """The built-in bench, then vLLM's with the built-in one to agree with, on
    ``export.verify_questions`` questions; what the engine check records of them."""
    from specforge.recipes.bench import bench

    steps = cfg.bench.num_steps
    if not isinstance(steps, int):  # vLLM serves a fixed depth: the family's, else ours
        draft_family = family_of_export(export_dir)
        depth = draft_family.capabilities.default_depth(draft_family.draft_config(export_dir))
        steps = depth or DEFAULT_CHECK_STEPS
    folder = Path(cfg.output_dir) / "engine_check"
    defaults = BenchConfig()  # the built-in half reads none of the engine's options
    common = {
        "draft": str(export_dir),
        "limit": cfg.export.verify_questions,
        "num_steps": steps,
        "prompt_lookup_num_tokens": 0,
    }
    settings = dataclasses.replace(
        cfg.bench,
        **common,
        **{name: getattr(defaults, name) for name in ENGINE_OPTIONS},
        output=str(folder / "builtin"),
        engine="builtin",
    )
    builtin = bench(dataclasses.replace(cfg, bench=settings))
    settings = dataclasses.replace(
        cfg.bench,
        **common,
        engine="vllm",
        agree_with=str(folder / "builtin" / "bench.json"),
        output=str(folder / "vllm"),
    )
    served = bench(dataclasses.replace(cfg, bench=settings))
    found = served["agreement"]
    return {
        "version": served.get("engine_version"),
        "num_steps": steps,
        "questions": builtin["settings"]["questions"],
        "turns": found["turns"],
        "builtin_tau": found["builtin_tau"],
        "engine_tau": found["engine_tau"],
        "gap": found["gap"],
        "margin": found["margin"],
        "agrees": found["agrees"],
        "reports": str(folder),
    }
