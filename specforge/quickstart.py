"""``specforge quickstart``: the whole pipeline on the embedded default, offline, on a CPU.

1. prepare: SmolLM2-135M-Instruct answers the built-in prompts (train split) itself;
2. train: the default recipe (``configs/smollm2-135m-eagle3.yaml``), online TTT;
3. export: ``<output>/export``, the directory SGLang/vLLM load;
4. bench: greedy chain drafting vs the target alone (and prompt lookup) on MT-Bench when it is
   reachable (``--questions PATH`` or the HF dataset), otherwise on the held-out built-in
   prompts that training never saw; prints the accept length and the speedup.

Every stage resumes: rerunning the same command skips finished work (prepared conversations,
training checkpoints).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from specforge.config import load_config
from specforge.data.benchmarks import BUILTIN_EVAL, load_questions
from specforge.serving.bench import BenchSettings, run_bench
from specforge.serving.export import export_checkpoint
from specforge.trainer.checkpoint import latest_checkpoint
from specforge.trainer.train import train

logger = logging.getLogger(__name__)

DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m-eagle3.yaml"
MT_BENCH_HF = "HuggingFaceH4/mt_bench_prompts"


def pick_questions(questions: str | None) -> str:
    """The user's question set, else MT-Bench from the HF hub if reachable, else the held-out
    built-in prompts."""
    if questions:
        return questions
    try:
        load_questions(MT_BENCH_HF, limit=1)
        return MT_BENCH_HF
    except ValueError as err:
        logger.warning(
            "MT-Bench is not reachable (%s); benchmarking on the held-out built-in prompts instead",
            str(err).splitlines()[0][:200],
        )
        return BUILTIN_EVAL


def quickstart(
    output: str,
    *,
    questions: str | None = None,
    max_new_tokens: int = 128,
    num_steps: int = 5,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Run prepare -> train -> export -> bench into ``output`` and return the bench result."""
    if not DEFAULT_RECIPE.is_file():
        raise FileNotFoundError(
            f"the default recipe {DEFAULT_RECIPE} is missing: quickstart runs from a checkout "
            "of the repository (pip install -e .)"
        )
    cfg = load_config(
        DEFAULT_RECIPE,
        [
            f"output_dir={output}",
            "train.resume=true",
            "prepare.vocab_output=null",
            *(overrides or []),
        ],
    )
    timings = {}
    start = time.perf_counter()
    train(cfg)  # prepares the self-distilled data first when it is missing
    timings["prepare_and_train_s"] = time.perf_counter() - start
    checkpoint = latest_checkpoint(Path(output) / "checkpoints")
    start = time.perf_counter()
    export_dir = export_checkpoint(checkpoint, Path(output) / "export")
    timings["export_s"] = time.perf_counter() - start
    question_set = pick_questions(questions)
    start = time.perf_counter()
    result = run_bench(
        BenchSettings(
            target=cfg.target.name_or_path,
            draft=str(export_dir),
            questions=question_set,
            num_steps=num_steps,
            max_new_tokens=max_new_tokens,
            dtype="float32",
            output=str(Path(output) / "bench"),
        )
    )
    timings["bench_s"] = time.perf_counter() - start
    result["quickstart"] = {"questions": question_set, "checkpoint": str(checkpoint), **timings}
    return result
