"""``specforge bench --engine vllm``: the exported draft served by vLLM, against vLLM without it
(:mod:`specforge.serving.vllm_client`), reported in ``bench.json`` / ``bench.md``."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from specforge.config import BenchConfig, SpecForgeConfig
from specforge.data.questions import load_questions
from specforge.errors import UserError
from specforge.families.dispatch import export_checks, family_of_export
from specforge.io import read_json, write_json_atomic, write_text_atomic
from specforge.models.adapter import text_config
from specforge.models.target import (
    load_target_config,
    load_tokenizer,
    resolve_target_path,
    target_dtype,
)
from specforge.serving.agreement import agreement
from specforge.serving.vllm_client import (
    DEFAULT_FLAGS,
    ask_all,
    free_port,
    launched_server,
    read_counters,
    served_model,
    server_command,
    server_version,
    vllm_report,
)

logger = logging.getLogger(__name__)


def speculative_config(draft: Path, num_steps: int) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` for an export: its family's method and settings
    (:attr:`~specforge.families.base.EngineMethods.vllm`), ``num_steps`` tokens a round.

    Raises:
        UserError: a family vLLM does not serve.
    """
    found = family_of_export(draft)
    if found.engines.vllm is None:
        raise UserError(f"vLLM does not serve a {found.name} draft ({draft})")
    return {**found.engines.vllm, "model": str(draft), "num_speculative_tokens": num_steps}


def check_vllm_source(bc: BenchConfig) -> None:
    """Refuse, before anything loads, a vLLM bench or engine check with no server to ask:
    neither ``bench.url`` nor ``bench.vllm_python``, or a ``vllm_python`` that is not an
    executable file.

    Raises:
        UserError: naming the setting and the path.
    """
    if bc.url:
        return
    if not bc.vllm_python:
        raise UserError(
            "vLLM needs bench.url (a running server, --url) or bench.vllm_python "
            "(the interpreter of an environment where vLLM is installed)"
        )
    path = Path(bc.vllm_python).expanduser()
    if not path.is_file() or not os.access(path, os.X_OK):
        kind = "a folder" if path.is_dir() else "not an executable file"
        raise UserError(
            f"bench.vllm_python {bc.vllm_python} is {kind}: give the Python interpreter of "
            "the environment where vLLM is installed (e.g. ~/vllm-venv/bin/python)"
        )


def bench_vllm(cfg: SpecForgeConfig, questions_source: str) -> dict[str, Any]:
    """Serve ``cfg.bench_draft`` with vLLM and measure it; writes bench.json and bench.md.

    Raises:
        UserError: neither ``bench.url`` nor ``bench.vllm_python``, a missing export, or a
            server that does not start or answer (its log named).
    """
    bc = cfg.bench
    check_vllm_source(bc)
    questions = load_questions(questions_source, limit=bc.limit)
    tokenizer = load_tokenizer(cfg.target)
    out = cfg.bench_dir
    settings: dict[str, Any] = {
        "engine": "vllm",
        "questions": questions_source,
        "num_steps": bc.num_steps,
        "max_new_tokens": bc.max_new_tokens,
        "limit": bc.limit,
        "target": cfg.target.name_or_path,
    }

    def ask(url: str) -> list[dict[str, Any]]:
        rows = ask_all(
            url,
            served_model(url),
            tokenizer,
            questions,
            max_new_tokens=bc.max_new_tokens,
            system_prompt=bc.system_prompt,
        )
        logger.info("vLLM at %s answered %d turns", url, len(rows))
        return rows

    if bc.url:
        settings |= {"url": bc.url, "baseline_url": bc.baseline_url}
        before = read_counters(bc.url)
        spec = ask(bc.url)
        counters = read_counters(bc.url).minus(before)
        version = server_version(bc.url)
        base = ask(bc.baseline_url) if bc.baseline_url else None
    else:
        spec, counters, base, version = _launched(cfg, settings, ask)
    result = vllm_report(spec, base, counters, settings)
    result["engine_version"] = version
    if bc.agree_with:
        result["agreement"] = _agreement(cfg, result)
    _write(result, out)
    return result


def _agreement(cfg: SpecForgeConfig, result: dict[str, Any]) -> dict[str, Any]:
    """The gate: the built-in bench ``bench.agree_with`` beside vLLM's, and the export's checks."""
    builtin = read_json(Path(cfg.bench.agree_with))
    found = agreement(builtin, result, cfg.bench.agreement_margin)
    found["checks"] = export_checks(cfg.bench_draft, text_config(load_target_config(cfg.target)))
    if not found["agrees"]:
        failed = [c["check"] for c in found["checks"] if c["problem"]]
        logger.warning(
            "vLLM's accept length %.3f is %.0f%% below the built-in runtime's %.3f on the same "
            "turns; export checks failed: %s",
            found["engine_tau"],
            100 * found["gap"],
            found["builtin_tau"],
            failed or "none (the gap is in how the engine serves the draft)",
        )
    return found


def _launched(cfg: SpecForgeConfig, settings: dict[str, Any], ask):
    """Launch vLLM with the draft, then without it, asking every turn of each."""
    bc = cfg.bench
    if not (cfg.bench_draft / "config.json").is_file():
        raise UserError(f"{cfg.bench_draft} is not an export directory: run specforge export")
    target = resolve_target_path(cfg.target.name_or_path, target_dtype(cfg.target))
    spec_flags = [
        "--speculative-config",
        json.dumps(speculative_config(cfg.bench_draft.resolve(), bc.num_steps)),
        *bc.vllm_args,
    ]
    out = cfg.bench_dir
    settings |= {
        "vllm_python": bc.vllm_python,
        "vllm_flags": [*DEFAULT_FLAGS, *spec_flags],
        "baseline_flags": [*DEFAULT_FLAGS, *bc.vllm_args],
    }
    port = free_port()
    command = server_command(bc.vllm_python, target, port, spec_flags)
    with launched_server(
        command, port, out / "vllm_speculative.log", timeout=bc.vllm_start_timeout_s
    ) as url:
        before = read_counters(url)
        spec = ask(url)
        counters = read_counters(url).minus(before)
        version = server_version(url)
    port = free_port()
    command = server_command(bc.vllm_python, target, port, list(bc.vllm_args))
    with launched_server(
        command, port, out / "vllm_baseline.log", timeout=bc.vllm_start_timeout_s
    ) as url:
        base = ask(url)
    return spec, counters, base, version


def _write(result: dict[str, Any], out: Path) -> None:
    write_json_atomic(out / "bench.json", result)
    s = result["settings"]

    def times(value):
        return "(no baseline)" if value is None else f"{value:.2f}x"

    tau = result["tau"]
    lines = [
        f"# vLLM {result['engine_version'] or ''}: {s['questions']} ({result['turns']} turns)",
        "",
        f"target `{s['target']}`, {s['num_steps']} speculative tokens a round, "
        f"max_new_tokens={s['max_new_tokens']}, greedy, one request at a time; flags: "
        f"`{' '.join(s.get('vllm_flags', []))}`",
        "",
        "| metric | value |",
        "|---|---|",
        f"| accept length (1 + accepted / drafts, vLLM's counters) | "
        f"{'-' if tau is None else f'{tau:.3f}'} |",
        f"| drafts; draft tokens; accepted | {result['drafts']:.0f}; "
        f"{result['draft_tokens']:.0f}; {result['accepted_tokens']:.0f} |",
        f"| speedup over vLLM without the draft | {times(result['speedup'])} |",
        f"| tokens/s with / without | {result['tokens_per_s']['speculative']:.1f} / "
        f"{result['tokens_per_s']['baseline'] or 0:.1f} |",
        f"| time to first token with / without (s) | {result['ttft_s']['speculative']:.3f} / "
        f"{result['ttft_s']['baseline'] or 0:.3f} |",
        f"| outputs identical with and without | {result['all_match']} |",
        f"| turns that differ (first differing token) | {_differences(result)} |",
        "",
        "| draft position | acceptance rate |",
        "|---|---|",
        *[f"| {i + 1} | {r:.3f} |" for i, r in enumerate(result["acceptance_per_position"])],
    ]
    if result.get("agreement"):
        lines += _agreement_lines(result["agreement"])
    write_text_atomic(out / "bench.md", "\n".join(lines) + "\n")


def _differences(result: dict[str, Any]) -> str:
    differing = result.get("first_differences") or []
    if result["all_match"] is None:
        return "(no baseline)"
    shown = [f"q{d['question_id']}.{d['turn']}@{d['position']}" for d in differing[:8]]
    more = ", ..." if len(differing) > 8 else ""
    return f"{len(differing)}" + (f": {', '.join(shown)}{more}" if shown else "")


def _agreement_lines(found: dict[str, Any]) -> list[str]:
    verdict = "agree" if found["agrees"] else "DISAGREE"
    ours, theirs = found["builtin_acceptance_per_position"], found["engine_acceptance_per_position"]
    return [
        "",
        f"## Against the built-in runtime ({found['turns']} turns): {verdict}",
        "",
        f"accept length: built-in {found['builtin_tau']:.3f}, vLLM {found['engine_tau']:.3f} "
        f"(gap {found['gap']:.1%}, margin {found['margin']:.0%})",
        "",
        "| draft position | built-in | vLLM |",
        "|---|---|---|",
        *[
            f"| {i + 1} | {a:.3f} | {b:.3f} |"
            for i, (a, b) in enumerate(zip(ours, theirs, strict=False))
        ],
        "",
        "| export check | outcome |",
        "|---|---|",
        *[f"| {c['check']} | {c['problem'] or 'passed'} |" for c in found["checks"]],
    ]
