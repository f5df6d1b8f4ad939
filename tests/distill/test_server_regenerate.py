"""Self-distillation through an OpenAI-compatible server: a real HTTP server on loopback (this
test's own), the real CLI, and the faults a server gives: HTTP errors, a body cut short, a
refused connection. Nothing already written is lost."""

import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specforge.cli import main
from specforge.distill.regenerate import partial_path


class ChatServer(ThreadingHTTPServer):
    """Answers ``POST /v1/chat/completions`` with "re: <last user text>"; ``faults`` lists what
    to do with the next requests (``ok``, ``500``, ``400``, ``cut``, ``garbage``, ``empty``: the
    text in ``reasoning_content`` as a reasoning parser puts it, ``slow``: answer after 2 s),
    then ``ok``."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.faults: list[str] = []
        self.requests: list[dict] = []
        self.lock = threading.Lock()

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], BrokenPipeError | ConnectionResetError):
            super().handle_error(request, client_address)  # a client that gave up is expected

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append(body)
            fault = self.server.faults.pop(0) if self.server.faults else "ok"
        if self.path != "/v1/chat/completions":
            fault = "404"
        if fault in ("500", "400", "404"):
            self.send_response(int(fault))
            self.end_headers()
            self.wfile.write(b'{"error": "injected"}')
            return
        question = body["messages"][-1]["content"]
        message = {"role": "assistant", "content": f"re: {question}"}
        if fault == "empty":
            message = {**message, "content": "", "reasoning_content": message["content"]}
        if fault == "slow":
            time.sleep(2)
        answer = {
            "choices": [{"message": message, "finish_reason": "stop"}],
            "usage": {"completion_tokens": 3},
        }
        payload = json.dumps(answer).encode()
        if fault == "garbage":
            payload = b"<html>proxy error</html>"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload) + (50 if fault == "cut" else 0)))
        self.end_headers()
        self.wfile.write(payload[: len(payload) // 2] if fault == "cut" else payload)


@pytest.fixture
def server():
    httpd = ChatServer()
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def conversations(tmp_path):
    data = tmp_path / "in.jsonl"
    rows = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": f"question {i}"}]}
        for i in range(6)
    ]
    rows[2]["messages"] += [
        {"role": "assistant", "content": "OLD"},
        {"role": "user", "content": "and a follow-up"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def prepare(target, data, out, url, *extra):
    return main(
        ["prepare", "--target", str(target), "--data", str(data), "--output", str(out)]
        + ["--server-url", url, "regenerate.concurrency=3", "regenerate.retries=2"]
        + ["regenerate.retry_backoff_s=0.01", *extra]
    )


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_answers_come_from_the_server_turn_by_turn(
    tmp_path, tiny_target_dir, server, conversations
):
    out = tmp_path / "out.jsonl"
    assert prepare(tiny_target_dir, conversations, out, server.url) == 0
    records = read(out)
    assert [r["id"] for r in records] == [f"c{i}" for i in range(6)]  # input order
    two = records[2]["messages"]
    assert [m["content"] for m in two] == [
        "question 2",
        "re: question 2",
        "and a follow-up",
        "re: and a follow-up",
    ]
    follow_up = next(
        r for r in server.requests if r["messages"][-1]["content"] == "and a follow-up"
    )
    assert follow_up["messages"][1] == {"role": "assistant", "content": "re: question 2"}  # its own
    assert all(
        r["model"] == str(tiny_target_dir) and r["temperature"] == 0.0 for r in server.requests
    )
    assert "token_ids" not in records[0]["meta"]  # the server gives text only


def test_passing_failures_are_retried(tmp_path, tiny_target_dir, server, conversations):
    server.faults = ["500", "cut", "garbage"]
    out = tmp_path / "out.jsonl"
    args = ("regenerate.concurrency=1", "regenerate.retries=3")
    assert prepare(tiny_target_dir, conversations, out, server.url, *args) == 0
    assert len(read(out)) == 6 and len(server.requests) == 7 + 3


def test_an_http_error_is_clear_and_loses_nothing(
    tmp_path, tiny_target_dir, server, conversations, capsys
):
    out = tmp_path / "out.jsonl"
    server.faults = ["ok", "ok", "400"]
    code = prepare(tiny_target_dir, conversations, out, server.url, "regenerate.concurrency=1")
    err = capsys.readouterr().err
    assert code == 2 and "HTTP 400" in err and server.url in err
    kept = read(partial_path(out))
    assert [r["id"] for r in kept] == ["c0", "c1"] and not out.exists()
    asked = len(server.requests)
    assert prepare(tiny_target_dir, conversations, out, server.url) == 0  # rerun resumes
    assert [r["id"] for r in read(out)] == [f"c{i}" for i in range(6)]
    assert len(server.requests) - asked == 5  # c2 (two turns) .. c5, nothing redone


def test_a_refused_connection_is_clear(tmp_path, tiny_target_dir, conversations, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    out = tmp_path / "out.jsonl"
    url = f"http://127.0.0.1:{port}/v1"
    assert prepare(tiny_target_dir, conversations, out, url, "regenerate.retries=0") == 2
    err = capsys.readouterr().err
    assert "no answer after 1 tries" in err and "refused" in err.lower()
    assert not out.exists()


def test_cut_bodies_that_never_recover_are_an_error(
    tmp_path, tiny_target_dir, server, conversations, capsys
):
    server.faults = ["cut"] * 10
    out = tmp_path / "out.jsonl"
    args = ("regenerate.concurrency=1", "regenerate.retries=1")
    assert prepare(tiny_target_dir, conversations, out, server.url, *args) == 2
    assert "no answer after 2 tries" in capsys.readouterr().err


def test_an_empty_answer_is_refused_not_written(
    tmp_path, tiny_target_dir, server, conversations, capsys
):
    """A server whose reasoning parser moves the text out of ``content`` answers with empty
    content: that is an error naming where the text went, and no empty answer is written."""
    server.faults = ["empty"] * 20
    out = tmp_path / "out.jsonl"
    assert prepare(tiny_target_dir, conversations, out, server.url) == 2
    err = capsys.readouterr().err
    assert "the answer's content is empty (its text is in 'reasoning_content')" in err
    assert not out.exists()
    assert not partial_path(out).exists() or read(partial_path(out)) == []


def test_the_request_timeout_is_a_setting(tmp_path, tiny_target_dir, server, conversations, capsys):
    server.faults = ["slow"] * 20
    out = tmp_path / "out.jsonl"
    args = ("regenerate.retries=0", "regenerate.request_timeout_s=0.3")
    assert prepare(tiny_target_dir, conversations, out, server.url, *args) == 2
    err = capsys.readouterr().err
    assert "no answer after 1 tries" in err and "timed out" in err.lower()
