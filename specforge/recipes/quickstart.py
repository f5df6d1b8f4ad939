"""The ``quickstart`` recipe: the whole pipeline on the embedded default, offline, on a CPU.

1. prepare: SmolLM2-135M-Instruct answers the built-in prompts (train split) itself;
2. train: the default recipe (the shipped ``smollm2-135m-eagle3.yaml``), online TTT;
3. export: ``<output>/export``, the directory SGLang/vLLM load;
4. bench: greedy chain drafting vs the target alone (and prompt lookup) on ``bench.questions``
   (the recipe's ``auto``: MT-Bench from the HF hub when reachable, else the held-out built-in
   prompts that training never saw); prints the accept length and the speedup.

Every stage resumes: rerunning the same command skips finished work (answered conversations,
training checkpoints); the export is replaced by the new one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from specforge.config import DEFAULT_RECIPE, SpecForgeConfig, load_config
from specforge.recipes.bench import bench
from specforge.recipes.export import export
from specforge.recipes.prepare import prepare
from specforge.recipes.train import train


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


def quickstart(cfg: SpecForgeConfig) -> QuickstartResult:
    """Run prepare -> train -> export -> bench as ``cfg`` describes (see the module docstring)."""
    result = QuickstartResult(bench={})
    for name, stage in (("prepare", prepare), ("train", train), ("export", export)):
        start = time.perf_counter()
        stage(cfg)
        result.seconds[name] = time.perf_counter() - start
    start = time.perf_counter()
    result.bench = bench(cfg)
    result.seconds["bench"] = time.perf_counter() - start
    return result
