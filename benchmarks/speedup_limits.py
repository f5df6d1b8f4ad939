"""What limits a draft's speedup, measured: the built-in bench of one export (greedy, a fixed
chain) and where its rounds' time goes, against a goal (a speedup over the target alone through
the same engine).

    python benchmarks/speedup_limits.py --draft outputs/quickstart/export \\
        --questions question.jsonl --max-new-tokens 64 --goal 2.2 --output outputs/limits \\
        --result docs/results/speedup_limits_cpu.json

The bench (``specforge bench``, the recipe's settings, prompt lookup off) runs once into
``--output``; a rerun reads its ``bench.json``. A round of chain ``k`` costs ``round_ms``
(drafting, verifying ``k + 1`` tokens, the draft's extension and the rest) against
``target_ms`` a token of the target alone, so the speedup is about
``tau * target_ms / round_ms``. From the measured parts: the accept length the goal needs at
these costs, the conditional acceptance per position that gives it (the same at every
position), the ceiling (every token accepted), and the speedup with drafting free or with a
verification that cost one target token. Run it alone (2 CPU cores).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import bench

from specforge.results import figures_markdown, write_result

RECIPE = "configs/smollm2-135m-eagle3.yaml"


def run_bench(args) -> dict:
    """``specforge bench`` of the draft into ``--output`` (skipped when its bench.json is
    there); returns that bench.json."""
    return bench(
        Path(args.output),
        *("--config", RECIPE, "--draft", args.draft),
        *("--questions", args.questions, "--num-steps", str(args.num_steps)),
        *("--max-new-tokens", str(args.max_new_tokens), "--prompt-lookup-num-tokens", "0"),
        *(("--limit", str(args.limit)) if args.limit else ()),
    )


def uniform_acceptance(tau: float, depth: int) -> float | None:
    """The acceptance ``p`` at every position of a chain of ``depth`` for which
    ``1 + p + ... + p**depth`` is ``tau`` (bisection), or ``None`` past the chain's reach."""
    if tau >= depth + 1:
        return None
    low, high = 0.0, 1.0
    for _ in range(60):
        p = (low + high) / 2
        low, high = (p, high) if sum(p**i for i in range(depth + 1)) < tau else (low, p)
    return (low + high) / 2


def limits(bench: dict, goal: float) -> dict:
    """The bench's round costs read against ``goal``."""
    cost, tau = bench["cost"], bench["tau"]
    depth = bench["settings"]["num_steps"]
    target, round_ms = cost["target_ms_per_token"], cost["round_ms"]
    draft, verify = cost["draft_ms_per_round"], cost["verify_ms_per_round"]
    needed = goal * round_ms / target
    return {
        "tau": tau,
        "speedup": bench["speedup"],
        "depth": depth,
        "acceptance_per_position": bench["acceptance_per_position"],
        "target_ms_per_token": target,
        "round_ms": round_ms,
        "draft_ms_per_round": draft,
        "verify_ms_per_round": verify,
        "rest_ms_per_round": round_ms - draft - verify,
        "verify_in_target_tokens": verify / target,
        "tau_for_1x": round_ms / target,
        "tau_for_goal": needed,
        "acceptance_for_goal": uniform_acceptance(needed, depth),
        "ceiling_speedup": (depth + 1) * target / round_ms,
        "speedup_drafting_free": tau * target / (round_ms - draft),
        "speedup_verify_one_token": tau * target / (round_ms - verify + target),
        "all_match": bench["all_match"],
        "turns": bench["turns"],
    }


def figures(found: dict, goal: float) -> dict:
    acceptance, depth = found["acceptance_for_goal"], found["depth"]
    per_position = " / ".join(f"{p:.3f}" for p in found["acceptance_per_position"])
    return {
        "turns; outputs identical to the target's": f"{found['turns']}; {found['all_match']}",
        f"tau (chain {depth}); speedup over the compiled target alone": (
            f"{found['tau']:.3f}; {found['speedup']:.2f}x"
        ),
        "acceptance per position (conditional)": per_position,
        "target ms a token; round ms": (
            f"{found['target_ms_per_token']:.1f}; {found['round_ms']:.1f}"
        ),
        "round: drafting / verifying / the rest (ms)": (
            f"{found['draft_ms_per_round']:.1f} / {found['verify_ms_per_round']:.1f} / "
            f"{found['rest_ms_per_round']:.1f}"
        ),
        f"verifying {depth + 1} tokens, in target tokens": round(
            found["verify_in_target_tokens"], 2
        ),
        f"tau for 1x; for the goal ({goal}x)": (
            f"{found['tau_for_1x']:.2f}; {found['tau_for_goal']:.2f}"
        ),
        "acceptance at every position the goal needs": (
            f"{acceptance:.2f}" if acceptance is not None else "past the chain's reach"
        ),
        "ceiling (every token accepted)": f"{found['ceiling_speedup']:.2f}x",
        "with drafting free; with verification at one token's cost": (
            f"{found['speedup_drafting_free']:.2f}x; {found['speedup_verify_one_token']:.2f}x"
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True, help="an export directory")
    parser.add_argument("--questions", required=True)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--num-steps", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--goal", type=float, default=2.2, help="speedup to read the costs for")
    parser.add_argument("--output", default="outputs/limits")
    parser.add_argument("--result", default=None)
    args = parser.parse_args()
    found = limits(run_bench(args), args.goal)
    record = write_result(
        Path(args.result or Path(args.output) / "limits.json"),
        {"settings": vars(args), "limits": found},
        title="What limits the draft's speedup (cpu)",
        summary=(
            f"The built-in bench of {args.draft} (chain {args.num_steps}, greedy, "
            f"{args.max_new_tokens} tokens, the recipe's settings) on "
            f"{'the first ' + str(args.limit) if args.limit else 'all'} questions of "
            f"{args.questions}, its rounds' time read against a {args.goal}x goal over the "
            "target alone through the same compiled engine."
        ),
        figures=figures(found, args.goal),
    )
    print(figures_markdown(record["figures"]))


if __name__ == "__main__":
    main()
