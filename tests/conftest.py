"""Shared fixtures over the builders in :mod:`tests.helpers`, and the test markers: every test
not marked ``integration`` (torchrun launches, process kills) or ``slow`` (the real SmolLM2,
minutes of CPU) is a ``unit`` test, the fast inner loop (``pytest -m unit``)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import (
    VLLM_ENV,
    VLLM_PIN,
    install_vllm,
    make_tiny_llama,
    make_tiny_tokenizer,
    vllm_version,
    write_peaked_target,
)


def share_the_cores() -> None:
    """pytest-xdist's workers (pyproject's addopts) share the cores: each takes its share of
    threads, and so do the processes it launches (oversubscribed OpenMP threads spin)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers:
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


share_the_cores()


def pytest_collection_modifyitems(items):
    for item in items:
        if not any(item.get_closest_marker(m) for m in ("integration", "slow")):
            item.add_marker(pytest.mark.unit)


@pytest.fixture
def tiny_tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_target(tiny_tokenizer):
    """(model, tokenizer): a 4-layer random Llama over the tiny tokenizer's vocabulary."""
    eos = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    return make_tiny_llama(len(tiny_tokenizer), eos_token_id=eos), tiny_tokenizer


@pytest.fixture
def tiny_target_dir(tmp_path, tiny_target):
    """The tiny target saved as an HF folder (model + tokenizer), loadable by path."""
    model, tokenizer = tiny_target
    folder = tmp_path / "tiny-target"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture
def peaked_target_dir(tmp_path):
    """A tiny random target with large weights (a peaked, learnable next-token distribution)
    and a small memorizable conversation set."""
    return write_peaked_target(tmp_path)


@pytest.fixture(scope="package")
def vllm_python() -> str:
    """An interpreter with the pinned vLLM: ``SPECFORGE_VLLM_PYTHON``, else the suite's own
    environment (:data:`VLLM_ENV`), installed on first use where ``SPECFORGE_VLLM_INSTALL=1``
    (a few minutes from the package index); skipped, with the reason, otherwise."""
    given = os.environ.get("SPECFORGE_VLLM_PYTHON")
    if given:
        return given
    python = VLLM_ENV / "bin" / "python"
    pinned = VLLM_PIN.split("==")[1]
    if vllm_version(python) != pinned:
        if os.environ.get("SPECFORGE_VLLM_INSTALL") != "1":
            pytest.skip(
                f"no vLLM environment: set SPECFORGE_VLLM_PYTHON, or SPECFORGE_VLLM_INSTALL=1 "
                f"to install {VLLM_PIN} into {VLLM_ENV}"
            )
        failed = install_vllm(VLLM_ENV)
        if failed or vllm_version(python) != pinned:
            pytest.skip(f"{VLLM_PIN} could not be installed here: {failed}")
    return str(python)
