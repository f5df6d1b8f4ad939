"""Fine-tuning a published draft on one's own domain, at equal time: a trained run's export
(a quickstart's) continued with ``train.from_pretrained`` on the target's own answers to
GSM8K-train questions, against a new draft trained as long on the same answers, against the
export as it is; accept length of chain ``--depth`` on GSM8K questions the training never saw
and on MT-Bench.

    python benchmarks/finetune_pretrained.py --start outputs/quickstart \\
        --gsm8k gsm8k/train.jsonl --mt-bench mt_bench/question.jsonl --minutes 10 \\
        --output outputs/finetune --result docs/results/finetune_pretrained_cpu.json

GSM8K's test split is on the HF hub; offline, the last ``--test-questions`` lines of the file
given (its training split) are the held-out questions and the first ``--train-questions`` are
the training prompts, which the recipe's target answers (``specforge prepare --regenerate``,
the recipe's dtype, as the quickstart self-distils). Both arms run the start's recipe
(``train.max_minutes`` each, the schedule spanning it): ``finetune`` from ``START/export``
keeping its token map, ``scratch`` a new draft whose map comes from the answers.

Accept length is the replay's (:func:`common.replayed_taus`): the rounds the runtime's greedy
chain runs over the float32 target's greedy answers (``--max-new-tokens`` a turn), which equal
the runtime's own (tested), read without timing anything. Every stage is skipped on a rerun
when its output is there. Run it alone (2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import answers, parse_smoke, replayed_taus, specforge, start_recipe

from specforge.io import iter_jsonl
from specforge.results import figures_markdown, write_result

ARMS = ("finetune", "scratch")


def split_questions(gsm8k: Path, output: Path, train: int, test: int) -> tuple[Path, Path]:
    """The first ``train`` records of ``gsm8k`` and its last ``test`` ones, as two files."""
    records = [record for _, record in iter_jsonl(gsm8k)]
    if train + test > len(records):
        raise SystemExit(f"{gsm8k}: {len(records)} records, fewer than {train} + {test}")
    files = output / "gsm8k_train.jsonl", output / "gsm8k_test.jsonl"
    for path, part in zip(files, (records[:train], records[-test:]), strict=True):
        if not path.is_file():
            path.write_text("".join(json.dumps(record) + "\n" for record in part))
    return files


def distilled(recipe: Path, prompts: Path, output: Path) -> Path:
    """The recipe's target's answers to ``prompts`` (its own dtype and answer length)."""
    out = output / "gsm8k_answers.jsonl"
    if not out.is_file():
        specforge(
            "prepare",
            "--config",
            str(recipe),
            f"output_dir={output / 'prepare_train'}",
            "synthesize.count=0",  # the questions given, no prompts of its own
            "prepare.vocab_output=null",  # each arm's map is its own
            "--data",
            str(prompts),
            "--regenerate",
            "--output",
            str(out),
        )
    return out


def train_arm(arm: str, recipe: Path, data: Path, args) -> Path:
    """Train one arm for ``--minutes`` on ``data``; returns its folder (resumed on a rerun)."""
    out = Path(args.output) / arm
    pretrained = [f"train.from_pretrained={Path(args.start) / 'export'}"] * (arm == "finetune")
    specforge(
        "train",
        "--config",
        str(recipe),
        f"output_dir={out}",
        f"train.data_path={data}",
        "train.resume=true",
        "train.max_steps=1000000",
        f"train.max_minutes={args.minutes}",
        *pretrained,
    )
    return out


def arm_row(arm: str, run: Path, scores: dict) -> dict:
    """One arm's steps, its held-out accept length replayed on the answers' held-out share at
    step 0 and at the end, its held-out loss at step 0, and accept length on each set."""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    held_out = [m for m in metrics if m.get("split") == "eval"]
    return {
        "arm": arm,
        "steps": max(m["step"] for m in metrics),
        "held_out_loss_step_0": round(held_out[0]["loss"], 3),
        "held_out_tau_replay_step_0": round(held_out[0]["tau_replay"], 3),
        "held_out_tau_replay": round(held_out[-1]["tau_replay"], 3),
        **{name: by_arm[arm] for name, by_arm in scores.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", required=True, help="a trained run's output_dir, exported")
    parser.add_argument("--gsm8k", required=True, help="GSM8K records (its training split)")
    parser.add_argument("--mt-bench", required=True, help="MT-Bench's question.jsonl")
    parser.add_argument("--train-questions", type=int, default=600)
    parser.add_argument("--test-questions", type=int, default=40)
    parser.add_argument("--minutes", type=float, default=10.0, help="training minutes an arm")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="a scored answer's turn")
    parser.add_argument("--depth", type=int, default=5, help="the chain depth scored")
    parser.add_argument("--output", default="outputs/finetune", help="the runs' folder")
    parser.add_argument("--result", default=None, help="the JSON (default OUTPUT/finetune.json)")
    args = parse_smoke(parser, train_questions=2, test_questions=1, minutes=0.05, max_new_tokens=8)
    output = Path(args.output)
    recipe, state = start_recipe(Path(args.start), output)
    if not (Path(args.start) / "export" / "config.json").is_file():
        raise SystemExit(f"{args.start}/export: no export to fine-tune (run specforge export)")
    prompts, test = split_questions(
        Path(args.gsm8k), output, args.train_questions, args.test_questions
    )
    data = distilled(recipe, prompts, output)
    runs = {"none": Path(args.start)} | {arm: train_arm(arm, recipe, data, args) for arm in ARMS}
    target = state["config"]["target"]["name_or_path"]
    sets = {"gsm8k": str(test), "mt_bench": args.mt_bench}
    scores = {
        name: replayed_taus(
            runs, recipe, answers(output, name, path, target, args.max_new_tokens), args.depth
        )
        for name, path in sets.items()
    }
    rows = [{"arm": "none", "steps": 0, **{n: s["none"] for n, s in scores.items()}}]
    rows += [arm_row(arm, runs[arm], scores) for arm in ARMS]
    report(args, rows, list(sets), data)


def held_out_cell(row: dict) -> str:
    """An arm's held-out replayed accept length at step 0 and at the end (``-``: no training)."""
    if "held_out_tau_replay" not in row:
        return "-"
    return f"{row['held_out_tau_replay_step_0']} -> {row['held_out_tau_replay']}"


def report(args, rows: list[dict], names: list[str], data: Path) -> None:
    """Write the result and print its table."""
    conversations = sum(1 for _ in iter_jsonl(data))
    table = {
        "columns": [
            "arm",
            "steps",
            "held-out loss, step 0",
            "held-out tau_replay, step 0 -> end",
            *(f"{n} chain-{args.depth} tau (replay)" for n in names),
        ],
        "rows": [
            [
                r["arm"],
                r["steps"],
                r.get("held_out_loss_step_0", "-"),
                held_out_cell(r),
                *(r[n]["tau"] for n in names),
            ]
            for r in rows
        ],
    }
    record = write_result(
        Path(args.result or Path(args.output) / "finetune.json"),
        {"settings": vars(args), "training_conversations": conversations, "rows": rows},
        title="Fine-tuning a published draft (cpu)",
        summary=(
            f"{args.start}'s export as it is (none), continued {args.minutes:g} minutes with "
            f"train.from_pretrained (finetune), and a new draft trained {args.minutes:g} "
            f"minutes (scratch), both on the target's own answers to the first "
            f"{args.train_questions} GSM8K-train questions ({conversations} conversations). "
            f"Accept length of chain {args.depth} over the float32 target's greedy answers "
            f"({args.max_new_tokens} tokens a turn) to the last {args.test_questions} "
            "GSM8K-train questions (never trained on) and to MT-Bench, by replaying the "
            "runtime's rounds."
        ),
        figures=table,
    )
    print(figures_markdown(record["figures"]))


if __name__ == "__main__":
    main()
