"""``bench --engine vllm``: vLLM's counters read from /metrics, the streamed completions, the
speedup against a server without the draft, and launched servers' lifecycle, over real HTTP on
loopback against a stand-in (tests/serving/vllm_standin.py); and, where a vLLM environment is
given (``SPECFORGE_VLLM_PYTHON``), against vLLM itself."""

import json
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
    complete,
    first_difference,
    free_port,
    launched_server,
    parse_spec_counters,
    vllm_report,
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
    assert result["first_differences"] == []
    assert result["ttft_s"]["speculative"] > 0 and result["engine_version"] == "stand-in"
    assert spec.counts["drafts"] == START["drafts"] + 18
    assert "accept length (1 + accepted / drafts" in (out / "bench.md").read_text()


def test_an_engine_that_dies_mid_stream_is_one_clear_error():
    server, url = serve_in_thread(speculative=True)
    server.dead = True
    try:
        with pytest.raises(UserError, match="failed mid-completion: .*EngineCore encountered"):
            complete(url, "target", [1, 2, 3, 4], max_tokens=4)
    finally:
        server.shutdown()


def test_differing_turns_report_where_they_first_differ():
    spec = [{"question_id": 1, "turn": 0, "token_ids": [5, 6, 7]}]
    spec.append({"question_id": 1, "turn": 1, "token_ids": [1, 2]})
    base = [{"question_id": 1, "turn": 0, "token_ids": [5, 6, 9]}]
    base.append({"question_id": 1, "turn": 1, "token_ids": [1, 2, 3]})
    for rows in (spec, base):
        for row in rows:
            row |= {"category": "math", "tokens": len(row["token_ids"]), "seconds": 1.0}
            row["ttft"] = 0.1
    result = vllm_report(spec, base, SpecCounters(drafts=2.0, accepted=1.0), {})
    assert result["match_rate"] == 0.0
    assert [d["position"] for d in result["first_differences"]] == [2, 2]
    assert first_difference(spec[1], base[1]) == 2  # a prefix: the shorter's length


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


SIGTERMED = """
import sys, time
from pathlib import Path
from specforge.serving.vllm_client import free_port, launched_server
port = free_port()
command = [sys.executable, sys.argv[1], "--port", str(port), "--speculative"]
with launched_server(command, port, Path(sys.argv[2]), timeout=60) as url:
    print(url, flush=True)
    time.sleep(600)
"""


def test_a_sigterm_to_the_bench_stops_the_server_it_launched(tmp_path):
    """``kill`` (or a scheduler's time limit) on the process that launched a server: the server,
    leading a process group of its own, is stopped too, not left holding its port and memory."""
    bench = subprocess.Popen(
        [sys.executable, "-c", SIGTERMED, str(STANDIN), str(tmp_path / "vllm.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        url = bench.stdout.readline().strip()
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            assert response.status == 200
        bench.terminate()
        assert bench.wait(timeout=90) == 128 + 15
    finally:
        bench.kill()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{url}/health", timeout=5)


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


def vllm_rows() -> str:
    """The vLLM rows of docs/export-and-serving.md's table of engine versions."""
    page = (Path(__file__).parents[2] / "docs" / "export-and-serving.md").read_text()
    return "\n".join(line for line in page.splitlines() if line.startswith("| vLLM"))


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("draft_type", ["eagle3", "peagle"])
def test_vllm_itself_serves_an_export_and_passes_the_gate(tmp_path, vllm_python, draft_type):
    """A tiny draft trained, exported and served by the pinned vLLM with and without it: vLLM
    counted drafts, its outputs with the draft equal those without, and its accept length and
    acceptance per position agree with the built-in runtime's on the same turns (the gate).
    The target's heads are 64 wide (vLLM's CPU attention takes no smaller ones) and it has 8
    layers, so the default aux layers [1, 3, 4] are distinct: vLLM collects each layer once, and
    a 4-layer target's [1, 1, 0] would give its ``fc`` two states instead of three. A draft
    trained for seconds accepts little, so the accept lengths compared here are near 1; at scale
    the comparison is ``benchmarks/vllm_agreement.py`` (docs/results/vllm_agreement_cpu.json).
    A P-EAGLE export is served by vLLM's EAGLE-3 proposer with parallel drafting on (a chain of
    3 in one forward, its ``mask_hidden`` loaded)."""
    from specforge.recipes.train import train
    from tests.helpers import tiny_train_config, write_peaked_target

    folder, data = write_peaked_target(tmp_path, hidden=256, num_layers=8)
    family = f"draft.type={draft_type}"
    steps = "train.max_steps=3" if draft_type == "eagle3" else "train.max_steps=80"
    run = train(tiny_train_config(folder, data, tmp_path / "run", steps, family))
    export = tmp_path / "export"
    assert main(["export", str(run.checkpoint), str(export), "--dtype", "float32"]) == 0
    questions = str(write_questions(tmp_path))
    common = ["--target", str(folder), "--draft", str(export), "--questions", questions]
    common += ["--num-steps", "3", "--max-new-tokens", "16"]
    builtin = tmp_path / "builtin"
    assert main(["bench", *common, "--compile", "false", "--output", str(builtin)]) == 0
    out = tmp_path / "bench"
    main(
        [
            "bench",
            *("--engine", "vllm", "--vllm-python", vllm_python, *common),
            *("--output", str(out), "--agree-with", str(builtin / "bench.json")),
            'bench.vllm_args=["--max-model-len", "512"]',
        ]
    )
    result = json.loads((out / "bench.json").read_text())
    # the version served is one the docs' table lists as serving our exports
    assert f"| {result['engine_version']} |" in vllm_rows()
    assert result["drafts"] > 0 and result["tau"] >= 1.0 and result["all_match"] is True
    found = result["agreement"]
    assert found["agrees"] and all(c["problem"] is None for c in found["checks"])
    assert len(found["engine_acceptance_per_position"]) == 3
    assert (out / "vllm_speculative.log").is_file() and (out / "vllm_baseline.log").is_file()
    assert subprocess.run(["pgrep", "-f", "vllm.entrypoints"], check=False).returncode == 1
