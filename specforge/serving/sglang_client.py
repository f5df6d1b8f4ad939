"""Accept length measured on a running SGLang server (``--engine sglang --url ...``).

SGLang's native ``POST /generate`` takes ``input_ids`` (or ``text``) and ``sampling_params`` and
answers with ``meta_info.completion_tokens`` and, with speculative decoding on,
``meta_info.spec_verify_ct`` (verification forwards) and, in recent releases,
``meta_info.spec_accept_histogram`` (how many verifications accepted 0, 1, 2, ... draft
tokens). Its accept length is ``completion_tokens / spec_verify_ct`` (prefill token included),
what this reports as ``tau``; acceptance per position comes from the histogram, where the server
gives one. With a second server of the same target without speculation (``bench.baseline_url``)
the same turns give the speedup and whether the outputs are the same. The prompts are rendered
here with the target's chat template, so they are the same token ids the built-in benchmark
uses; each second turn follows that server's own first answer.
"""

from __future__ import annotations

import functools
import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from specforge.data.chat import prompt_ids
from specforge.data.questions import BenchQuestion, ask_turns, load_questions
from specforge.errors import UserError
from specforge.io import write_json_atomic, write_text_atomic
from specforge.serving.agreement import against_baseline


def sglang_generate(
    url: str,
    input_ids: list[int],
    *,
    max_new_tokens: int,
    timeout: float = 600.0,
    speculative: bool = True,
) -> dict[str, Any]:
    """One greedy request to ``{url}/generate``; returns the response's first item.

    Raises:
        UserError: the server is unreachable, answers an error, or (``speculative``) reports
            no verify count.
    """
    body = json.dumps(
        {
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        }
    ).encode()
    request = urllib.request.Request(
        f"{url.rstrip('/')}/generate", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = json.loads(response.read())
    except (urllib.error.URLError, OSError) as err:
        raise UserError(f"SGLang server at {url} did not answer /generate: {err}") from err
    item = payload[0] if isinstance(payload, list) else payload
    meta = item.get("meta_info", {})
    if speculative and "spec_verify_ct" not in meta:
        raise UserError(
            f"{url}: meta_info has no spec_verify_ct; is the server running with "
            "a --speculative-algorithm (EAGLE3, ...)?"
        )
    return item


def ask_all(
    url: str,
    tokenizer,
    questions: list[BenchQuestion],
    *,
    max_new_tokens: int,
    system_prompt: str | None = None,
    speculative: bool = True,
) -> list[dict[str, Any]]:
    """Every turn of ``questions`` through one server, one request at a time; a row per turn
    (each second turn follows this server's own first answer)."""

    def answer(_turn, messages):
        start = time.perf_counter()
        item = sglang_generate(
            url,
            prompt_ids(tokenizer, messages),
            max_new_tokens=max_new_tokens,
            speculative=speculative,
        )
        return item.get("text", ""), (item, time.perf_counter() - start)

    rows = []
    for question in questions:
        for turn, _, (item, seconds) in ask_turns(question, answer, system_prompt=system_prompt):
            meta = item["meta_info"]
            rows.append(
                {
                    "question_id": question.id,
                    "category": question.category,
                    "turn": turn,
                    "seconds": seconds,
                    "tokens": int(meta["completion_tokens"]),
                    "text": item.get("text", ""),
                    "spec_verify_ct": int(meta.get("spec_verify_ct", 0)),
                    "spec_accept_histogram": meta.get("spec_accept_histogram"),
                }
            )
    return rows


def acceptance_from_histogram(histogram: list[int]) -> list[float]:
    """P(draft token k accepted | tokens < k accepted), k = 1, 2, ..., from SGLang's
    ``spec_accept_histogram`` (entry n: verifications that accepted exactly n draft tokens),
    as vLLM's per-position counters give it."""
    rates, reached = [], sum(histogram)
    for k in range(1, len(histogram)):
        accepted = sum(histogram[k:])
        rates.append(accepted / reached if reached else 0.0)
        reached = accepted
    return rates


def sglang_report(
    spec: list[dict[str, Any]], base: list[dict[str, Any]] | None, settings: dict[str, Any]
) -> dict[str, Any]:
    """``bench.json`` for the SGLang engine: accept length (``completion_tokens /
    spec_verify_ct``), acceptance per position where the server reports its histogram, tokens/s
    with and without the draft, the speedup, and whether both servers gave the same text."""

    def tau(rows):
        verify = sum(r["spec_verify_ct"] for r in rows)
        return sum(r["tokens"] for r in rows) / max(verify, 1)

    histograms = [r["spec_accept_histogram"] for r in spec if r["spec_accept_histogram"]]
    total = [0] * max((len(h) for h in histograms), default=0)
    for histogram in histograms:
        for n, count in enumerate(histogram):
            total[n] += int(count)
    categories = sorted({r["category"] for r in spec})
    return {
        "engine": "sglang",
        "tau": tau(spec),
        "acceptance_per_position": acceptance_from_histogram(total) if total else None,
        "accept_histogram": total or None,
        **against_baseline(spec, base, "text"),
        "turns": len(spec),
        "per_category": {c: tau([r for r in spec if r["category"] == c]) for c in categories},
        "settings": settings,
        "turn_details": spec,
        "baseline_turn_details": base,
    }


def run_sglang_bench(
    url: str,
    tokenizer,
    questions: str,
    *,
    max_new_tokens: int,
    output: str,
    system_prompt: str | None = None,
    limit: int | None = None,
    baseline_url: str | None = None,
) -> dict[str, Any]:
    """Accept length of a served draft on a question set and, with ``baseline_url`` (the same
    target served without speculation), the speedup over it; writes bench.json and bench.md."""
    selected = load_questions(questions, limit=limit)
    ask = functools.partial(
        ask_all, tokenizer=tokenizer, questions=selected, max_new_tokens=max_new_tokens
    )
    spec = ask(url, system_prompt=system_prompt)
    base = None
    if baseline_url:
        base = ask(baseline_url, system_prompt=system_prompt, speculative=False)
    settings = {
        "engine": "sglang",
        "url": url,
        "baseline_url": baseline_url,
        "questions": questions,
        "max_new_tokens": max_new_tokens,
        "limit": limit,
    }
    result = sglang_report(spec, base, settings)
    out = Path(output)
    write_json_atomic(out / "bench.json", result)
    write_text_atomic(out / "bench.md", "\n".join(_report_lines(result)) + "\n")
    return result


def _report_lines(result: dict[str, Any]) -> list[str]:
    s = result["settings"]
    speedup = result["speedup"]
    base_speed = result["tokens_per_s"]["baseline"]
    lines = [
        f"# SGLang at {s['url']}: {s['questions']} ({result['turns']} turns)",
        "",
        f"max_new_tokens={s['max_new_tokens']}, greedy, one request at a time; baseline: "
        f"{s['baseline_url'] or 'none'}",
        "",
        "| metric | value |",
        "|---|---|",
        f"| accept length (completion_tokens / spec_verify_ct) | {result['tau']:.3f} |",
        f"| speedup over SGLang without the draft | "
        f"{'(no baseline)' if speedup is None else f'{speedup:.2f}x'} |",
        f"| tokens/s with / without | {result['tokens_per_s']['speculative']:.1f} / "
        f"{'-' if base_speed is None else f'{base_speed:.1f}'} |",
        f"| outputs identical with and without | {result['all_match']} |",
        "",
        "| category | accept length |",
        "|---|---|",
        *[f"| {c} | {v:.3f} |" for c, v in result["per_category"].items()],
    ]
    if result["acceptance_per_position"]:
        lines += ["", "| draft position | acceptance rate |", "|---|---|"]
        rates = result["acceptance_per_position"]
        lines += [f"| {i + 1} | {r:.3f} |" for i, r in enumerate(rates)]
    return lines
