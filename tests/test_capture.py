import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from specforge.config import TargetConfig, load_config
from specforge.data.hidden_states import (
    HiddenStateStore,
    last_hidden_positions,
    read_manifest,
    sample_bytes,
    verify_capture,
)
from specforge.models.target import load_target, target_hidden_states
from specforge.recipes.capture import capture
from tests.helpers import REPO, torchrun

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def write_conversations(path, count):
    with path.open("w") as f:
        for i in range(count):
            answer = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + (i * 5) % 17))
            messages = [
                {"role": "user", "content": f"question {i}: {WORDS[i % len(WORDS)]}?"},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return path


def capture_args(target, data, out, *extra):
    return [
        f"target.name_or_path={target}",
        "target.dtype=float32",
        f"data.inputs=[{data}]",
        f"capture.output={out}",
        "capture.dtype=float32",
        "capture.shard_size_mb=0.2",
        "capture.batch_tokens=256",
        *extra,
    ]


def shard_files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name[0] != "."}


def test_capture_stores_what_the_target_computes(tmp_path, tiny_target_dir):
    data = write_conversations(tmp_path / "data.jsonl", 40)
    out = tmp_path / "capture"
    result = capture(load_config(None, capture_args(tiny_target_dir, data, out)))
    manifest = read_manifest(out)
    assert result.shards_written == len(manifest["shards"]) > 3
    assert manifest["num_samples"] == 40 and manifest["aux_layer_ids"] == [1, 1, 0]
    assert verify_capture(out) == []

    model, _ = load_target(TargetConfig(str(tiny_target_dir), dtype="float32"))
    store = HiddenStateStore(out)
    samples = store.samples()
    assert sorted(s.id for s in samples) == sorted(f"c{i}" for i in range(40))
    hidden = model.config.hidden_size
    for s in samples[::7]:
        aux, last = store.hidden_states(s)
        states = target_hidden_states(model, s.input_ids[None], aux_layer_ids=[1, 1, 0])
        torch.testing.assert_close(aux, states.aux_hidden_states[0], rtol=1e-5, atol=1e-5)
        needed = last_hidden_positions(s.loss_mask)
        torch.testing.assert_close(
            last[needed], states.last_hidden_state[0][needed], rtol=1e-5, atol=1e-5
        )
        assert not last[~needed].any()
    # the tensor bytes are exactly the documented formula (+ the two offsets' extra entries per
    # shard); headers are the rest
    data_bytes = 0
    for entry in manifest["shards"]:
        blob = (out / entry["file"]).read_bytes()
        data_bytes += len(blob) - 8 - int.from_bytes(blob[:8], "little")
    formula = sum(
        sample_bytes(
            len(s.input_ids),
            int(last_hidden_positions(s.loss_mask).sum()),
            hidden_size=hidden,
            itemsize=4,
        )
        for s in samples
    )
    assert data_bytes == formula + 16 * len(manifest["shards"])
    assert manifest["bytes_per_token"] < 8 * hidden * 4  # aux + last hidden for every token


def test_rerun_keeps_complete_shards_and_redoes_the_rest(tmp_path, tiny_target_dir):
    data = write_conversations(tmp_path / "data.jsonl", 30)
    out = tmp_path / "capture"
    cfg = load_config(None, capture_args(tiny_target_dir, data, out))
    capture(cfg)
    before = shard_files(out)
    assert capture(cfg).shards_written == 0
    assert shard_files(out) == before  # manifest rewritten byte for byte

    # a lost entry (a kill between the shard's rename and its entry's) redoes just that shard
    (out / "shard-00002.json").unlink()
    (out / "manifest.json").unlink()
    again = capture(cfg)
    shards = len(read_manifest(out)["shards"])
    assert (again.shards_written, again.shards_skipped) == (1, shards - 1)
    assert shard_files(out) == before

    # a corrupted shard is caught by --verify
    blob = bytearray((out / "shard-00001.safetensors").read_bytes())
    blob[-3] ^= 0xFF
    (out / "shard-00001.safetensors").write_bytes(bytes(blob))
    assert verify_capture(out) == ["shard-00001.safetensors: sha256 differs from the manifest"]

    # other settings into the same directory are refused, nothing is overwritten
    other = load_config(
        None, capture_args(tiny_target_dir, data, out, "target.aux_layer_ids=[0,1,2]")
    )
    with pytest.raises(ValueError, match="from a different capture"):
        capture(other)


def run_capture_cli(target, data, out):
    cmd = [sys.executable, "-m", "specforge.cli", "capture", "--max-length", "64"]
    cmd += capture_args(target, data, out, "capture.max_batch_size=1")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


@pytest.mark.integration
def test_sigkill_at_any_moment_then_rerun_matches_an_uninterrupted_capture(
    tmp_path, tiny_target_dir
):
    data = write_conversations(tmp_path / "data.jsonl", 400)
    full = tmp_path / "full"
    assert run_capture_cli(tiny_target_dir, data, full).wait() == 0
    entries = len(read_manifest(full)["shards"])
    assert entries > 10

    out = tmp_path / "killed"
    for kill_after in (2, entries // 2):  # two kills at different points, then a clean rerun
        process = run_capture_cli(tiny_target_dir, data, out)
        while len(list(out.glob("shard-*.json"))) < kill_after and process.poll() is None:
            time.sleep(0.002)
        process.send_signal(signal.SIGKILL)
        process.wait()
        assert not (out / "manifest.json").exists(), "the capture finished before the kill"
    assert run_capture_cli(tiny_target_dir, data, out).wait() == 0
    assert shard_files(out) == shard_files(full)
    assert verify_capture(out) == []


@pytest.mark.integration
def test_two_process_capture_matches_one_process(tmp_path, tiny_target_dir):
    data = write_conversations(tmp_path / "data.jsonl", 40)
    one, two = tmp_path / "one", tmp_path / "two"
    torchrun(1, "scripts/capture_hidden_states.py", *capture_args(tiny_target_dir, data, one))
    torchrun(2, "scripts/capture_hidden_states.py", *capture_args(tiny_target_dir, data, two))
    assert read_manifest(one) == read_manifest(two)
    for entry in read_manifest(one)["shards"]:
        with safe_open(one / entry["file"], "pt") as a, safe_open(two / entry["file"], "pt") as b:
            for key in a.keys():
                torch.testing.assert_close(a.get_tensor(key), b.get_tensor(key), rtol=0, atol=0)
