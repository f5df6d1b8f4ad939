"""A loopback stand-in for vLLM's OpenAI-compatible server, for the bench's vLLM client: the
endpoints and formats the client reads (``/health``, ``/version``, ``/v1/models``, Prometheus
``/metrics``, streamed ``/v1/completions`` with ``return_token_ids``), answering a fixed rule.

Each completion answers the prompt's last tokens, reversed, up to ``max_tokens``, two tokens a
chunk (after ``dead`` is set, the stream carries the error object vLLM sends when its engine
dies); a speculative stand-in counts, per completion of ``n`` tokens, ``n`` drafts of 3 tokens,
``n // 2`` accepted at position 0 and ``n // 4`` at position 1 (on top of counts it starts with,
as a server that has already served does).

    python tests/serving/vllm_standin.py --port 8123 [--speculative]
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

START = {"drafts": 100.0, "draft_tokens": 300.0, "accepted": 40.0, "pos0": 30.0, "pos1": 10.0}


def answer(prompt: list[int], max_tokens: int) -> list[int]:
    return list(reversed(prompt))[:max_tokens]


class StandIn(ThreadingHTTPServer):
    def __init__(self, port: int, speculative: bool):
        super().__init__(("127.0.0.1", port), Handler)
        self.speculative = speculative
        self.counts = dict(START) if speculative else {}
        self.lock = threading.Lock()
        self.dead = False

    def count(self, n: int) -> None:
        if not self.speculative:
            return
        with self.lock:
            self.counts["drafts"] += n
            self.counts["draft_tokens"] += 3 * n
            self.counts["pos0"] += n // 2
            self.counts["pos1"] += n // 4
            self.counts["accepted"] += n // 2 + n // 4

    def metrics(self) -> str:
        lines = [
            "# HELP vllm:num_requests_running Requests running.",
            "# TYPE vllm:num_requests_running gauge",
        ]
        lines.append('vllm:num_requests_running{model_name="target"} 0.0')
        if self.speculative:
            c = self.counts
            for name, key in (
                ("vllm:spec_decode_num_drafts", "drafts"),
                ("vllm:spec_decode_num_draft_tokens", "draft_tokens"),
                ("vllm:spec_decode_num_accepted_tokens", "accepted"),
            ):
                lines += [
                    f"# TYPE {name} counter",
                    f'{name}_total{{engine="0",model_name="target"}} {c[key]}',
                ]
                lines.append(f'{name}_created{{engine="0",model_name="target"}} 1.7e9')
            name = "vllm:spec_decode_num_accepted_tokens_per_pos"
            lines.append(f"# TYPE {name} counter")
            for position, key in (("0", "pos0"), ("1", "pos1"), ("2", None)):
                value = c[key] if key else 0.0
                lines.append(
                    f'{name}_total{{engine="0",model_name="target",position="{position}"}} {value}'
                )
        return "\n".join(lines) + "\n"


class Handler(BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, *args) -> None:
        pass

    def send(self, body: str, content_type: str = "application/json") -> None:
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        routes = {
            "/health": lambda: "",
            "/version": lambda: json.dumps({"version": "stand-in"}),
            "/v1/models": lambda: json.dumps({"data": [{"id": "target"}]}),
            "/metrics": self.server.metrics,
        }
        if self.path not in routes:
            self.send_error(404)
            return
        self.send(
            routes[self.path](), "text/plain" if self.path == "/metrics" else "application/json"
        )

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions" or body.get("model") != "target":
            self.send_error(404 if self.path != "/v1/completions" else 400)
            return
        tokens = answer(body["prompt"], body["max_tokens"])
        self.server.count(len(tokens))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for start in range(0, len(tokens), 2):
            chunk = {"choices": [{"index": 0, "text": "x", "token_ids": tokens[start : start + 2]}]}
            if self.server.dead:
                chunk = {"error": {"message": "EngineCore encountered an issue.", "code": 500}}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def serve_in_thread(speculative: bool) -> tuple[StandIn, str]:
    """A stand-in on a free loopback port, served from a daemon thread; returns it and its URL."""
    server = StandIn(0, speculative)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--speculative", action="store_true")
    args, _ = parser.parse_known_args()
    StandIn(args.port, args.speculative).serve_forever()
