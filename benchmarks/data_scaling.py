"""Accept length vs training data: the default draft trained on growing self-distilled sets, each
measured on MT-Bench (chain, greedy) with its held-out evaluation beside it. JSON, a table, and
a PNG of tau vs training tokens.

    nohup python benchmarks/data_scaling.py --questions question.jsonl \\
        --gsm8k gsm8k/train.jsonl --sizes 75000 300000 1000000 --output outputs/scaling &

One corpus grows across the sizes (self-distillation resumes by id): the built-in prompts (train
split), then GSM8K-train questions and prompts the target writes itself (``--synthesize``) in
equal numbers, answered by SmolLM2 until the assistant tokens reach each size. Each size then
trains the default recipe for ``--epochs`` passes over its data (at least ``--min-steps``),
exports, and benches
``--questions`` (the first half of MT-Bench by default: 40 questions, both turns). Every stage
writes its result under ``OUTPUT/size_N`` and is skipped on a rerun, so a killed run resumes.
Run it alone: a second CPU-heavy process slows PyTorch many times over (``--rebench SIZE``
benches a finished size's draft again, alone, when something shared the CPU during its bench).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from common import parse_smoke

from specforge.config import DEFAULT_RECIPE, load_config
from specforge.io import read_jsonl, write_json_atomic
from specforge.results import write_result


def corpus_overrides(args, output: Path, gsm8k_rows: int, synthesized: int) -> list[str]:
    inputs = ["builtin"] + ([str(output / "gsm8k.jsonl")] if gsm8k_rows else [])
    return [
        f"output_dir={output}",
        f"prepare.output={output / 'corpus.jsonl'}",
        "prepare.vocab_output=null",
        f"data.inputs={json.dumps(inputs)}",
        f"synthesize.count={synthesized}",
        f"regenerate.batch_size={args.batch_size}",
        *args.overrides,
    ]


def assistant_tokens(output: Path) -> int:
    stats = output / "corpus.stats.json"
    return json.loads(stats.read_text())["tokens"]["assistant_tokens"] if stats.exists() else 0


def frozen_assistant_tokens(data: Path) -> int:
    """The assistant (loss) tokens of one size's frozen conversations, tokenized as prepare
    and training tokenize them."""
    from specforge.data.chat import set_chat_template, tokenize_conversations
    from specforge.data.conversations import Conversation
    from specforge.models.target import load_tokenizer

    cfg = load_config(DEFAULT_RECIPE, [])
    tokenizer = load_tokenizer(cfg.target)
    set_chat_template(tokenizer, cfg.data.chat_template)
    conversations = [Conversation.from_record(r) for r in read_jsonl(data)]
    _, stats = tokenize_conversations(
        tokenizer,
        conversations,
        max_length=cfg.data.max_length,
        system_prompt=cfg.data.system_prompt,
    )
    return stats.assistant_tokens


def grow_corpus(args, output: Path, size: int) -> dict:
    """Self-distill more conversations until the corpus holds ``size`` assistant tokens: the
    built-in prompts, then the first GSM8K rows (copied to ``OUTPUT/gsm8k.jsonl``, so ids stay
    stable as it grows), then synthesized prompts."""
    from specforge.recipes.prepare import prepare

    gsm8k = Path(args.gsm8k).read_text().splitlines(keepends=True) if args.gsm8k else []
    copied = output / "gsm8k.jsonl"
    gsm8k_rows = len(copied.read_text().splitlines()) if copied.exists() else 0
    synthesized = len(read_jsonl(output / "corpus.prompts.jsonl"))
    # the growth step under way, recorded before it runs: a rerun after an interruption
    # finishes that step instead of planning another on top of it
    plan_file = output / "grow.json"
    first = not (output / "corpus.stats.json").exists()
    while first or assistant_tokens(output) < size:
        have, first = assistant_tokens(output), False
        plan = json.loads(plan_file.read_text()) if plan_file.exists() else {}
        if plan.get("have") == have and plan.get("size") == size:
            gsm8k_rows, synthesized = plan["gsm8k_rows"], plan["synthesized"]
        else:
            conversations = max(len(read_jsonl(output / "corpus.jsonl")), 1)
            more = int((size - have) / max(have / conversations, 100) * 1.1) + 1 if have else 0
            # half the new conversations from GSM8K (while it lasts), the rest synthesized
            from_gsm8k = min(len(gsm8k) - gsm8k_rows, (more + 1) // 2)
            gsm8k_rows += from_gsm8k
            synthesized += more - from_gsm8k
            plan = {"size": size, "have": have, "gsm8k_rows": gsm8k_rows}
            write_json_atomic(plan_file, {**plan, "synthesized": synthesized})
        if gsm8k_rows:
            copied.write_text("".join(gsm8k[:gsm8k_rows]))
        prepare(
            load_config(DEFAULT_RECIPE, corpus_overrides(args, output, gsm8k_rows, synthesized))
        )
    return json.loads((output / "corpus.stats.json").read_text())


def size_config(args, run: Path, steps: int):
    """The recipe of one size: train on its frozen conversations, bench MT-Bench chain-N."""
    return load_config(
        DEFAULT_RECIPE,
        [
            f"output_dir={run}",
            f"train.data_path={run / 'conversations.jsonl'}",
            f"train.max_steps={steps}",
            "train.max_minutes=null",  # the steps above, not the recipe's time cap
            "train.resume=true",
            f"bench.questions={args.questions}",
            f"bench.limit={args.questions_limit}",
            f"bench.num_steps={args.num_steps}",
            f"bench.max_new_tokens={args.max_new_tokens}",
            "bench.prompt_lookup_num_tokens=0",
            *args.overrides,
        ],
    )


def bench_fields(cfg) -> dict:
    """Bench the exported draft of ``cfg``: the result's MT-Bench fields."""
    from specforge.recipes.bench import bench

    measured = bench(cfg)
    return {
        "tau": measured["tau"],
        "speedup": measured["speedup"],
        "all_match": measured["all_match"],
        "acceptance_per_position": measured["acceptance_per_position"],
        "bench_turns": measured["turns"],
    }


def train_and_bench(args, output: Path, size: int, corpus: Path) -> dict:
    from specforge.recipes.export import export
    from specforge.recipes.train import train

    run = output / f"size_{size}"
    result_path = run / "result.json"
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if "assistant_tokens" not in result:  # a result written before the count was kept
            result["assistant_tokens"] = frozen_assistant_tokens(run / "conversations.jsonl")
            write_json_atomic(result_path, result)
        return result
    run.mkdir(parents=True, exist_ok=True)
    data = run / "conversations.jsonl"
    if not data.exists():
        # this size's conversations, frozen: a rerun after an interruption trains on the same
        # data even if the corpus has grown since
        shutil.copyfile(corpus, data)
    conversations = len(read_jsonl(data))
    steps = max(args.min_steps, args.epochs * conversations)
    cfg = size_config(args, run, steps)
    start = time.perf_counter()
    trained = train(cfg)
    train_s = time.perf_counter() - start
    export(cfg)
    result = {
        "size": size,
        "assistant_tokens": frozen_assistant_tokens(data),
        "conversations": conversations,
        "train_steps": steps,
        "train_seconds": round(train_s, 1),
        "eval": trained.eval,
        **bench_fields(cfg),
    }
    write_json_atomic(result_path, result)
    return result


def rebench(args, output: Path, size: int) -> None:
    """Bench a finished size's export again (its timings, when another process shared the CPU
    during the first bench), replacing the result's MT-Bench fields and keeping the rest."""
    run = output / f"size_{size}"
    result_path = run / "result.json"
    if not result_path.exists():
        raise SystemExit(f"--rebench {size}: {result_path} does not exist (run that size first)")
    result = json.loads(result_path.read_text())
    cfg = size_config(args, run, result["train_steps"])
    write_json_atomic(result_path, {**result, **bench_fields(cfg), "rebenched": True})


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 4))
    tokens = [r["assistant_tokens"] for r in rows]
    axis.plot(tokens, [r["tau"] for r in rows], "o-", label="MT-Bench tau (measured)")
    axis.plot(tokens, [r["eval"]["tau_pred"] for r in rows], "s--", label="held-out tau_pred")
    axis.set(xscale="log", xlabel="assistant tokens trained on", ylabel="accept length")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[75_000, 300_000, 1_000_000])
    parser.add_argument("--gsm8k", help="GSM8K train.jsonl: the second prompt source")
    parser.add_argument("--questions", default="auto", help="MT-Bench question.jsonl")
    parser.add_argument("--questions-limit", type=int, default=40, help="the fixed first half")
    parser.add_argument("--num-steps", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=1, help="steps = epochs x conversations")
    parser.add_argument("--min-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64, help="regeneration rows in flight")
    parser.add_argument("--output", default="outputs/scaling")
    parser.add_argument(
        "--rebench", type=int, nargs="+", default=[], help="finished sizes to bench again first"
    )
    parser.add_argument("overrides", nargs="*", help="dotted recipe overrides for every stage")
    args = parse_smoke(
        parser, sizes=[2000], questions_limit=1, max_new_tokens=8, min_steps=2, batch_size=4
    )
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    for size in args.rebench:
        rebench(args, output, size)
    rows = []
    for size in sorted(args.sizes):
        grow_corpus(args, output, size)
        rows.append(train_and_bench(args, output, size, output / "corpus.jsonl"))
        write_result(output / "data_scaling.json", {"settings": vars(args), "rows": rows})
    plot(rows, output / "data_scaling.png")
    print("\n| assistant tokens | conversations | steps | eval acc_0 | tau_pred | MT-Bench tau | "
          "speedup | identical |\n|---:|---:|---:|---:|---:|---:|---:|---|")  # fmt: skip
    for r in rows:
        print(
            f"| {r['assistant_tokens']:,} | {r['conversations']} | {r['train_steps']} | "
            f"{r['eval']['acc_0']:.3f} | {r['eval']['tau_pred']:.2f} | {r['tau']:.2f} | "
            f"{r['speedup']:.2f}x | {r['all_match']} |"
        )
    print(f"\nwrote {output}/data_scaling.json and data_scaling.png")


if __name__ == "__main__":
    main()
