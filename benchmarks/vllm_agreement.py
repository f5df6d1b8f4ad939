"""The same exports served by vLLM and by the built-in runtime: vLLM's accept length (its own
counters) and acceptance per position beside the built-in bench's on the same questions, and
vLLM's speedup over itself without the draft.

    python benchmarks/vllm_agreement.py --vllm-python ~/vllm-venv/bin/python \\
        --export eagle3=outputs/ab/eagle3/export:5:outputs/ab/bench_eagle3/bench.json \\
        --export dflash=outputs/ab/dflash/export:7:outputs/ab/bench_dflash/bench.json \\
        --questions question.jsonl --limit 10 --max-new-tokens 64 --output outputs/vllm \\
        --result docs/results/vllm_agreement_cpu.json

Each ``--export NAME=DIR:STEPS:BENCH_JSON`` is served at ``STEPS`` tokens a round through
``specforge bench --engine vllm`` (a subprocess launching vLLM with the draft, then without);
the built-in runtime's figures come from ``BENCH_JSON``, a built-in bench of the same export
whose turns include these questions, compared on the turns both ran (``--agree-with``: the
gate of :mod:`specforge.serving.agreement`, with the export's checks). ``--modes``: vLLM eager
(``--enforce-eager``, the bench's default) and/or compiled (``--no-enforce-eager``: vLLM's
compiled forward, on a CPU torch.compile's), a row each; a mode's bench goes to
``OUTPUT/NAME`` (eager) or ``OUTPUT/NAME_compiled`` and is reused when there.
Run it alone (vLLM and the bench share the CPU).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from common import bench, parse_smoke

from specforge.results import figures_markdown, write_result

RECIPE = "configs/smollm2-135m-eagle3.yaml"


def serve(name: str, export: str, steps: int, bench_json: str, mode: str, args) -> dict:
    """``specforge bench --engine vllm`` for one export in one ``mode``, gated against the
    built-in bench ``bench_json``; returns its bench.json."""
    return bench(
        Path(args.output) / (name if mode == "eager" else f"{name}_{mode}"),
        *("--config", RECIPE, "--engine", "vllm"),
        *(("--target", args.target) if args.target else ()),
        *("--vllm-python", args.vllm_python, "--draft", export),
        *("--questions", args.questions, "--limit", str(args.limit)),
        *("--num-steps", str(steps), "--max-new-tokens", str(args.max_new_tokens)),
        *("--agree-with", bench_json),
        *vllm_args(
            [*shlex.split(args.vllm_flags), *(["--no-enforce-eager"] * (mode == "compiled"))]
        ),
    )


def vllm_args(flags: list[str]) -> list[str]:
    """The bench override that passes ``flags`` to the launched vLLM servers (none: none)."""
    return [f"bench.vllm_args={json.dumps(flags)}"] if flags else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--target", help="the exports' target (default: the recipe's)")
    parser.add_argument(
        "--vllm-flags",
        default="",
        help="more flags for the vLLM servers, one string (--vllm-flags='--max-model-len 512')",
    )
    parser.add_argument("--export", action="append", required=True, help="NAME=DIR:STEPS:BENCH")
    parser.add_argument("--questions", required=True)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--output", default="outputs/vllm")
    parser.add_argument("--result", default=None)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["eager", "compiled"],
        default=["eager"],
        help="vLLM eager (--enforce-eager) and/or compiled (--no-enforce-eager)",
    )
    args = parse_smoke(parser, limit=1, max_new_tokens=8)
    rows = []
    for spec in args.export:
        name, _, rest = spec.partition("=")
        export, steps, bench_json = rest.split(":")
        for mode in args.modes:
            engine = serve(name, export, int(steps), bench_json, mode, args)
            rows.append(agreement_row(name, mode, int(steps), engine))
    write_table(rows, args)


def agreement_row(name: str, mode: str, steps: int, engine: dict) -> dict:
    """One export in one mode: vLLM's figures beside the built-in runtime's (the gate)."""
    gate = engine["agreement"]
    return {
        "draft": name,
        "mode": mode,
        "steps": steps,
        "vllm_tau": engine["tau"],
        "builtin_tau": gate["builtin_tau"],
        "agrees": gate["agrees"],
        "gap": gate["gap"],
        "vllm_acceptance_per_position": engine["acceptance_per_position"],
        "builtin_acceptance_per_position": gate["builtin_acceptance_per_position"],
        "export_checks": gate["checks"],
        "vllm_speedup": engine["speedup"],
        "vllm_tokens_per_s": engine["tokens_per_s"],
        "vllm_identical_with_and_without": engine["match_rate"],
        "turns": engine["turns"],
        "vllm_version": engine["engine_version"],
        "vllm_flags": engine["settings"].get("vllm_flags"),
    }


def write_table(rows: list[dict], args) -> None:
    """The rows (a draft and a mode each) to ``--result`` with the results page's table."""
    columns = [
        "draft",
        "vLLM",
        "steps",
        "vLLM tau",
        "built-in tau",
        "gap",
        "vLLM speedup",
        "vLLM identical",
    ]
    table = [
        [
            r["draft"],
            r["mode"],
            r["steps"],
            round(r["vllm_tau"], 3) if r["vllm_tau"] else None,
            round(r["builtin_tau"], 3),
            f"{r['gap']:.1%}",
            f"{r['vllm_speedup']:.2f}x",
            f"{r['vllm_identical_with_and_without']:.0%}",
        ]
        for r in rows
    ]
    record = write_result(
        Path(args.result or Path(args.output) / "agreement.json"),
        {"settings": vars(args), "rows": rows},
        title="The exports served by vLLM beside the built-in runtime (cpu)",
        summary=(
            f"vLLM ({rows[0]['vllm_version']}, float32, {' and '.join(args.modes)}, one request "
            "at a time) serving "
            f"each export on the first {args.limit} questions of {args.questions} "
            f"({args.max_new_tokens} tokens, greedy), against vLLM without the draft; the "
            "built-in runtime's accept length on the same turns from its own bench."
        ),
        figures={"columns": columns, "rows": table},
    )
    print(figures_markdown(record["figures"]))


if __name__ == "__main__":
    main()
