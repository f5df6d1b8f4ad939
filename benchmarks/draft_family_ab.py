"""Draft families at equal time: a draft of each family (``--families``, by default every one
the registry holds) trained for the same minutes on one conversations file with the family's
recipe (``configs/smollm2-135m-<family>.yaml``, the quickstart's data and schedule), each
exported and benched on the same questions (greedy, float32 target): held-out ``tau_pred``,
MT-Bench accept length, speedup over the compiled target alone, prompt lookup beside, every
output checked.

    python benchmarks/draft_family_ab.py --data outputs/ab/data/conversations.jsonl \\
        --minutes 10 --questions question.jsonl --prompt-lookup 10 --output outputs/ab \\
        --result docs/results/draft_family_ab_cpu.json

Each step runs the project's own CLI (``specforge train``, ``export``, ``bench``) in a
subprocess and is skipped on a rerun when its output is there (a trained run's checkpoint, an
export, a ``bench.json``). A family that drafts step by step is benched at chain ``--depth``;
one that drafts a round in one forward at the depth it drafts (``bench.num_steps auto``: a
DFlash draft's block, a P-EAGLE draft's trained depth). Prompt lookup (``--prompt-lookup N``)
proposes from the prompt, not from a draft, so it runs once, beside the first arm's bench.
``--arm NAME FAMILY [KEY=VALUE ...]`` (repeatable) replaces ``--families`` with arms that
differ in training settings too, e.g. DFlash's hard and soft labels:

    python benchmarks/draft_family_ab.py --data outputs/ab/data/conversations.jsonl \\
        --questions question.jsonl --limit 10 --arm hard dflash \\
        --arm soft dflash draft.dflash.block_labels=soft \\
        --title 'DFlash labels at equal time (cpu)' \\
        --output outputs/ab_labels --result docs/results/dflash_labels_cpu.json

Run it alone (2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import bench, export_once, parse_smoke, specforge

from specforge.families import REGISTRY
from specforge.families.dispatch import family_of_export
from specforge.results import write_result


def recipe(family: str) -> str:
    """The family's recipe on the embedded default."""
    return f"configs/smollm2-135m-{family}.yaml"


def run_arm(arm: list[str], args, first: bool) -> dict:
    """Train, export and bench one arm (``[name, family, overrides...]``); returns its row.
    Prompt lookup runs beside the first arm's bench only."""
    name, family, arm_overrides = arm[0], arm[1], arm[2:]
    lookup_tokens = args.prompt_lookup if first else 0
    out = Path(args.output) / name
    common = ["--config", recipe(family), f"output_dir={out}"]
    if not (out / "checkpoints").is_dir():
        specforge(
            "train",
            *common,
            f"train.data_path={args.data}",
            f"train.max_minutes={args.minutes}",
            *args.overrides,
            *arm_overrides,
        )
    export = out / "export"
    export_once(common, export)
    steps = args.depth if family_of_export(export).capabilities.auto_depth else "auto"
    report = bench(
        Path(args.output) / f"bench_{name}",
        *common,
        f"bench.draft={export}",
        f"bench.questions={args.questions}",
        *([f"bench.limit={args.limit}"] if args.limit else []),
        f"bench.max_new_tokens={args.max_new_tokens}",
        f"bench.num_steps={steps}",
        f"bench.prompt_lookup_num_tokens={lookup_tokens}",
        *(o for o in args.overrides if o.startswith("target.")),  # the target trained on
    )
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if m.get("split") == "eval"]
    trained = [m for m in metrics if m.get("split") == "train"]
    return {
        "family": name,
        "draft_type": family,
        "overrides": arm_overrides,
        "steps": trained[-1]["step"],
        "held_out_tau_pred": round(evals[-1]["tau_pred"], 3),
        "bench_num_steps": report["settings"]["num_steps"],
        "tau": round(report["tau"], 3),
        "speedup": round(report["speedup"], 3),
        "speedup_prompt_lookup": report["speedup_prompt_lookup"],
        "tau_prompt_lookup": report["tau_prompt_lookup"],
        "acceptance_per_position": [round(r, 3) for r in report["acceptance_per_position"]],
        "all_match": report["all_match"],
        "turns": report["turns"],
        "engine": report["engine"]["path"],
    }


def lookup(row: dict) -> str:
    """Prompt lookup's speedup in a row, or that the bench did not run it."""
    speedup = row["speedup_prompt_lookup"]
    return "not run" if speedup is None else f"{speedup:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a prepared conversations file")
    parser.add_argument("--minutes", type=float, default=10.0, help="training minutes a family")
    parser.add_argument("--questions", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument(
        "--depth", type=int, default=5, help="the chain of the families that draft step by step"
    )
    parser.add_argument(
        "--prompt-lookup", type=int, default=0, help="prompt lookup's tokens a round (0: off)"
    )
    parser.add_argument("--families", nargs="+", default=list(REGISTRY), choices=list(REGISTRY))
    parser.add_argument(
        "--arm",
        nargs="+",
        action="append",
        metavar="NAME FAMILY [KEY=VALUE]",
        help="an arm with its own training overrides (repeatable; replaces --families)",
    )
    parser.add_argument("--output", default="outputs/ab", help="the runs' folder")
    parser.add_argument("--result", default=None, help="the JSON (default OUTPUT/ab.json)")
    parser.add_argument("--title", default="Draft families at equal time (cpu)")
    parser.add_argument("overrides", nargs="*", help="training overrides for every family")
    args = parse_smoke(parser, minutes=0.05, limit=1, max_new_tokens=8)
    arms = args.arm or [[family, family] for family in args.families]
    if any(len(arm) < 2 for arm in arms):
        parser.error(f"--arm needs NAME FAMILY [KEY=VALUE ...], got {args.arm}")
    rows = [run_arm(arm, args, first=i == 0) for i, arm in enumerate(arms)]
    questions = f"{args.limit or 'all'} questions of {args.questions}"
    write_result(
        Path(args.result or Path(args.output) / "ab.json"),
        {"settings": vars(args), "rows": rows},
        title=args.title,
        summary=(
            f"Drafts ({', '.join(' '.join(arm) for arm in arms)}) trained {args.minutes:g} "
            "minutes each on "
            f"{args.data} with each family's recipe, benched on {questions} "
            f"({args.max_new_tokens} tokens, greedy, float32 target, the engine's path as "
            "engine.compile auto chose it)."
        ),
        figures={
            r["family"]: (
                f"{r['steps']} steps, held-out tau_pred {r['held_out_tau_pred']}; bench "
                f"{r['bench_num_steps']} a round: tau {r['tau']}, {r['speedup']}x the target "
                f"alone (prompt lookup {lookup(r)}), outputs identical {r['all_match']}"
            )
            for r in rows
        },
    )
    print("\n| family | steps | held-out tau_pred | depth | tau | speedup | lookup | identical |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['family']} | {r['steps']} | {r['held_out_tau_pred']} | {r['bench_num_steps']}"
            f" | {r['tau']} | {r['speedup']}x | {lookup(r)} | {r['all_match']} |"
        )


if __name__ == "__main__":
    main()
