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
budget on any CPU: prepare runs to the end, and training gets what is left after the export and
bench's estimated share (:func:`train_minutes`), stopping at ``train.max_steps`` or there. The
first run's prepare time is kept in ``<output_dir>/quickstart.json`` for reruns.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specforge.config import DEFAULT_RECIPE, QuickstartConfig, SpecForgeConfig, load_config
from specforge.errors import UserError
from specforge.io import write_json_atomic
from specforge.recipes.bench import bench
from specforge.recipes.export import export
from specforge.recipes.prepare import prepare
from specforge.recipes.train import train

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


def train_minutes(qc: QuickstartConfig, prepare_seconds: float) -> float:
    """Training's share of the quickstart's budget after prepare took ``prepare_seconds``:
    the budget less prepare and the export and bench's estimate.

    Raises:
        UserError: less than :data:`MIN_TRAIN_MINUTES` left.
    """
    left = qc.minutes - (1 + qc.bench_share) * prepare_seconds / 60
    if left < MIN_TRAIN_MINUTES:
        raise UserError(
            f"prepare took {prepare_seconds / 60:.1f} of the quickstart's {qc.minutes:g} minutes "
            f"(quickstart.minutes), leaving {max(left, 0):.1f} for training after the bench's "
            f"share; raise quickstart.minutes or lower synthesize.count"
        )
    return left


def _train_budget(cfg: SpecForgeConfig, prepare_seconds: float) -> SpecForgeConfig:
    """``cfg`` with ``train.max_minutes`` from the quickstart's budget. Prepare's time is the
    first run's, kept in ``<output_dir>/quickstart.json``: a rerun (whose prepare finds its
    work done) aims at the same budget."""
    plan_path = Path(cfg.output_dir) / "quickstart.json"
    if plan_path.is_file():
        prepare_seconds = json.loads(plan_path.read_text())["prepare_seconds"]
    else:
        write_json_atomic(plan_path, {"prepare_seconds": round(prepare_seconds, 1)})
    minutes = train_minutes(cfg.quickstart, prepare_seconds)
    logger.info(
        "quickstart.minutes %g, prepare took %.1f: training gets %.1f minutes "
        "(or train.max_steps=%d steps, if sooner)",
        cfg.quickstart.minutes,
        prepare_seconds / 60,
        minutes,
        cfg.train.max_steps,
    )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_minutes=minutes))


def quickstart(cfg: SpecForgeConfig) -> QuickstartResult:
    """Run prepare -> train -> export -> bench as ``cfg`` describes (see the module docstring)."""
    result = QuickstartResult(bench={})
    for name, stage in (("prepare", prepare), ("train", train), ("export", export)):
        if name == "train" and cfg.quickstart.minutes:
            cfg = _train_budget(cfg, result.seconds["prepare"])
        start = time.perf_counter()
        stage(cfg)
        result.seconds[name] = time.perf_counter() - start
    start = time.perf_counter()
    result.bench = bench(cfg)
    result.seconds["bench"] = time.perf_counter() - start
    return result
