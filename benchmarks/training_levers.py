"""Training levers, measured: the default recipe trained on one conversations file with one
change per row, each scored on the same held-out conversations (never the train split).

    python benchmarks/training_levers.py --data outputs/scaling/corpus.jsonl --steps 300

Rows (``--only`` picks some): the recipe as it is; the learning rate halved and doubled; no
cosine decay (constant after warmup); weight decay against memorising; the draft's layer
started from the target's last layer (``train.init_from_target``); the LK loss
(``train.loss=lk``); the target's distribution sharpened to temperature 0.5 and to its
greedy token alone (``train.target_temperature``); the draft's ``lm_head`` kept as the
target's rows (``train.freeze_lm_head``: cheaper steps); half the draft vocabulary (4,096 ids:
a smaller head, fewer target tokens it can propose) and both; ``answers_128`` (the training
split's answers cut at their first 128 tokens: cheaper steps, more of them in a time budget, on
the same prompts); the EAGLE 3.1 draft (``draft.variant=eagle3.1``: per-aux norms before
``fc``, the post-norm state fed back); and
``epochs`` (the same steps over half the training conversations, so each is seen twice:
repeated epochs against fresh data). Every row trains ``--steps`` steps from the same seed and
evaluates on the held-out split that ``--eval-fraction`` selects by a hash of each id (stable
across rows, the half-data row included). A row writes ``OUTPUT/<row>/result.json`` and is
skipped on a rerun. With ``--steps`` beyond reach and ``train.max_minutes=M`` among the
overrides every row trains for ``M`` minutes instead: equal time, not equal steps. Run it alone
(2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specforge.config import DEFAULT_RECIPE, load_config
from specforge.data.batching import split_train_eval
from specforge.data.chat import TokenizedSample
from specforge.io import read_jsonl, write_json_atomic, write_jsonl_atomic
from specforge.results import write_result


def rows(base) -> dict[str, list[str]]:
    """Row name -> the overrides it adds to the recipe."""
    lr = base.train.lr
    frozen_head, vocab_4096 = ["train.freeze_lm_head=true"], ["vocab.draft_vocab_size=4096"]
    return {
        "recipe": [],
        "lr_half": [f"train.lr={lr / 2}"],
        "lr_double": [f"train.lr={lr * 2}"],
        "no_decay": ["train.min_lr_ratio=1.0"],
        "weight_decay_0.1": ["train.weight_decay=0.1"],
        "init_from_target": ["train.init_from_target=true"],
        "loss_lk": ["train.loss=lk"],
        "target_t0.5": ["train.target_temperature=0.5"],
        "hard_labels": ["train.target_temperature=0"],
        "frozen_lm_head": frozen_head,
        "draft_vocab_4096": vocab_4096,
        "frozen_head_4096": [*frozen_head, *vocab_4096],
        "answers_128": [],  # the training conversations' answers cut at 128 tokens
        "eagle3.1": ["draft.variant=eagle3.1"],
        "epochs": [],  # half the training conversations, seen twice
    }


def training_ids(records: list[dict], eval_fraction: float) -> list[str]:
    """The ids of ``records`` in the training split, in the split's order (by id)."""
    probes = [TokenizedSample(id=r["id"], input_ids=[], loss_mask=[]) for r in records]
    return [s.id for s in split_train_eval(probes, eval_fraction)[0]]


def half_data(data: Path, eval_fraction: float, output: Path) -> Path:
    """The held-out conversations plus every other training one."""
    records = read_jsonl(data)
    dropped = set(training_ids(records, eval_fraction)[1::2])
    path = output / "half.jsonl"
    write_jsonl_atomic(path, [r for r in records if r["id"] not in dropped])
    return path


def cut_answers(data: Path, eval_fraction: float, tokens: int, output: Path, cfg) -> Path:
    """``data`` with every training conversation's answers cut at their first ``tokens``
    generated ids (the held-out ones whole, so that split still scores whole answers)."""
    from specforge.models.target import load_tokenizer

    tokenizer = load_tokenizer(cfg.target)
    records = read_jsonl(data)
    train_ids = set(training_ids(records, eval_fraction))
    for record in records:
        if record["id"] not in train_ids:
            continue
        meta = record["meta"]
        answers = [m for m in record["messages"] if m["role"] == "assistant"]
        for index, (message, ids) in enumerate(zip(answers, meta["token_ids"], strict=True)):
            if len(ids) > tokens:
                meta["token_ids"][index] = ids[:tokens]
                message["content"] = tokenizer.decode(ids[:tokens])
                meta["finish_reasons"][index] = "length"
    path = output / f"answers_{tokens}.jsonl"
    write_jsonl_atomic(path, records)
    return path


def run_row(args, name: str, overrides: list[str], data: Path) -> dict:
    from specforge.recipes.train import train

    folder = Path(args.output) / name
    done = folder / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    cfg = load_config(
        args.config,
        [
            f"output_dir={folder}",
            f"train.data_path={data}",
            f"train.max_steps={args.steps}",
            "train.max_minutes=null",  # the steps above, not the recipe's time cap
            f"train.eval_fraction={args.eval_fraction}",
            f"train.eval_every={args.steps}",
            f"train.save_every={args.steps}",
            "train.resume=true",
            *args.overrides,
            *overrides,
        ],
    )
    trained = train(cfg)
    result = {"row": name, "overrides": overrides, "eval": trained.eval, "train": trained.train}
    if trained.eval_data:  # with train.eval_data_path among the overrides
        result["eval_data"] = trained.eval_data
    write_json_atomic(done, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="conversations JSONL (self-distilled)")
    parser.add_argument("--config", default=DEFAULT_RECIPE)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-fraction", type=float, default=0.15)
    parser.add_argument("--only", nargs="+", help="row names to run (default: all)")
    parser.add_argument("--output", default="outputs/levers")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every row")
    args = parser.parse_args()
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config, args.overrides)
    table = rows(config)
    unknown = sorted(set(args.only or []) - set(table))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {sorted(table)}")
    results = []
    for name, overrides in table.items():
        if args.only and name not in args.only:
            continue
        data = Path(args.data)
        if name == "epochs":
            data = half_data(data, args.eval_fraction, output)
        if name == "answers_128":
            data = cut_answers(data, args.eval_fraction, 128, output, config)
        results.append(run_row(args, name, overrides, data))
        write_result(output / "training_levers.json", {"settings": vars(args), "rows": results})
    base = next((r for r in results if r["row"] == "recipe"), None)
    print("\n| row | overrides | eval acc_0 | acc_1 | tau_pred | vs recipe | eval_data tau_pred |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        tau = r["eval"]["tau_pred"]
        delta = f"{tau - base['eval']['tau_pred']:+.3f}" if base else ""
        extra = f"{r['eval_data']['tau_pred']:.3f}" if "eval_data" in r else "-"
        print(
            f"| {r['row']} | {' '.join(r['overrides']) or '-'} | {r['eval']['acc_0']:.3f} | "
            f"{r['eval']['acc_1']:.3f} | {tau:.3f} | {delta} | {extra} |"
        )
    print(f"\nwrote {output}/training_levers.json")


if __name__ == "__main__":
    main()
