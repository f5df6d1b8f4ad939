"""Accept length against context length: MT-Bench questions asked after notes that fill the
prompt to a given number of tokens, up to the target's maximum context, through the built-in
bench (greedy, a fixed chain), read from its ``accept_length_by_context``.

    python benchmarks/context_length.py --draft outputs/quickstart/export \\
        --questions question.jsonl --notes gsm8k/train.jsonl \\
        --contexts 0 1024 2048 4096 7900 --per-context 5 --output outputs/context \\
        --result docs/results/context_length_cpu.json

The notes are the ``question`` fields of ``--notes`` (a JSONL file: GSM8K's train split here),
joined in order from a different offset for each prompt, cut at a token boundary so that the
prompt (notes, then "Question:" and the MT-Bench question, in the target's chat template) holds
about the context asked for; ``0`` asks the question alone. Users report acceptance collapsing
past the lengths a draft was trained on; the quickstart's draft trains on conversations of at
most ``data.max_length`` tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from specforge.config import TargetConfig
from specforge.data.chat import prompt_ids
from specforge.models.target import load_tokenizer
from specforge.results import figures_markdown, write_result

RECIPE = "configs/smollm2-135m-eagle3.yaml"


def read_jsonl(path: str, field: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line)[field] for line in f if line.strip()]


def long_prompt(tokenizer, question: str, notes: list[str], start: int, context: int) -> str:
    """``question`` after notes from ``notes[start:]``, their tokens cut so that the rendered
    prompt holds about ``context`` tokens (the question alone for 0)."""
    if context == 0:
        return question
    tail = f"\n\nQuestion: {question}"
    asked = len(prompt_ids(tokenizer, [{"role": "user", "content": "Notes:\n" + tail}]))
    text, index = [], start
    while len(tokenizer("\n".join(text))["input_ids"]) < context - asked:
        text.append(notes[index % len(notes)])
        index += 1
    ids = tokenizer("\n".join(text))["input_ids"][: context - asked]
    return "Notes:\n" + tokenizer.decode(ids) + tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--questions", required=True)
    parser.add_argument("--notes", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[0, 1024, 2048, 4096, 7900])
    parser.add_argument("--per-context", type=int, default=5)
    parser.add_argument("--num-steps", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", default="outputs/context")
    parser.add_argument("--result", default=None)
    args = parser.parse_args()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(TargetConfig())
    questions = read_jsonl(args.questions, "turns")
    notes = read_jsonl(args.notes, "question")
    asked = out / "long_questions.jsonl"
    with asked.open("w") as f:
        for c, context in enumerate(args.contexts):
            for i in range(args.per_context):
                k = c * args.per_context + i  # a different question and notes for each prompt
                question = questions[k % len(questions)][0]
                text = long_prompt(tokenizer, question, notes, 97 * k, context)
                record = {"question_id": f"{context}-{i}", "category": str(context)}
                f.write(json.dumps({**record, "turns": [text]}) + "\n")
    bench = out / "bench"
    if not (bench / "bench.json").is_file():
        command = [
            sys.executable,
            *("-m", "specforge.cli", "bench", "--config", RECIPE, "--draft", args.draft),
            *("--questions", str(asked), "--num-steps", str(args.num_steps)),
            *("--max-new-tokens", str(args.max_new_tokens), "--prompt-lookup-num-tokens", "0"),
            *("--output", str(bench)),
        ]
        print("$", " ".join(command[2:]), flush=True)
        subprocess.run(command, check=True)
    result = json.loads((bench / "bench.json").read_text())
    by_context = result["accept_length_by_context"]
    by_prompt = {}
    for turn in result["turn_details"]:
        empty = {"prompt_tokens": [], "emitted": 0, "rounds": 0}
        row = by_prompt.setdefault(turn["category"], empty)
        row["prompt_tokens"].append(turn["prompt_tokens"])
        row["emitted"] += turn["emitted"]
        row["rounds"] += turn["verifications"]
    columns = ["context asked", "prompt tokens", "rounds", "tau"]
    table = [
        [
            int(name),
            f"{min(r['prompt_tokens'])}-{max(r['prompt_tokens'])}",
            r["rounds"],
            round(r["emitted"] / max(r["rounds"], 1), 3),
        ]
        for name, r in sorted(by_prompt.items(), key=lambda kv: int(kv[0]))
    ]
    record = write_result(
        Path(args.result or out / "context_length.json"),
        {
            "settings": vars(args),
            "by_prompt": table,
            "accept_length_by_context": by_context,
            "speedup": result["speedup"],
            "all_match": result["all_match"],
        },
        title="Accept length against context length (cpu)",
        summary=(
            f"{args.per_context} MT-Bench questions asked after notes filling the prompt to each "
            f"context ({', '.join(map(str, args.contexts))} tokens), {args.max_new_tokens} new "
            f"tokens, greedy chain {args.num_steps}, draft {args.draft}; every output identical "
            f"to the target's: {result['all_match']}."
        ),
        figures={"columns": columns, "rows": table},
    )
    print(figures_markdown(record["figures"]))


if __name__ == "__main__":
    main()
