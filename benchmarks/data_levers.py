"""Data levers against the gap between held-out and MT-Bench accept length, at equal tokens.

    python benchmarks/data_levers.py --questions question.jsonl --limit 20 --tokens 150000

Each row self-distils its own corpus with the default recipe plus one change (``specforge
prepare``), keeps the first ``--tokens`` assistant tokens of it (the built-in prompts first, as
prepare writes them), trains one pass over them from the same seed, and is scored twice with
the TTT metrics (``acc_k``, ``tau_pred``):

- on its own held-out split (``train.eval_fraction``): what the recipe reports, and
- on the target's own greedy answers to the benchmark's questions (``--questions``, both turns,
  ``bench.max_new_tokens`` tokens, float32: the answers the bench verifies), through
  ``train.eval_data_path``. This is the comparable column (every row scores the same
  conversations); its ``acc_0`` is the acceptance of the runtime's first draft token on those
  turns, which ``specforge bench`` measures in minutes instead of seconds.

No row trains on the benchmark: its questions only score. Rows (``--only`` picks some):
``recipe``; ``topics`` (prompts steered across MT-Bench's categories by their names, never
its questions: ``synthesize.topics``); ``follow_ups`` (every synthesized conversation gets a
second user turn the target writes over its answer: ``synthesize.follow_ups``);
``two_answers`` (two answers sampled at temperature 0.7 per prompt:
``regenerate.num_samples``; a sixth of the synthesized prompts); ``answers_128`` (answers cut at
the bench's length, so twice the prompts at equal tokens); ``synthesized_only`` (no built-in
prompts; as many prompts as the recipe's). A row writes
``OUTPUT/<row>/result.json`` and is skipped on a rerun. Run it alone (2 CPU cores).

One pass at the recipe's one conversation a step gives a corpus of long conversations fewer
optimizer steps than one of short answers at equal tokens. ``--batch-tokens N`` trains the
rows' same corpora (prepared once) on micro-batches of about ``N`` tokens instead
(``train.batch_tokens``): about equal tokens a step and so about equal steps, which separates a
data lever from its number of updates (``OUTPUT/<row>/result_tokens<N>.json``). ``--passes P``
trains ``P`` passes over the same corpus, scored after each (``result_passes<P>.json``): what
repeating data buys against new data.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specforge.config import DEFAULT_RECIPE, load_config
from specforge.data.batching import StepBatches, split_train_eval
from specforge.data.prompts import CATEGORIES
from specforge.io import read_jsonl, write_json_atomic, write_jsonl_atomic
from specforge.results import write_result


def rows(synthesize: int) -> dict[str, list[str]]:
    """Row name -> the overrides it adds to the recipe's prepare and train."""
    count = f"synthesize.count={synthesize}"
    return {
        "recipe": [count],
        "topics": [count, f"synthesize.topics={json.dumps(list(CATEGORIES))}"],
        "follow_ups": [count, "synthesize.follow_ups=1"],
        # two answers a prompt (sampled: greedy answers would be one answer); the built-in
        # prompts' answers hold most of the tokens
        "two_answers": [
            f"synthesize.count={synthesize // 6}",
            "regenerate.num_samples=2",
            "regenerate.temperature=0.7",
        ],
        "answers_128": [f"synthesize.count={2 * synthesize}", "regenerate.max_new_tokens=128"],
        # as many prompts as the recipe's built-in + synthesized ones
        "synthesized_only": [f"synthesize.count={synthesize + 300}", "data.inputs=[]"],
    }


def probe_conversations(args, base, output: Path) -> Path:
    """The target's greedy answers to the benchmark's questions (prepared once; prepare reads
    MT-Bench's ``turns`` records as they are)."""
    from specforge.recipes.prepare import prepare

    folder = output / "probe"
    path = folder / "conversations.jsonl"
    if path.exists():
        return path
    prepare(
        load_config(
            args.config,
            [
                *args.overrides,
                f"output_dir={folder}",
                f"data.inputs={json.dumps([args.questions])}",
                "data.format=questions",
                f"data.limit={args.limit}",
                "synthesize.count=0",
                "regenerate.enabled=true",
                f"regenerate.max_new_tokens={base.bench.max_new_tokens}",
                f"target.dtype={base.bench.dtype}",
                "prepare.vocab_output=null",
            ],
        )
    )
    return path


def assistant_tokens(record: dict) -> int:
    return sum(len(ids) for ids in record["meta"]["token_ids"])


def first_tokens(records: list[dict], budget: int) -> list[dict]:
    """The leading records whose assistant tokens fit in ``budget``."""
    kept, total = [], 0
    for record in records:
        total += assistant_tokens(record)
        if total > budget:
            break
        kept.append(record)
    return kept


def one_pass_steps(cfg, data: Path) -> int:
    """Optimizer steps of one pass over ``data``'s training split, batched as ``cfg`` says."""
    from specforge.data.chat import set_chat_template
    from specforge.models.target import load_tokenizer
    from specforge.trainer.sources import load_training_samples

    tokenizer = load_tokenizer(cfg.target)
    set_chat_template(tokenizer, cfg.data.chat_template)
    samples = load_training_samples(cfg, tokenizer, data)
    train_samples, _ = split_train_eval(samples, cfg.train.eval_fraction)
    return StepBatches.from_config(train_samples, cfg.train).steps_per_epoch


def run_suffix(args) -> str:
    """What a row's files add to their names when it is not trained one pass at batch 1."""
    suffix = f"_tokens{args.batch_tokens}" if args.batch_tokens else ""
    return suffix + (f"_passes{args.passes}" if args.passes > 1 else "")


def row_label(name: str, args) -> str:
    """A row's name in the table, with how it was trained when not one pass at batch 1."""
    how = [f"{args.batch_tokens} tokens a step"] if args.batch_tokens else []
    how += [f"{args.passes} passes"] if args.passes > 1 else []
    return f"{name} ({', '.join(how)})" if how else name


def run_row(args, base, name: str, overrides: list[str], probe: Path) -> dict:
    from specforge.recipes.prepare import prepare
    from specforge.recipes.train import train

    folder = Path(args.output) / name
    suffix = run_suffix(args)
    done = folder / f"result{suffix}.json"
    if done.exists():
        return json.loads(done.read_text())
    # 1. the row's corpus, cut at the token budget
    clock = time.perf_counter()
    prepared = folder / "conversations.jsonl"
    if not prepared.exists():
        prepare(
            load_config(
                args.config,
                [*args.overrides, *overrides, f"output_dir={folder}", "prepare.vocab_output=null"],
            )
        )
    prepare_s = time.perf_counter() - clock
    records = read_jsonl(prepared)
    kept = first_tokens(records, args.tokens)
    data = folder / "train.jsonl"
    write_jsonl_atomic(data, kept)
    # 2. --passes over it (one by default), scored on its held-out split and on the
    # benchmark's answers after each
    batching = [f"train.batch_tokens={args.batch_tokens}"] if args.batch_tokens else []
    one_pass = one_pass_steps(load_config(args.config, [*args.overrides, *batching]), data)
    steps = args.passes * one_pass
    clock = time.perf_counter()
    trained = train(
        load_config(
            args.config,
            [
                *args.overrides,
                *batching,
                f"output_dir={folder / ('train' + suffix)}",
                f"train.data_path={data}",
                f"train.eval_data_path={probe}",
                f"train.max_steps={steps}",
                "train.max_minutes=null",  # the passes, not the recipe's time cap
                f"train.eval_every={one_pass}",
                f"train.save_every={one_pass}",
                "train.resume=true",
            ],
        )
    )
    result = {
        "row": row_label(name, args),
        "overrides": overrides,
        "conversations": len(kept),
        "prepared_conversations": len(records),
        "assistant_tokens": sum(assistant_tokens(r) for r in kept),
        "steps": steps,
        "prepare_s": round(prepare_s, 1),
        "train_s": round(time.perf_counter() - clock, 1),
        "held_out": trained.eval,
        "benchmark": trained.eval_data,
    }
    if args.passes > 1:  # the scores after each pass
        logged = read_jsonl(folder / f"train{suffix}" / "metrics.jsonl")
        result["per_pass"] = [
            {"step": r["step"], "split": r["split"], "tau_pred": r["tau_pred"], "acc_0": r["acc_0"]}
            for r in logged
            if r["split"] in ("eval", "eval_data") and r["step"] > 0
        ]
    write_json_atomic(done, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", required=True, help="benchmark questions (MT-Bench)")
    parser.add_argument("--limit", type=int, default=20, help="questions scored")
    parser.add_argument("--tokens", type=int, default=150_000, help="assistant tokens a row")
    parser.add_argument("--synthesize", type=int, default=600, help="prompts a row writes")
    parser.add_argument(
        "--batch-tokens", type=int, help="train on micro-batches of this many tokens (not 1 a step)"
    )
    parser.add_argument("--passes", type=int, default=1, help="passes over each row's corpus")
    parser.add_argument("--config", default=DEFAULT_RECIPE)
    parser.add_argument("--only", nargs="+", help="row names to run (default: all)")
    parser.add_argument("--output", default="outputs/data_levers")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every row")
    args = parser.parse_args()
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    table = rows(args.synthesize)
    unknown = sorted(set(args.only or []) - set(table))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {sorted(table)}")
    base = load_config(args.config, args.overrides)
    probe = probe_conversations(args, base, output)
    results = []
    written = output / f"data_levers{run_suffix(args)}.json"
    for name, overrides in table.items():
        if args.only and name not in args.only:
            continue
        results.append(run_row(args, base, name, overrides, probe))
        write_result(written, {"settings": vars(args), "rows": results})
    table = figures(results)
    page = dict(
        title="Data levers against the held-out/MT-Bench gap, at equal tokens (CPU)",
        summary=(
            f"The default recipe's corpus with one change a row, cut at {args.tokens:,} "
            "assistant tokens, one pass from one seed; TTT metrics (tau_pred over the recipe's "
            f"{base.train.ttt_length} steps) on the row's "
            "own held-out split and on the target's greedy answers to MT-Bench's first "
            f"{args.limit} questions (both turns). Each row's tokens and prompts are its own; "
            + (
                f"micro-batches of about {args.batch_tokens} tokens."
                if args.batch_tokens
                else "one conversation a step."
            )
        ),
        figures=table,
    )
    write_result(written, {"settings": vars(args), "rows": results, **page})
    print("\n| " + " | ".join(table["columns"]) + " |")
    print("|" + "---|" * len(table["columns"]))
    for row in table["rows"]:
        print("| " + " | ".join(str(v) for v in row) + " |")
    print(f"\nwrote {written}")


def figures(results: list[dict]) -> dict:
    """The results page's table: one row per lever."""
    columns = ["row", "assistant tokens", "conversations", "steps", "held-out acc_0"]
    columns += ["held-out tau_pred"]
    columns += ["MT-Bench acc_0", "MT-Bench tau_pred", "gap", "train min"]
    rows = []
    for r in results:
        held, bench = r["held_out"], r["benchmark"]
        rows.append(
            [
                r["row"],
                r["assistant_tokens"],
                r["conversations"],
                r["steps"],
                round(held["acc_0"], 3),
                round(held["tau_pred"], 3),
                round(bench["acc_0"], 3),
                round(bench["tau_pred"], 3),
                round(held["tau_pred"] - bench["tau_pred"], 3),
                round(r["train_s"] / 60, 1),
            ]
        )
    return {"columns": columns, "rows": rows}


if __name__ == "__main__":
    main()
