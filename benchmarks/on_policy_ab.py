"""The on-policy phase at equal time: two continuations of one trained EAGLE-3 draft (a
quickstart's), each for the same minutes at the phase's constant learning rate (where the
supervised schedule ended) on the same corpus, one with the on-policy loss
(``train.on_policy.replay: true``: the current draft's replayed chain rounds) and one without
(``false``: every position and step, as the supervised steps train), scored by the accept
length of chain ``--depth`` over the target's own greedy answers to MT-Bench and to questions
the recipe never saw; then each arm is exported and benched on each set.

    python benchmarks/on_policy_ab.py --start outputs/quickstart --minutes 10 \\
        --set mt_bench=question.jsonl --set gsm8k=gsm8k_40.jsonl --output outputs/on_policy_ab \\
        --result docs/results/on_policy_ab_cpu.json

Accept length here is first the replay's (:func:`specforge.trainer.ttt.replay_rounds`): the
rounds the runtime's greedy chain runs over the target's greedy answer, which equal the
runtime's own (tested), read without timing anything. The answers are the float32 target's
(``specforge prepare --regenerate``, as the bench decodes), the draft scored in float32. Then
``specforge bench`` serves each arm's export as a user would (``--bench-steps``, default
``auto``; the recipe's bench settings otherwise, every question, prompt lookup's baseline
off): accept length, speedup over the compiled target alone, every output checked against
the target's (``--no-bench`` skips it). Each arm starts from a copy of the start's newest
checkpoint; every step is skipped on a rerun when its output is there (a checkpoint, an
answers file, an export, a ``bench.json``). Run it alone (2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from common import answers, bench, export_once, parse_smoke, replayed_taus, specforge, start_recipe

from specforge.results import figures_markdown, write_result
from specforge.trainer.checkpoint import latest_sound_checkpoint

ARMS = {"supervised": "false", "on_policy": "true"}
"""Each arm's ``train.on_policy.replay``."""


def continue_arm(arm: str, recipe: Path, step: int, args) -> Path:
    """Train one arm from a copy of the start's newest checkpoint; returns its folder."""
    out = Path(args.output) / arm
    if not (out / "checkpoints").is_dir():
        start = latest_sound_checkpoint(Path(args.start) / "checkpoints")
        shutil.copytree(start, out / "checkpoints" / start.name)
        shutil.copy(Path(args.start) / "vocab_map.safetensors", out)
    specforge(
        "train",
        "--config",
        str(recipe),
        f"output_dir={out}",
        "train.resume=true",
        f"train.max_steps={step}",  # the supervised steps are done
        "train.on_policy.steps=1000000",
        f"train.on_policy.max_minutes={args.minutes}",
        f"train.on_policy.depth={args.depth}",
        f"train.on_policy.replay={ARMS[arm]}",
    )
    return out


def bench_arms(runs: dict[str, Path], recipe: Path, sets: dict[str, str], args) -> dict:
    """Export each arm's newest draft and bench it on each set of questions, the arms in turn
    within a set; returns the figures by arm, then by set."""
    common = {arm: ["--config", str(recipe), f"output_dir={run}"] for arm, run in runs.items()}
    for arm, run in runs.items():
        export_once(common[arm], run / "export")
    figures: dict[str, dict] = {arm: {} for arm in runs}
    for name, questions in sets.items():
        for arm, run in runs.items():
            report = bench(
                Path(args.output) / f"bench_{arm}_{name}",
                *common[arm],
                f"bench.draft={run / 'export'}",
                f"bench.questions={questions}",
                "bench.limit=null",
                f"bench.max_new_tokens={args.max_new_tokens}",
                f"bench.num_steps={args.bench_steps}",
                "bench.prompt_lookup_num_tokens=0",
            )
            figures[arm][name] = {
                "tau": round(report["tau"], 3),
                "speedup": round(report["speedup"], 3),
                "tokens_per_s": report["tokens_per_s"],
                "all_match": report["all_match"],
                "turns": report["turns"],
                "engine": report["engine"]["path"],
            }
    return figures


def arm_row(arm: str, run: Path, start_step: int, scores: dict) -> dict:
    """One arm's steps, training metrics and accept length on each set (``scores``: by set,
    then by arm)."""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    phase = [m for m in metrics if m.get("split") == "on_policy"]
    held_out = [m for m in metrics if m.get("split") == "eval"]
    return {
        "arm": arm,
        "steps": phase[-1]["step"] - start_step,
        "held_out_tau_replay": round(held_out[-1].get("tau_replay", float("nan")), 3),
        "held_out_tau_pred": round(held_out[-1]["tau_pred"], 3),
        **{name: by_arm[arm] for name, by_arm in scores.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", required=True, help="a trained run's output_dir")
    parser.add_argument("--minutes", type=float, default=10.0, help="training minutes an arm")
    parser.add_argument(
        "--set", action="append", required=True, help="NAME=QUESTIONS, scored on its answers"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--depth", type=int, default=5, help="the chain depth scored")
    parser.add_argument(
        "--bench",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="export each arm and run specforge bench on each set",
    )
    parser.add_argument("--bench-steps", default="auto", help="the bench's num_steps")
    parser.add_argument("--output", default="outputs/on_policy_ab", help="the runs' folder")
    parser.add_argument("--result", default=None, help="the JSON (default OUTPUT/ab.json)")
    args = parse_smoke(parser, minutes=0.05, max_new_tokens=8)
    recipe, state = start_recipe(Path(args.start), Path(args.output))
    step = state["step"]
    questions = dict(item.split("=", 1) for item in args.set)
    target = state["config"]["target"]["name_or_path"]
    sets = {
        name: answers(Path(args.output), name, path, target, args.max_new_tokens)
        for name, path in questions.items()
    }
    runs = {"start": Path(args.start)}
    runs |= {arm: continue_arm(arm, recipe, step, args) for arm in ARMS}
    scores = {name: replayed_taus(runs, recipe, path, args.depth) for name, path in sets.items()}
    start = {name: by_arm["start"] for name, by_arm in scores.items()}
    rows = [arm_row(arm, runs[arm], step, scores) for arm in ARMS]
    if args.bench:
        benched = bench_arms({arm: runs[arm] for arm in ARMS}, recipe, questions, args)
        for row in rows:
            row["bench"] = benched[row["arm"]]
    report(args, step, start, rows, list(sets))


def bench_cell(row: dict, name: str) -> str:
    """An arm's bench on one set: accept length, speedup, identical turns."""
    b = row["bench"][name]
    identical = f"{b['turns']}/{b['turns']}" if b["all_match"] else "NOT all identical"
    return f"{b['tau']}, {b['speedup']}x, {identical}"


def report(args, step: int, start: dict, rows: list[dict], names: list[str]) -> None:
    """Write the result and print its table."""
    benched = f" Then each arm's export benched at num_steps {args.bench_steps}." * args.bench
    bench_names = names if args.bench else []
    table = {
        "columns": [
            "arm",
            "steps",
            "held-out tau_replay",
            *(f"{n} chain-{args.depth} tau (replay)" for n in names),
            *(f"{n} {args.bench_steps}: tau, speedup, identical" for n in bench_names),
        ],
        "rows": [["start", 0, "-", *(start[n]["tau"] for n in names), *("-" for _ in bench_names)]]
        + [
            [
                r["arm"],
                r["steps"],
                r["held_out_tau_replay"],
                *(r[n]["tau"] for n in names),
                *(bench_cell(r, n) for n in bench_names),
            ]
            for r in rows
        ],
    }
    record = write_result(
        Path(args.result or Path(args.output) / "ab.json"),
        {"settings": vars(args), "start_step": step, "start": start, "rows": rows},
        title="The on-policy phase at equal time (cpu)",
        summary=(
            f"Two continuations of {args.start}'s draft (step {step}), {args.minutes:g} minutes "
            "each at the learning rate its schedule ended at, on its corpus: with the on-policy "
            "loss and without. "
            f"Accept length of chain {args.depth} over the float32 target's greedy answers "
            f"({args.max_new_tokens} tokens a turn), by replaying the runtime's rounds." + benched
        ),
        figures=table,
    )
    print(figures_markdown(record["figures"]))


if __name__ == "__main__":
    main()
