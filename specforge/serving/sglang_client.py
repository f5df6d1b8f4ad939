"""Accept length measured on a running SGLang server (``--engine sglang --url ...``).

SGLang's native ``POST /generate`` takes ``input_ids`` (or ``text``) and ``sampling_params`` and
answers with ``meta_info.completion_tokens`` and, with speculative decoding on,
``meta_info.spec_verify_ct`` (verification forwards). Its accept length is
``completion_tokens / spec_verify_ct`` (prefill token included): what this reports as
``tau_sglang``. The prompts are rendered here with the target's chat template, so they are the
same token ids the built-in benchmark uses; the second MT-Bench turn follows the server's own
first answer.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from specforge.data.chat import prompt_ids
from specforge.data.questions import ask_turns, load_questions
from specforge.errors import UserError
from specforge.io import write_json_atomic, write_text_atomic


def sglang_generate(
    url: str, input_ids: list[int], *, max_new_tokens: int, timeout: float = 600.0
) -> dict[str, Any]:
    """One greedy request to ``{url}/generate``; returns the response's first item.

    Raises:
        UserError: the server is unreachable, answers an error, or reports no verify count.
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
    if "spec_verify_ct" not in meta:
        raise UserError(
            f"{url}: meta_info has no spec_verify_ct; is the server running with "
            "--speculative-algorithm EAGLE3?"
        )
    return item


def run_sglang_bench(
    url: str,
    tokenizer,
    questions: str,
    *,
    max_new_tokens: int,
    output: str,
    system_prompt: str | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """Accept length of a served draft on a question set; writes bench.json and bench.md."""

    def answer(_turn, messages):
        start = time.perf_counter()
        item = sglang_generate(url, prompt_ids(tokenizer, messages), max_new_tokens=max_new_tokens)
        return item.get("text", ""), (item["meta_info"], time.perf_counter() - start)

    rows = []
    for question in load_questions(questions, limit=limit):
        for turn, _, (meta, seconds) in ask_turns(question, answer, system_prompt=system_prompt):
            rows.append(
                {
                    "question_id": question.id,
                    "category": question.category,
                    "turn": turn,
                    "seconds": seconds,
                    "completion_tokens": int(meta["completion_tokens"]),
                    "spec_verify_ct": int(meta["spec_verify_ct"]),
                }
            )

    def tau(selected):
        verify = sum(r["spec_verify_ct"] for r in selected)
        return sum(r["completion_tokens"] for r in selected) / max(verify, 1)

    categories = sorted({r["category"] for r in rows})
    result = {
        "engine": "sglang",
        "url": url,
        "questions": questions,
        "turns": len(rows),
        "tau_sglang": tau(rows),
        "tokens_per_s": sum(r["completion_tokens"] for r in rows)
        / max(sum(r["seconds"] for r in rows), 1e-9),
        "per_category": {c: tau([r for r in rows if r["category"] == c]) for c in categories},
        "turn_details": rows,
    }
    out = Path(output)
    write_json_atomic(out / "bench.json", result)
    lines = [
        f"# SGLang accept length at {url}: {questions} ({len(rows)} turns)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| tau_sglang (completion_tokens / spec_verify_ct) | {result['tau_sglang']:.3f} |",
        f"| tokens/s (sequential requests) | {result['tokens_per_s']:.1f} |",
        "",
        "| category | tau_sglang |",
        "|---|---|",
        *[f"| {c} | {v:.3f} |" for c, v in result["per_category"].items()],
    ]
    write_text_atomic(out / "bench.md", "\n".join(lines) + "\n")
    return result
