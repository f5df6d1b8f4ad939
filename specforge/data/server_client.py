"""Self-distillation through a running OpenAI-compatible server (``regenerate.backend: server``):
what SGLang (``python -m sglang.launch_server``) and vLLM (``vllm serve``) serve at
``/v1/chat/completions``, and how GPU users regenerate ShareGPT / UltraChat at scale.

Each conversation is one worker's job, turn by turn (turn ``j`` is asked with the server's own
answers to turns ``< j``); ``regenerate.concurrency`` conversations are in flight. A request that
fails for a reason that may pass (the connection refused or reset, HTTP 429 or 5xx, a body cut
short or not JSON) is retried ``regenerate.retries`` times with exponential backoff; any other
answer (HTTP 4xx, a reply without a message) is an error at once. On an error, what finished is
already in the sidecar, so a rerun continues where this one stopped.

The server's chat template renders the messages; token ids are not part of the OpenAI answer, so
these records carry no ``meta.token_ids`` and training tokenizes their text.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from specforge.errors import UserError


class RetryableError(Exception):
    """A failure that may pass: refused connection, 429 / 5xx, a truncated or non-JSON body."""


@dataclass
class ChatAnswer:
    text: str
    finish_reason: str
    """``stop`` or ``length`` (as the server says)."""
    completion_tokens: int


class ChatClient:
    """POSTs to ``{base_url}/chat/completions`` with retries."""

    def __init__(
        self,
        base_url: str,
        *,
        model: str,
        max_tokens: int,
        temperature: float,
        top_p: float,
        retries: int = 4,
        backoff_s: float = 1.0,
        timeout_s: float = 600.0,
    ):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s

    def answer(self, messages: list[dict[str, str]], seed: int | None = None) -> ChatAnswer:
        """The server's answer to ``messages``.

        Raises:
            UserError: the server kept failing, or answered something that is not a chat
                completion; the message names the URL and the last problem.
        """
        body = {"model": self.model, "messages": messages, **self.sampling}
        if seed is not None:
            body["seed"] = seed
        problem = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return parse_completion(self._post(body), self.url)
            except RetryableError as err:
                problem = str(err)
        raise UserError(f"{self.url}: no answer after {self.retries + 1} tries ({problem})")

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode("utf-8", "replace")
            if err.code == 429 or err.code >= 500:
                raise RetryableError(f"HTTP {err.code}: {detail}") from None
            raise UserError(f"{self.url}: HTTP {err.code}: {detail}") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
            raise RetryableError(f"{type(err).__name__}: {err}") from None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RetryableError(f"the body is not JSON ({len(raw)} bytes)") from None


def parse_completion(payload: Any, url: str) -> ChatAnswer:
    """The first choice of an OpenAI chat completion.

    Raises:
        UserError: the payload is not one, or its content is empty (an empty answer would be
            written as the target's own).
    """
    try:
        choice = payload["choices"][0]
        text = choice["message"]["content"]
        finish_reason = choice.get("finish_reason") or "stop"
    except (KeyError, IndexError, TypeError):
        raise UserError(f"{url}: not a chat completion: {json.dumps(payload)[:300]}") from None
    if not isinstance(text, str):
        raise UserError(f"{url}: the answer has no text content")
    tokens = (payload.get("usage") or {}).get("completion_tokens") or 0
    if not text.strip():
        elsewhere = [k for k in ("reasoning_content", "reasoning") if choice["message"].get(k)]
        where = f" (its text is in {elsewhere[0]!r})" if elsewhere else ""
        raise UserError(
            f"{url}: the answer's content is empty{where} after {tokens} generated tokens; a "
            "server whose reasoning parser moves the text out of 'content' cannot self-distill: "
            "serve the target without one"
        )
    return ChatAnswer(text.strip(), finish_reason, int(tokens))
