"""The CPU decode attention kernel gives SDPA's attention (float32 to its rounding, bf16 within
bf16's), over strided cache views and masks with holes and at realistic shapes, and is used
only where asked; its build survives a kill and a time limit, and it checks every input."""

import os
import platform
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from specforge.engine.cpu.decode_kernel import (
    NAME,
    build_decode_kernel,
    build_directory,
    exclusive,
    kernel_decode_attention,
)
from specforge.errors import UserError
from tests.helpers import kernel_or_skip


def decode_inputs(rows, heads, kv_heads, size, columns, dtype, seed=0):
    """A decode query and views of wider key/value buffers (as the growing cache holds them),
    a mask with left padding per row and a hole."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, heads, 1, size, generator=generator).to(dtype)
    buffers = torch.randn(2, rows, kv_heads, columns + 40, size, generator=generator).to(dtype)
    key, value = buffers[0][:, :, :columns], buffers[1][:, :, :columns]
    mask = torch.ones(rows, 1, 1, columns, dtype=torch.bool)
    for row in range(rows):
        mask[row, ..., : (row * 7) % columns] = False  # left padding, none in row 0
    mask[-1, ..., columns // 2] = False  # a hole
    return query, key, value, mask


def sdpa(query, key, value, mask):
    """HF's result layout (B, 1, H, D), computed in float32."""
    out = F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize(
    "dtype, heads, kv_heads, size",
    [
        (torch.float32, 9, 3, 64),
        (torch.float32, 4, 4, 128),
        (torch.float32, 32, 4, 128),
        (torch.bfloat16, 9, 3, 64),
        (torch.bfloat16, 16, 2, 64),
    ],
)
def test_kernel_gives_sdpas_attention(dtype, heads, kv_heads, size):
    kernel_or_skip()
    query, key, value, mask = decode_inputs(6, heads, kv_heads, size, 53, dtype)
    out = kernel_decode_attention(query, key, value, mask, None, mode="on")
    assert out.dtype == dtype and out.shape == (6, 1, heads, size)
    reference = sdpa(query, key, value, mask)
    tolerance = 2e-6 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.float(), reference, atol=tolerance, rtol=tolerance)


def test_kernel_takes_a_scale_and_a_missing_or_broadcast_mask():
    kernel_or_skip()
    query, key, value, _ = decode_inputs(3, 9, 3, 64, 20, torch.float32)
    reference = F.scaled_dot_product_attention(query, key, value, enable_gqa=True, scale=0.3)
    unmasked = kernel_decode_attention(query, key, value, None, 0.3, mode="on")
    broadcast = torch.ones(1, 1, 1, 20, dtype=torch.bool)
    shared = kernel_decode_attention(query, key, value, broadcast, 0.3, mode="on")
    for out in (unmasked, shared):
        torch.testing.assert_close(out, reference.transpose(1, 2), atol=2e-6, rtol=2e-6)


def test_kernel_runs_only_where_asked():
    query, key, value, mask = decode_inputs(2, 9, 3, 64, 10, torch.float32)
    assert kernel_decode_attention(query, key, value, mask, None) is None  # off by default
    assert kernel_decode_attention(query, key, value, mask, None, mode="off") is None
    # a head size it lacks: SDPA instead
    short = (query[..., :32], key[..., :32], value[..., :32], mask, None)
    assert kernel_decode_attention(*short, mode="auto") is None


def test_kernel_on_refuses_what_it_cannot_run():
    query, key, value, mask = decode_inputs(2, 9, 3, 32, 10, torch.float32)
    with pytest.raises(UserError, match="head sizes.*not 32"):
        kernel_decode_attention(query, key, value, mask, None, mode="on")
    with pytest.raises(ValueError, match="one of .*'sometimes'"):
        kernel_decode_attention(query, key, value, mask, None, mode="sometimes")


# -- the build: a time limit, stale locks, a folder per source ----------------------------------


def start_build(directory):
    """The build subprocess the loader runs, started by hand so that a test can kill it."""
    return subprocess.Popen(
        [sys.executable, "-m", "specforge.engine.cpu.decode_kernel", str(directory)],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


@pytest.mark.integration
def test_a_build_killed_half_way_does_not_hang_the_next_one(tmp_path, monkeypatch):
    """SIGKILL a real build while it holds PyTorch's lock, as a kill during a resumed run does:
    the lock stays behind (PyTorch's own loader would wait on it forever), and the next build
    clears it, builds and loads the kernel."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = build_directory()
    assert directory.parent == tmp_path and directory.name.startswith(f"{NAME}-")
    directory.mkdir(parents=True)
    builder = start_build(directory)
    deadline = time.monotonic() + 120
    while not (directory / "lock").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (directory / "lock").exists(), "the build never took its lock"
    os.killpg(builder.pid, signal.SIGKILL)
    builder.wait()
    assert (directory / "lock").exists()
    module = build_decode_kernel(timeout_s=900)
    assert callable(module.decode_attention)
    assert not (directory / "lock").exists()


def test_a_build_past_its_time_limit_is_stopped_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with pytest.raises(UserError, match="building it took more than 1 s"):
        build_decode_kernel(timeout_s=1)
    assert not (build_directory() / "lock").exists()


HOLDER = """
import sys, time
from pathlib import Path
from specforge.engine.cpu.decode_kernel import exclusive
with exclusive(Path(sys.argv[1]), 5):
    print("held", flush=True)
    time.sleep(600)
"""


def test_the_build_lock_waits_a_bounded_time_and_dies_with_its_holder(tmp_path, monkeypatch):
    """A process holding the folder's lock (building or loading) makes another wait, for a
    bounded time and then with a message naming the lock; killed outright, its lock goes with
    it (an ``flock``: no process ids to judge, no stale file to remove)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = build_directory()
    directory.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=r"waited 1 s for another process .*/specforge.lock"):
            build_decode_kernel(timeout_s=1)
        assert not (directory / f"{NAME}.so").exists()  # it waited: nothing was built
    finally:
        holder.kill()
        holder.wait()
    with exclusive(directory, 0):  # free at once
        pass


# -- the kernel trusts no caller ----------------------------------------------------------------


@pytest.fixture(scope="module")
def kernel_module():
    """The built module, on any x86-64 CPU (its import runs no AVX-512 code)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the kernel is built for x86-64")
    return build_decode_kernel()


def good_inputs(dtype=torch.float32):
    q = torch.randn(3, 2, 4, 64).to(dtype)  # (B, H_kv, G, D)
    k, v = torch.randn(2, 3, 2, 10, 64).to(dtype)  # (B, H_kv, S, D)
    return q, k, v, torch.ones(3, 10, dtype=torch.bool)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda q, k, v, m: (q, k[:2], v, m), "q has 3 rows, k 2"),
        (lambda q, k, v, m: (q, k, v[:2], m), "q has 3 rows, k 3, v 2"),
        (lambda q, k, v, m: (q, k, v, m[:2]), "the mask 2"),
        (lambda q, k, v, m: (q, k[:, :1], v, m), "q has 2 key heads, k 1"),
        (
            lambda q, k, v, m: (q, k, torch.randn(3, 2, 10, 128), m),
            "head size is 64, k's 64, v's 128",
        ),
        (lambda q, k, v, m: (q, k[..., :32], v, m), "k's 32"),
        (lambda q, k, v, m: (q, k, v[:, :, :7], m), "k has 10 positions, v 7"),
        (lambda q, k, v, m: (q, k, v, m[:, :9]), "the mask 9"),
        (lambda q, k, v, m: (q, k, v, m[None]), "a mask of 2"),
        (lambda q, k, v, m: (q, k.to("meta"), v, m), "every tensor on the CPU"),
        (lambda q, k, v, m: (q, k, v, m.float()), "a boolean mask"),
        (lambda q, k, v, m: (q, k.double(), v, m), "one dtype"),
        (lambda q, k, v, m: (q.repeat(1, 1, 3, 1), k, v, m), "12 query heads per key head"),
    ],
)
def test_every_shape_relation_is_checked_before_the_kernel_runs(kernel_module, bad, message):
    """Each mismatch is an error naming it, never a read out of bounds."""
    with pytest.raises(RuntimeError, match=re.escape(message)):
        kernel_module.decode_attention(*bad(*good_inputs()), 0.125)


def test_a_cpu_without_avx512_gets_an_error_not_a_crash(kernel_module):
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        pytest.skip("this CPU runs the kernel")
    with pytest.raises(RuntimeError, match="no AVX-512F"):
        kernel_module.decode_attention(*good_inputs(), 0.125)


# -- realistic shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "heads", "kv_heads", "size", "columns"),
    [(256, 8, 2, 128, 2048), (256, 9, 3, 64, 700), (4, 32, 8, 128, 1)],
    ids=["256-rows-2k-keys-llama3-8b-group", "smollm2-group", "one-key"],
)
def test_kernel_at_realistic_shapes(rows, heads, kv_heads, size, columns):
    """256 rows over 2k keys at Llama-3-8B's group of 4 and head size 128, SmolLM2's shape, and
    a single key; a fully masked row gives zeros (SDPA gives NaN there), large scores stay
    finite."""
    kernel_or_skip()
    query, key, value, mask = decode_inputs(rows, heads, kv_heads, size, columns, torch.bfloat16)
    query = query * 30  # large scores: the softmax subtracts the row's maximum
    if columns > 1:
        mask[1] = False  # a row with no key at all
    out = kernel_decode_attention(query, key, value, mask, None, mode="on")
    assert torch.isfinite(out).all()
    reference = sdpa(query, key, value, mask)
    live = [r for r in range(rows) if mask[r].any()]
    torch.testing.assert_close(out[live].float(), reference[live], atol=2e-2, rtol=2e-2)
    if columns > 1:
        assert (out[1] == 0).all()
