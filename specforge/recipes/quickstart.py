"""The ``quickstart`` recipe: the whole pipeline on the embedded default, offline, on a CPU.

1. prepare: SmolLM2-135M-Instruct answers the built-in prompts (train split) itself;
2. train: the default recipe (the shipped ``smollm2-135m-eagle3.yaml``), online TTT;
3. export: ``<output>/export``, the directory SGLang/vLLM load;
4. bench: greedy chain drafting vs the target alone (and prompt lookup) on ``bench.questions``
   (the recipe's ``auto``: MT-Bench from the HF hub when reachable, else the held-out built-in
   prompts that training never saw); prints the accept length and the speedup.

Every stage resumes: rerunning the same command skips finished work (answered conversations,
training checkpoints); the export is replaced by the new one.

With ``quickstart.minutes`` (the shipped recipe: 60) the whole run keeps to a wall-clock
budget on any CPU: prepare runs to the end, growing the corpus in rounds of
``quickstart.synthesize_step`` self-written prompts while they fit in ``quickstart.data_share``
of the budget (:func:`next_round_fits`: the data engine's scaling evidence says distinct
conversations, not more passes over few, is what spare time should buy), and training gets what
is left after the bench's estimated time (:func:`estimate_bench_seconds`,
:func:`train_minutes`), stopping at ``train.max_steps`` or there. The first run's prepare time,
corpus size and bench estimate are kept in ``<output_dir>/quickstart.json`` for reruns.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specforge.config import DEFAULT_RECIPE, QuickstartConfig, SpecForgeConfig, load_config
from specforge.data.chat import end_of_turn_ids, pad_id_of, prompt_ids
from specforge.data.questions import load_questions
from specforge.engine.target import build_engine
from specforge.errors import UserError
from specforge.io import write_json_atomic
from specforge.models.adapter import text_config
from specforge.models.target import default_aux_layer_ids, load_target
from specforge.recipes.bench import bench, engine_passes, engine_tokens
from specforge.recipes.export import export
from specforge.recipes.prepare import prepare
from specforge.recipes.stage import start_stage
from specforge.recipes.train import train
from specforge.serving.bench import greedy_generate

logger = logging.getLogger(__name__)

MIN_TRAIN_MINUTES = 2.0
"""Less than this left for training after prepare is an error, not a useless draft."""


@dataclass
class QuickstartResult:
    """The benchmark result and how long each stage took."""

    bench: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)


QUICKSTART_OVERRIDES = (
    "output_dir=outputs/quickstart",
    "train.resume=true",
    "prepare.vocab_output=null",
)
"""What the quickstart changes in the default recipe (before the user's own settings): its
own output folder, resuming reruns, no vocab map outside that folder."""


def quickstart_config(overrides: list[str] | None = None) -> SpecForgeConfig:
    """The shipped default recipe with :data:`QUICKSTART_OVERRIDES`, then ``overrides``."""
    return load_config(DEFAULT_RECIPE, [*QUICKSTART_OVERRIDES, *(overrides or [])])


COMPILATIONS = 2.0
"""The bench's compilation of the engine, in compilations of the decoding graph as the
estimate times it: the bench compiles its verification graph (1.4x as long, cold, on 2 CPU
cores) and takes its decoding graph from the compile cache that compilation filled (0.3x)."""

TIMED_TOKENS = 32
"""Greedy tokens timed to estimate the bench's per-token cost (after one untimed warm-up)."""


def estimate_bench_seconds(cfg: SpecForgeConfig) -> float:
    """The export and bench's time, from the bench's own workload: every turn of
    ``bench.questions`` decodes up to ``bench.max_new_tokens`` tokens with the target alone
    through HF ``generate`` and through the engine, with the draft and, when on, with prompt
    lookup (:func:`~specforge.recipes.bench.engine_passes` through the engine), plus the
    engine's compilation. Each per-token time is timed on the first question's first turn, with
    the target loaded as the bench loads it (``bench.dtype``) and the engine built as it builds
    it (``engine.compile``; its first decoding compiles, :data:`COMPILATIONS`). 0 for
    ``bench.engine: sglang`` (the server decodes)."""
    bc = cfg.bench
    if bc.engine != "builtin":
        return 0.0
    questions = load_questions(bc.questions, limit=bc.limit)
    turns = sum(len(q.turns) for q in questions)
    target, tokenizer = load_target(cfg.target, dtype=bc.dtype)
    messages = [{"role": "user", "content": questions[0].turns[0]}]
    ids = torch.tensor([prompt_ids(tokenizer, messages)], device=cfg.target.device)
    eos = end_of_turn_ids(tokenizer, target.generation_config)
    pad = pad_id_of(tokenizer, target.generation_config)
    hf_per_token = _per_token(
        lambda tokens: greedy_generate(
            target, ids, tokens, eos_token_ids=eos, pad_token_id=pad, min_new_tokens=tokens
        )
    )
    layers = text_config(target.config).num_hidden_layers
    engine, _ = build_engine(
        target,
        aux_layer_ids=default_aux_layer_ids(layers),
        compile=cfg.engine.compile,
        tokens=engine_tokens(bc, turns),
    )
    engine_per_token, compile_seconds = hf_per_token, 0.0
    if engine is not None:  # else the bench decodes through transformers too

        def through_engine(tokens: int) -> list[int]:  # the bench's target alone
            return engine.generate(ids, max_new_tokens=tokens)

        engine_per_token = _per_token(through_engine)
        compile_seconds = COMPILATIONS * engine.stats.compile_seconds
        logger.info(
            "the bench's target: %.1f ms a token through HF generate, %.1f through the engine "
            "(its decoding graph compiled in %.0f s)",
            1000 * hf_per_token,
            1000 * engine_per_token,
            engine.stats.compile_seconds,
        )
    # the target alone through the engine, the draft, prompt lookup
    per_turn = bc.max_new_tokens * (hf_per_token + engine_passes(bc) * engine_per_token)
    return turns * per_turn + compile_seconds


def _per_token(decode: Callable[[int], list[int]]) -> float:
    """The seconds a token of ``decode(tokens)`` (up to ``tokens`` greedy tokens) takes, timed
    over :data:`TIMED_TOKENS` after an untimed warm-up of 4 (allocations, lazy
    initialisation, compilation)."""
    decode(4)
    start = time.perf_counter()
    tokens = len(decode(TIMED_TOKENS))
    return (time.perf_counter() - start) / max(tokens, 1)


def train_minutes(qc: QuickstartConfig, prepare_seconds: float, bench_seconds: float) -> float:
    """Training's share of the quickstart's budget: the budget less prepare's time and the
    bench's estimate.

    Raises:
        UserError: less than :data:`MIN_TRAIN_MINUTES` left.
    """
    left = qc.minutes - (prepare_seconds + bench_seconds) / 60
    if left < MIN_TRAIN_MINUTES:
        raise UserError(
            f"prepare took {prepare_seconds / 60:.1f} and the bench needs about "
            f"{bench_seconds / 60:.1f} of the quickstart's {qc.minutes:g} minutes "
            f"(quickstart.minutes), leaving {max(left, 0):.1f} for training; raise "
            f"quickstart.minutes, or lower synthesize.count, quickstart.data_share or the "
            f"bench's questions"
        )
    return left


def _read_plan(cfg: SpecForgeConfig) -> dict[str, Any]:
    """What an earlier run of the same quickstart measured (``<output_dir>/quickstart.json``):
    ``prepare_seconds``, ``synthesize_count``, ``data_done``, ``bench_seconds``."""
    path = Path(cfg.output_dir) / "quickstart.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_plan(cfg: SpecForgeConfig, plan: dict[str, Any]) -> None:
    write_json_atomic(Path(cfg.output_dir) / "quickstart.json", plan)


def _with_count(cfg: SpecForgeConfig, count: int) -> SpecForgeConfig:
    return dataclasses.replace(cfg, synthesize=dataclasses.replace(cfg.synthesize, count=count))


def next_round_fits(
    qc: QuickstartConfig, *, spent_seconds: float, round_seconds: float, round_answered: int
) -> bool:
    """Whether another ``qc.synthesize_step`` prompts, at the pace of the last prepare round
    (``round_seconds`` for ``round_answered`` conversations), end within ``qc.data_share`` of
    the budget. A round that answered nothing (synthesis gave up, or the rerun of finished
    work) grows nothing."""
    if not (qc.minutes and qc.data_share) or round_answered < 1:
        return False
    next_seconds = round_seconds * qc.synthesize_step / round_answered
    return spent_seconds + next_seconds <= qc.data_share * qc.minutes * 60


def _prepare_within_budget(cfg: SpecForgeConfig) -> tuple[SpecForgeConfig, float]:
    """Prepare, growing ``synthesize.count`` by ``quickstart.synthesize_step`` while
    :func:`next_round_fits`; returns the config with the count reached and prepare's seconds.

    Every round is an ordinary (resumable) prepare over the larger count: synthesis keeps the
    prompts already written and regeneration the answers, so a round pays only for what it
    adds. The plan records the count and the seconds after every round: a rerun finishes an
    interrupted growth with the seconds already spent, and a rerun of finished work prepares
    the recorded count (all of it already done) and keeps the first run's seconds."""
    plan = _read_plan(cfg)
    # a plan from before growth (no synthesize_count) had finished its data
    done = plan.get("data_done", "prepare_seconds" in plan and "synthesize_count" not in plan)
    count = plan.get("synthesize_count", cfg.synthesize.count)
    spent = plan.get("prepare_seconds", 0.0)
    while True:
        start = time.perf_counter()
        result = prepare(_with_count(cfg, count))
        seconds = time.perf_counter() - start
        if done:
            return _with_count(cfg, count), spent
        spent += seconds
        answered = result.stats.get("regenerate", {}).get("written", 0)
        grow = next_round_fits(
            cfg.quickstart, spent_seconds=spent, round_seconds=seconds, round_answered=answered
        )
        plan.update(prepare_seconds=round(spent, 1), synthesize_count=count, data_done=not grow)
        _write_plan(cfg, plan)
        if not grow:
            return _with_count(cfg, count), spent
        logger.info(
            "quickstart: prepare has spent %.1f of its %.1f minutes (quickstart.data_share); "
            "%d conversations answered in %.1f minutes: %d more prompts",
            spent / 60,
            cfg.quickstart.data_share * cfg.quickstart.minutes,
            answered,
            seconds / 60,
            cfg.quickstart.synthesize_step,
        )
        count += cfg.quickstart.synthesize_step


def _train_budget(cfg: SpecForgeConfig, prepare_seconds: float) -> SpecForgeConfig:
    """``cfg`` with ``train.max_minutes`` from the quickstart's budget. The bench's estimate
    (with the time the estimate itself took) is the first run's, kept in
    ``<output_dir>/quickstart.json`` beside prepare's time: a rerun (whose prepare finds its
    work done) aims at the same budget."""
    plan = _read_plan(cfg)
    if "bench_seconds" not in plan:
        start = time.perf_counter()
        estimate = estimate_bench_seconds(cfg)  # its own time counts too (a compilation)
        plan.update(
            prepare_seconds=round(plan.get("prepare_seconds", prepare_seconds), 1),
            bench_seconds=round(estimate + time.perf_counter() - start, 1),
        )
        _write_plan(cfg, plan)
    minutes = train_minutes(cfg.quickstart, plan["prepare_seconds"], plan["bench_seconds"])
    logger.info(
        "quickstart.minutes %g, prepare took %.1f, the bench needs about %.1f: training gets "
        "%.1f minutes (or train.max_steps=%d steps, if sooner)",
        cfg.quickstart.minutes,
        plan["prepare_seconds"] / 60,
        plan["bench_seconds"] / 60,
        minutes,
        cfg.train.max_steps,
    )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_minutes=minutes))


def quickstart(cfg: SpecForgeConfig) -> QuickstartResult:
    """Run prepare -> train -> export -> bench as ``cfg`` describes (see the module docstring)."""
    cfg = start_stage(cfg)
    result = QuickstartResult(bench={})
    # 1. prepare (growing the corpus within quickstart.data_share)
    start = time.perf_counter()
    cfg, prepare_seconds = _prepare_within_budget(cfg)
    result.seconds["prepare"] = time.perf_counter() - start
    # 2. train (within what the budget leaves), 3. export
    if cfg.quickstart.minutes:
        cfg = _train_budget(cfg, prepare_seconds)
    for name, stage in (("train", train), ("export", export)):
        start = time.perf_counter()
        stage(cfg)
        result.seconds[name] = time.perf_counter() - start
    # 4. bench
    start = time.perf_counter()
    result.bench = bench(cfg)
    result.seconds["bench"] = time.perf_counter() - start
    return result
