"""Round costs before and after: ``specforge bench`` of an earlier commit (checked out in a git
worktree) and of this checkout, on the same draft, questions and settings (a short chain and a
tree), one after the other; prints each run's ``cost`` block side by side and writes JSON.

    python benchmarks/round_overhead.py --before aa758d7 --draft outputs/quickstart/export \\
        --questions question.jsonl --limit 5

"Outside draft and verify" is everything a round spends besides drafting and the target's
verification forward: the draft's extension over the accepted tokens, the prefills spread over
the rounds, and the rest (an earlier commit reports all of it as one ``other_ms_per_round``).
Where the commit reports it, the target's own prefill (which the target alone pays too) is
shown apart, and "added" is the rest of "outside": what speculation itself adds.
Both checkouts run the same bench arguments (no prompt-lookup baseline; the target alone through
the same engine), so both speedup columns mean the same; ``--setting`` picks the settings
(``auto`` is ``num_steps: auto`` with the bench's defaults). Run it alone: a second CPU-heavy
process slows PyTorch many times over.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import parse_smoke

from specforge.results import write_result

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "chain-2": ["--num-steps", "2"],
    "tree 4x5, 16 tokens": ["--num-steps", "5", "--topk", "4", "--num-draft-tokens", "16"],
    "auto": ["--num-steps", "auto"],
}
BENCH = ["--prompt-lookup-num-tokens", "0", "--dtype", "float32"]
"""What both checkouts run with beside the setting: greedy float32 (outputs comparable with the
target's), no prompt-lookup baseline."""
OUTSIDE = ("extend_ms_per_round", "prefill_ms_per_round", "other_ms_per_round")


def bench(code: Path, out: Path, args, extra: list[str]) -> dict:
    """``specforge bench`` with the package at ``code``, skipped where ``out`` holds its
    ``bench.json`` (a rerun resumes); returns that ``bench.json``."""
    if (out / "bench.json").is_file():
        return json.loads((out / "bench.json").read_text())
    command = [
        sys.executable, "-m", "specforge.cli", "bench",
        "--target", args.target, "--draft", str(Path(args.draft).resolve()),
        "--questions", str(Path(args.questions).resolve()), "--limit", str(args.limit),
        "--max-new-tokens", str(args.max_new_tokens), "--output", str(out), *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(code)}
    subprocess.run(command, cwd=code, env=env, check=True)
    return json.loads((out / "bench.json").read_text())


def page(summary: list[dict], args) -> dict:
    """The results page's title, summary and table of a run."""
    columns = ["setting", "commit", "tau", "tokens/s", "target alone tokens/s", "speedup"]
    columns += ["draft ms", "verify ms", "outside ms", "identical"]
    rows = [
        [r["setting"], r["commit"], round(r["tau"], 3), round(r["tokens_per_s"]["eagle3"], 2)]
        + [round(r["tokens_per_s"]["target"], 2), round(r["speedup"], 3), r["draft_ms"]]
        + [r["verify_ms"], r["outside_ms"], r["all_match"]]
        for r in summary
    ]
    return {
        "title": f"The runtime before and after, {', '.join(args.setting)} (cpu)",
        "summary": (
            f"specforge bench of {args.draft} at {args.before} (a git worktree) and at this "
            f"checkout, one after the other, on {args.limit} questions of {args.questions} "
            f"({args.max_new_tokens} tokens a turn, greedy, float32, no prompt-lookup "
            "baseline), each against the target alone through the same engine in the same run."
        ),
        "figures": {"columns": columns, "rows": rows},
    }


def outside_ms(cost: dict) -> float:
    """Per-round time outside drafting and verification, whatever the commit calls its parts."""
    return sum(cost.get(k, 0.0) for k in OUTSIDE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the earlier commit")
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="outputs/quickstart/export")
    parser.add_argument("--questions", required=True)
    parser.add_argument("--limit", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--output", default="outputs/bench/round_overhead")
    parser.add_argument(
        "--setting",
        nargs="+",
        choices=sorted(SETTINGS),
        default=["chain-2", "tree 4x5, 16 tokens"],
        help="the settings to run (default: a short chain and a tree)",
    )
    parser.add_argument("--result", help="also write the results entry here (docs/results/...)")
    args = parse_smoke(parser, limit=1, max_new_tokens=8)
    output = Path(args.output).resolve()  # each bench runs in its own checkout
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        before = Path(scratch) / "before"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(before), args.before], cwd=REPO, check=True
        )
        try:
            for name in args.setting:
                slug = name.split()[0]
                extra = [*SETTINGS[name], *BENCH]
                old = bench(before, output / f"before-{slug}", args, extra)
                new = bench(REPO, output / f"after-{slug}", args, extra)
                rows.append({"setting": name, "before": old, "after": new})
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO)
    summary = []
    for row in rows:
        for when in ("before", "after"):
            result = row[when]
            cost = result["cost"]
            summary.append(
                {
                    "setting": row["setting"],
                    "commit": args.before if when == "before" else "this checkout",
                    "tau": result["tau"],
                    "speedup": result["speedup"],
                    "tokens_per_s": result["tokens_per_s"],
                    "all_match": result["all_match"],
                    "draft_ms": cost["draft_ms_per_round"],
                    "verify_ms": cost["verify_ms_per_round"],
                    "outside_ms": round(outside_ms(cost), 2),
                    "target_prefill_ms": cost.get("target_prefill_ms_per_round"),
                    "added_ms": cost.get("added_ms_per_round"),
                    "cost": cost,
                }
            )
    write_result(output / "round_overhead.json", {"settings": vars(args), "rows": summary})
    if args.result:
        write_result(args.result, {"settings": vars(args), "rows": summary}, **page(summary, args))
    print(
        "\n| setting | commit | tau | draft ms | verify ms | outside draft+verify ms | "
        "of which target prefill | added | speedup | identical |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    for r in summary:
        split = [r["target_prefill_ms"], r["added_ms"]]
        split_cells = " | ".join("" if v is None else f"{v:.1f}" for v in split)
        print(
            f"| {r['setting']} | {r['commit']} | {r['tau']:.2f} | {r['draft_ms']:.1f} | "
            f"{r['verify_ms']:.1f} | {r['outside_ms']:.1f} | {split_cells} | "
            f"{r['speedup']:.2f}x | {r['all_match']} |"
        )
    print(f"\nwrote {output}/round_overhead.json")


if __name__ == "__main__":
    main()
