"""What several benchmark scripts share: running ``specforge`` stages as subprocesses (each
skipped when its output is already there, so a rerun resumes), timing a callable, and
profiling a block; the ``--smoke`` option every script has. A script imports this module, never
another script."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml

from specforge.config import SpecForgeConfig, from_dict, load_config
from specforge.data.batching import collate
from specforge.distributed import setup_distributed
from specforge.families.dispatch import load_checkpoint_draft
from specforge.models.target import target_hidden_states
from specforge.trainer.checkpoint import latest_sound_checkpoint, read_trainer_state
from specforge.trainer.sources import OnlineTarget, draft_target_distribution
from specforge.trainer.ttt import TTTObjective


def parse_smoke(parser: argparse.ArgumentParser, **sizes) -> argparse.Namespace:
    """The script's arguments, with ``--smoke``: its sizes (argument name -> value: questions,
    tokens, steps, minutes) made as small as still runs every part of it end to end, on the
    inputs given (the test suite's tiny target, draft and data). What a smoke run prints
    measures nothing; it proves the script still runs."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="run every part on the smallest sizes (" + ", ".join(sizes) + "): a check that "
        "the script runs, not a measurement",
    )
    args = parser.parse_args()
    if args.smoke:
        for name, value in sizes.items():
            setattr(args, name, value)
    return args


def specforge(*arguments: str) -> None:
    """Run ``specforge ARGUMENTS`` with this interpreter; stop on a failure."""
    command = [sys.executable, "-m", "specforge.cli", *arguments]
    print("$", " ".join(command[2:]), flush=True)
    subprocess.run(command, check=True)


def bench(out: Path, *arguments: str) -> dict:
    """``specforge bench ARGUMENTS --output OUT``, skipped when ``OUT/bench.json`` is there;
    returns that bench.json."""
    if not (out / "bench.json").is_file():
        specforge("bench", *arguments, "--output", str(out))
    return json.loads((out / "bench.json").read_text())


def export_once(common: list[str], export: Path) -> None:
    """``specforge export COMMON`` of a run's newest checkpoint to ``export``, skipped when an
    export is there."""
    if not (export / "config.json").is_file():
        specforge("export", *common, f"export.output={export}")


def start_recipe(start: Path, output: Path) -> tuple[Path, dict]:
    """The recipe a trained run's newest checkpoint recorded, its training data named (a run
    in another ``output_dir`` holds none), written to ``OUTPUT/start.yaml``; and that
    checkpoint's trainer state (its ``step``, its ``config``)."""
    checkpoint = latest_sound_checkpoint(start / "checkpoints")
    if checkpoint is None:
        raise SystemExit(f"{start}/checkpoints: no intact checkpoint to start from")
    state = read_trainer_state(checkpoint)
    config = state["config"]
    config["train"]["data_path"] = str(from_dict(SpecForgeConfig, config).training_data_path)
    output.mkdir(parents=True, exist_ok=True)
    recipe = output / "start.yaml"
    recipe.write_text(yaml.safe_dump(config, sort_keys=False))
    return recipe, state


def answers(output: Path, name: str, questions: str, target: str, max_new_tokens: int) -> Path:
    """The float32 ``target``'s greedy answers to ``questions`` (``max_new_tokens`` a turn),
    written to ``OUTPUT/answers_NAME.jsonl`` once (its prepare stage in ``prepare_NAME``)."""
    out = output / f"answers_{name}.jsonl"
    if not out.is_file():
        specforge(
            "prepare",
            f"target.name_or_path={target}",
            f"output_dir={output / f'prepare_{name}'}",
            "--data",
            questions,
            "--regenerate",
            "--max-new-tokens",
            str(max_new_tokens),
            "--dtype",
            "float32",
            "--output",
            str(out),
        )
    return out


@torch.no_grad()
def replayed_taus(runs: dict[str, Path], recipe: Path, answers_file: Path, depth: int) -> dict:
    """The accept length of chain ``depth`` over ``answers_file`` with each run's newest
    checkpoint's draft (float32 target and drafts; :func:`specforge.trainer.ttt.replay_rounds`,
    the runtime's greedy rounds), by run name. The target runs once a conversation for every
    draft; the target's distribution is taken once for each draft vocabulary."""
    cfg = load_config(
        recipe,
        ["target.dtype=float32", "train.state_cache_gb=0", f"train.data_path={answers_file}"],
    )
    source = OnlineTarget(cfg, setup_distributed("cpu"), "cpu")
    drafts = {}
    for name, run in runs.items():
        checkpoint = latest_sound_checkpoint(run / "checkpoints")
        if checkpoint is None:
            raise SystemExit(f"{run}/checkpoints: no intact checkpoint to score")
        drafts[name] = load_checkpoint_draft(checkpoint, source.head.embed_tokens).float().eval()
    objectives = {
        name: TTTObjective(draft, depth, 1.0, replay_depth=depth).eval()
        for name, draft in drafts.items()
    }
    counts = {name: [0, 0] for name in runs}  # emitted tokens, rounds
    for sample in source.samples:
        batch = collate([sample], source.pad_id)
        states = target_states(source, batch)
        for name, objective in objectives.items():
            aux, distribution = states(drafts[name])
            replayed = objective(batch, aux, distribution).replayed
            counts[name][0] += int(replayed.emitted)
            counts[name][1] += int(replayed.rounds)
    return {
        name: {
            "tau": round(emitted / rounds, 3),
            "rounds": rounds,
            "conversations": len(source.samples),
        }
        for name, (emitted, rounds) in counts.items()
    }


def target_states(source: OnlineTarget, batch):
    """``states(draft) -> (aux, target distribution)`` for one batch: the target's forward
    once, its distribution on a draft's vocabulary once for each vocabulary (by ``hot_ids``)."""
    forward = target_hidden_states(
        source.model, batch.input_ids, batch.attention_mask, aux_layer_ids=source.aux_layer_ids
    )
    known: list[tuple[torch.Tensor, object]] = []

    def states(draft):
        found = next((d for hot_ids, d in known if torch.equal(hot_ids, draft.hot_ids)), None)
        if found is None:
            found = draft_target_distribution(forward.last_hidden_state, source.head, draft, batch)
            known.append((draft.hot_ids, found))
        return forward.aux_hidden_states, found

    return states


def median_ms(fn, repeats: int) -> float:
    """The median wall time of ``fn()`` over ``repeats`` calls after one warm-up, in ms."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


@contextmanager
def profiled(device: torch.device) -> Iterator[None]:
    """Prints PyTorch's profiler tables of the block: host time by operator, and on a GPU its
    own time by kernel."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if cuda:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
