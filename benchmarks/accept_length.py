"""Accept length and speedup of an exported draft, chains vs a tree, with the training run's
predicted accept length beside the measured one and where a round's time goes; writes JSON + a
table.

    python benchmarks/accept_length.py --target smollm2-135m \
        --draft outputs/smollm2-135m-eagle3/export --questions builtin-eval \
        --metrics outputs/smollm2-135m-eagle3/metrics.jsonl --max-new-tokens 128

Each configuration is a full ``specforge bench`` run (target alone, prompt lookup and the
EAGLE-3 runtime on the same prompts, greedy, batch size 1); its report lands in
``<output>/<name>/``; ``--configurations`` picks some of them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import parse_smoke

from specforge.config import load_config
from specforge.io import read_jsonl
from specforge.recipes.bench import bench
from specforge.results import write_result

CONFIGURATIONS = {
    "chain-5": {"num_steps": 5, "topk": 1, "num_draft_tokens": None},
    "tree-5x4-16": {"num_steps": 5, "topk": 4, "num_draft_tokens": 16},
    # a short chain: on a CPU in fp32 verifying 3 tokens costs ~1.2 target tokens, 6 ~1.65
    # (benchmarks/verify_cost.py)
    "chain-2": {"num_steps": 2, "topk": 1, "num_draft_tokens": None},
}


def predicted_tau(metrics: Path) -> float | None:
    """The last eval ``tau_pred`` of a training run's metrics.jsonl."""
    if not metrics.is_file():
        return None
    evals = [r for r in read_jsonl(metrics) if r["split"] == "eval"]
    return evals[-1]["tau_pred"] if evals else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="outputs/smollm2-135m-eagle3/export")
    parser.add_argument("--questions", default="builtin-eval")
    parser.add_argument("--metrics", default="outputs/smollm2-135m-eagle3/metrics.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output", default="outputs/bench/accept_length")
    parser.add_argument(
        "--configurations", nargs="+", choices=list(CONFIGURATIONS), default=list(CONFIGURATIONS)
    )
    args = parse_smoke(parser, limit=1, max_new_tokens=8)
    rows = {}
    for name in args.configurations:
        drafting = CONFIGURATIONS[name]
        settings = {
            "target.name_or_path": args.target,
            "bench.draft": args.draft,
            "bench.questions": args.questions,
            "bench.max_new_tokens": args.max_new_tokens,
            "bench.limit": args.limit,
            "bench.dtype": args.dtype,
            "bench.output": str(Path(args.output) / name),
            **{f"bench.{k}": v for k, v in drafting.items()},
        }
        result = bench(load_config(None, [f"{k}={json.dumps(v)}" for k, v in settings.items()]))
        rows[name] = {
            k: result[k]
            for k in (
                "tau",
                "tau_sglang",
                "speedup",
                "speedup_prompt_lookup",
                "all_match",
                "tokens_per_s",
                "acceptance_per_position",
                "cost",
            )
        }
    summary = {
        "predicted_tau": predicted_tau(Path(args.metrics)),
        "runs": rows,
        "questions": args.questions,
        "max_new_tokens": args.max_new_tokens,
    }
    write_result(Path(args.output) / "summary.json", summary)
    print(f"\npredicted tau (training eval, chain of ttt_length): {summary['predicted_tau']}")
    print(
        "| drafting | tau | tau_sglang | speedup | prompt lookup | identical | eagle3 tok/s "
        "| draft / verify / round ms | target ms/token | tau for 1.3x |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        cost = r["cost"]
        print(
            f"| {name} | {r['tau']:.3f} | {r['tau_sglang']:.3f} | {r['speedup']:.2f}x | "
            f"{r['speedup_prompt_lookup']:.2f}x | {r['all_match']} | "
            f"{r['tokens_per_s']['eagle3']:.1f} | {cost['draft_ms_per_round']:.1f} / "
            f"{cost['verify_ms_per_round']:.1f} / {cost['round_ms']:.1f} | "
            f"{cost['target_ms_per_token']:.1f} | {cost['tau_for_1.3x']:.2f} |"
        )
    print(f"\nwrote {args.output}/summary.json")


if __name__ == "__main__":
    main()
