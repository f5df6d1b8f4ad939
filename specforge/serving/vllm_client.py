"""Accept length and speedup measured on vLLM (``bench.engine: vllm``).

The draft is served by vLLM itself: a running server (``bench.url``, and ``bench.baseline_url``
for the same target without speculation), or servers this module launches from the
interpreter of an environment where vLLM is installed (``bench.vllm_python``), one with the
draft and one without, each health-checked, stopped when its half of the bench ends or fails,
and its log kept beside the report (``vllm_speculative.log``, ``vllm_baseline.log``).

Prompts are rendered here with the target's chat template and sent as token ids to
``/v1/completions`` (greedy, streamed, ``return_token_ids``), so both servers and the built-in
bench see the same ids; a second turn follows the server's own first answer. vLLM's own
Prometheus counters (``/metrics``: ``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, ``..._num_accepted_tokens_per_pos``),
read before and after the speculative half, give the accept length (``1 + accepted / drafts``,
vLLM's mean acceptance length) and the acceptance at each draft position; the stream gives
tokens per second and time to first token both ways.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specforge.data.chat import prompt_ids
from specforge.data.questions import BenchQuestion, ask_turns
from specforge.errors import UserError
from specforge.processes import start_group, stop_group
from specforge.serving.agreement import against_baseline

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
SERVED_NAME = "target"
"""The model name the launched servers answer to."""
DEFAULT_FLAGS = ("--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", "--seed", "0")
"""vLLM flags a launched server gets before ``bench.vllm_args``: float32 (the built-in bench's
dtype, so greedy outputs can agree), a context that fits a CPU's KV cache, no graph capture."""


@dataclass
class SpecCounters:
    """vLLM's speculative-decoding counters at one moment (summed over engines)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: dict[int, float] = field(default_factory=dict)

    def minus(self, earlier: SpecCounters) -> SpecCounters:
        positions = set(self.per_position) | set(earlier.per_position)
        return SpecCounters(
            self.drafts - earlier.drafts,
            self.draft_tokens - earlier.draft_tokens,
            self.accepted - earlier.accepted,
            {
                p: self.per_position.get(p, 0.0) - earlier.per_position.get(p, 0.0)
                for p in sorted(positions)
            },
        )


def parse_spec_counters(text: str) -> SpecCounters:
    """vLLM's speculative counters from a Prometheus ``/metrics`` page (missing ones are 0:
    a server without speculation reports none)."""
    from prometheus_client.parser import text_string_to_metric_families

    counters = SpecCounters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == DRAFTS + "_total":
                counters.drafts += sample.value
            elif sample.name == DRAFT_TOKENS + "_total":
                counters.draft_tokens += sample.value
            elif sample.name == ACCEPTED + "_total":
                counters.accepted += sample.value
            elif sample.name == ACCEPTED_PER_POS + "_total":
                position = int(sample.labels["position"])
                counters.per_position[position] = (
                    counters.per_position.get(position, 0.0) + sample.value
                )
    return counters


def _get(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def read_counters(url: str) -> SpecCounters:
    """The server's speculative counters now.

    Raises:
        UserError: the server does not answer ``/metrics``.
    """
    try:
        return parse_spec_counters(_get(f"{url.rstrip('/')}/metrics"))
    except (urllib.error.URLError, OSError) as err:
        raise UserError(f"vLLM server at {url} did not answer /metrics: {err}") from err


@dataclass
class Completion:
    """One streamed greedy completion: its tokens, the time to the first one and in all."""

    token_ids: list[int]
    ttft: float
    seconds: float


def complete(url: str, model: str, ids: list[int], *, max_tokens: int) -> Completion:
    """One greedy request to ``{url}/v1/completions`` with the prompt as token ids, streamed.

    Raises:
        UserError: the server is unreachable or answers an error.
    """
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url.rstrip('/')}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    tokens: list[int] = []
    start, first = time.perf_counter(), None
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "choices" not in chunk:  # an error in the stream (the engine died, ...)
                    raise UserError(
                        f"vLLM at {url} failed mid-completion: {chunk.get('error', chunk)} "
                        "(its log says why)"
                    )
                delta = chunk["choices"][0].get("token_ids") or []
                if delta and first is None:
                    first = time.perf_counter() - start
                tokens += delta
    except urllib.error.HTTPError as err:
        detail = err.read()[:300]
        raise UserError(f"vLLM at {url} refused a completion: {err}: {detail!r}") from err
    except (urllib.error.URLError, OSError) as err:
        raise UserError(f"vLLM server at {url} did not answer /v1/completions: {err}") from err
    seconds = time.perf_counter() - start
    return Completion(tokens, seconds if first is None else first, seconds)


def served_model(url: str) -> str:
    """The first model name ``{url}/v1/models`` lists (a running server's, or ours)."""
    try:
        return json.loads(_get(f"{url.rstrip('/')}/v1/models"))["data"][0]["id"]
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as err:
        raise UserError(f"vLLM server at {url} did not list a model at /v1/models: {err}") from err


def server_version(url: str) -> str | None:
    try:
        return json.loads(_get(f"{url.rstrip('/')}/version"))["version"]
    except (urllib.error.URLError, OSError, KeyError, ValueError):
        return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(python: str, target: str, port: int, extra: list[str]) -> list[str]:
    """The command line that launches vLLM's OpenAI-compatible server on loopback."""
    return [
        python,
        *("-m", "vllm.entrypoints.openai.api_server"),
        *("--model", target, "--served-model-name", SERVED_NAME),
        *("--host", "127.0.0.1", "--port", str(port)),
        *DEFAULT_FLAGS,
        *extra,
    ]


@contextmanager
def launched_server(command: list[str], port: int, log: Path, *, timeout: float) -> Iterator[str]:
    """Run ``command`` (a vLLM server on ``port``) with its output in ``log``; yields its URL
    once ``/health`` answers, and stops it (its whole process group) on the way out, a SIGTERM
    to this process included (:func:`_sigterm_unwinds`); killed outright, this process takes
    the server with it (a parent-death signal, :mod:`specforge.processes`).

    Raises:
        UserError: the server exits or does not become healthy within ``timeout`` seconds
            (the log's last lines in the message).
    """
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as sink, _sigterm_unwinds():
        process = start_group(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_healthy(process, url, log, timeout)
            yield url
        finally:
            stop_group(process)


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While inside, a SIGTERM (``kill``, a scheduler's time limit) exits through the stack
    (``SystemExit(143)``) instead of ending the process where it stands, so the ``finally``
    that stops a launched server runs: the server leads its own process group (a terminal's
    Ctrl-C does not reach it), so nothing else would stop it. Python delivers signals to the
    main thread only; elsewhere this does nothing. The previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _exit_on_sigterm(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)


def _wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise UserError(
                f"the vLLM server exited ({process.returncode}) before answering; "
                f"its log {log} ends:\n{_tail(log)}"
            )
        try:
            _get(f"{url}/health", timeout=5)
            return
        except (urllib.error.URLError, OSError):
            time.sleep(2)
    raise UserError(
        f"the vLLM server at {url} was not healthy after {timeout:.0f} s "
        f"(bench.vllm_start_timeout_s); its log {log} ends:\n{_tail(log)}"
    )


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def ask_all(
    url: str,
    model: str,
    tokenizer,
    questions: list[BenchQuestion],
    *,
    max_new_tokens: int,
    system_prompt: str | None = None,
) -> list[dict[str, Any]]:
    """Every turn of ``questions`` through one server; a row per turn."""

    def answer(_turn, messages):
        done = complete(url, model, prompt_ids(tokenizer, messages), max_tokens=max_new_tokens)
        return tokenizer.decode(done.token_ids, skip_special_tokens=True), done

    rows = []
    for question in questions:
        for turn, _, done in ask_turns(question, answer, system_prompt=system_prompt):
            rows.append(
                {
                    "question_id": question.id,
                    "category": question.category,
                    "set": question.set,
                    "turn": turn,
                    "tokens": len(done.token_ids),
                    "token_ids": done.token_ids,
                    "ttft": done.ttft,
                    "seconds": done.seconds,
                }
            )
    return rows


def acceptance_per_position(counters: SpecCounters) -> list[float]:
    """P(draft token k accepted | tokens < k accepted), from vLLM's per-position counts."""
    rates, reached = [], counters.drafts
    for position in sorted(counters.per_position):
        accepted = counters.per_position[position]
        rates.append(accepted / reached if reached else 0.0)
        reached = accepted
    return rates


def first_difference(spec: dict[str, Any], base: dict[str, Any]) -> int:
    """The first position where two turns' tokens differ (the shorter's length if one is the
    other's prefix)."""
    ours, theirs = spec["token_ids"], base["token_ids"]
    pairs = zip(ours, theirs, strict=False)
    return next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ours), len(theirs)))


def vllm_report(
    spec: list[dict[str, Any]],
    base: list[dict[str, Any]] | None,
    counters: SpecCounters,
    settings: dict[str, Any],
) -> dict[str, Any]:
    """``bench.json`` for the vLLM engine: accept length and acceptance per position from
    vLLM's counters, tokens/s and time to first token with and without the draft, the speedup,
    and whether both servers gave the same tokens."""

    def ttft(rows):
        return sum(r["ttft"] for r in rows) / max(len(rows), 1)

    tau = 1 + counters.accepted / counters.drafts if counters.drafts else None
    return {
        "engine": "vllm",
        "tau": tau,
        "drafts": counters.drafts,
        "draft_tokens": counters.draft_tokens,
        "accepted_tokens": counters.accepted,
        "acceptance_per_position": acceptance_per_position(counters),
        **against_baseline(spec, base, "token_ids"),
        "ttft_s": {"speculative": ttft(spec), "baseline": ttft(base) if base else None},
        # where each differing turn first differs (in bf16 verification and decoding use
        # different kernels, so near-ties can flip: not by itself a fault of the draft)
        "first_differences": [
            {"question_id": s["question_id"], "turn": s["turn"], "position": first_difference(s, b)}
            for s, b in zip(spec, base or [], strict=False)
            if s["token_ids"] != b["token_ids"]
        ],
        "turns": len(spec),
        "settings": settings,
        "turn_details": spec,
        "baseline_turn_details": base,
    }
