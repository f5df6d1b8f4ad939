"""The ``capture`` recipe: run the frozen target once over the training data and store what the
TTT loss needs on disk (:mod:`specforge.data.hidden_states`), for offline training.

1. load the target and tokenize the conversations (as training would: same template, mask,
   ``data.max_length``);
2. plan the shards (sorted by length, ``capture.shard_size_mb`` each) and find the complete ones;
3. refuse to start when the disk cannot hold what is left;
4. capture this rank's incomplete shards (rank ``r`` of ``W`` owns shards ``r, r + W, ...``),
   in batches of similar length, each shard written atomically and then its manifest entry;
5. rank 0 merges the entries into ``manifest.json`` (also on a rerun with nothing left to do).

Run it again after any interruption with the same command: complete shards are kept, the rest
is redone. Under ``torchrun --nproc_per_node=N`` every rank captures a disjoint subset.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specforge.config import SpecForgeConfig
from specforge.config.resolve import torch_dtype
from specforge.data import hidden_states as store
from specforge.data.batching import collate
from specforge.data.chat import (
    TokenizedSample,
    pad_id_of,
    set_chat_template,
    tokenize_conversations,
)
from specforge.data.sources import load_conversations, require_prepared
from specforge.distributed import Distributed, setup_distributed
from specforge.models.adapter import LogitTransform, check_logits, text_config
from specforge.models.target import (
    load_target,
    resolve_aux_layer_ids,
    target_fingerprint,
    target_hidden_states,
)
from specforge.recipes.stage import start_stage

logger = logging.getLogger(__name__)


@dataclass
class CaptureResult:
    """What a capture run did (the manifest says what the directory holds)."""

    directory: Path
    manifest: Path | None
    """``manifest.json`` (written by rank 0), ``None`` on other ranks."""
    shards_written: int = 0
    shards_skipped: int = 0
    tokens_captured: int = 0
    seconds: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)


def capture_header(
    cfg: SpecForgeConfig, fingerprint: dict, aux_layer_ids: list[int], transform: LogitTransform
) -> dict:
    """The manifest fields that fix a capture's content (all part of every shard's plan hash),
    with the logit transform measured on the target (offline training applies it)."""
    return {
        "format": store.FORMAT,
        "version": store.VERSION,
        "target": fingerprint,
        "aux_layer_ids": aux_layer_ids,
        "dtype": cfg.capture.dtype,
        "max_length": cfg.data.max_length,
        "chat_template": cfg.data.chat_template,
        "system_prompt": cfg.data.system_prompt,
        "shard_size_mb": cfg.capture.shard_size_mb,
        "target_dtype": cfg.target.dtype,
        "logit_transform": transform.as_dict(),
        "layout": (
            "input_ids int32 (N), loss_mask bool (N), offsets int64 (S+1), "
            "aux_hidden_states (N, 3H), last_hidden_state (M, H) at positions p with "
            "loss_mask[p+1], last_offsets int64 (S+1)"
        ),
    }


def capture_sources(cfg: SpecForgeConfig) -> list[str]:
    """``data.inputs`` when given, else the conversations training reads (which
    ``specforge prepare`` writes)."""
    if cfg.data.inputs:
        return list(cfg.data.inputs)
    return [str(require_prepared(cfg.training_data_path))]


@torch.no_grad()
def capture_shard(
    model,
    samples: list[TokenizedSample],
    *,
    aux_layer_ids: list[int],
    dtype: torch.dtype,
    batch_tokens: int,
    max_batch_size: int,
    pad_id: int,
    progress: tqdm | None = None,
) -> bytes:
    """Run the target over one shard's samples (sorted longest first) and serialize them."""
    device = next(model.parameters()).device
    aux_states: list[torch.Tensor] = []
    last_states: list[torch.Tensor] = []
    lengths = [len(s.input_ids) for s in samples]
    for batch in store.forward_batches(
        lengths, batch_tokens=batch_tokens, max_batch_size=max_batch_size
    ):
        padded = collate([samples[i] for i in batch], pad_id).to(device)
        states = target_hidden_states(
            model, padded.input_ids, padded.attention_mask, aux_layer_ids=aux_layer_ids
        )
        for row, i in enumerate(batch):
            aux_states.append(states.aux_hidden_states[row, : lengths[i]].to("cpu", dtype))
            last_states.append(states.last_hidden_state[row, : lengths[i]].to("cpu", dtype))
        if progress is not None:
            progress.update(sum(lengths[i] for i in batch))
    return store.encode_shard(samples, aux_states, last_states)


def capture(cfg: SpecForgeConfig) -> CaptureResult:
    """Run the capture stage described by ``cfg`` (see the module docstring)."""
    cfg = start_stage(cfg)
    clock = time.perf_counter()
    ranks = setup_distributed(cfg.target.device)
    try:
        result = _capture(cfg, ranks)
    finally:
        ranks.close()
    result.seconds = time.perf_counter() - clock
    return result


def _capture(cfg: SpecForgeConfig, ranks: Distributed) -> CaptureResult:
    directory = cfg.capture_dir
    result = CaptureResult(directory=directory, manifest=None)
    # 1. target and data
    model, tokenizer = load_target(cfg.target, device=ranks.device(cfg.target.device))
    set_chat_template(tokenizer, cfg.data.chat_template)
    aux_layer_ids = resolve_aux_layer_ids(
        cfg.target.aux_layer_ids, text_config(model.config).num_hidden_layers
    )
    conversations = load_conversations(
        capture_sources(cfg), fmt=cfg.data.format, split=cfg.data.split, limit=cfg.data.limit
    )
    samples, stats = tokenize_conversations(
        tokenizer,
        conversations,
        max_length=cfg.data.max_length,
        system_prompt=cfg.data.system_prompt,
    )
    result.stats = stats.as_dict()
    # 2. plan, and what is already done
    fingerprint = target_fingerprint(model.config, tokenizer, cfg.target.name_or_path)
    dtype = torch_dtype(cfg.capture.dtype)
    plan = store.plan_shards(
        samples,
        header=capture_header(cfg, fingerprint, aux_layer_ids, check_logits(model)),
        hidden_size=text_config(model.config).hidden_size,
        itemsize=dtype.itemsize,
        shard_bytes=int(cfg.capture.shard_size_mb * 2**20),
    )
    hashes = [
        plan.plan_hash(n, [samples[i].id for i in shard]) for n, shard in enumerate(plan.shards)
    ]
    directory.mkdir(parents=True, exist_ok=True)
    done = {n for n, h in enumerate(hashes) if store.complete_entry(directory, n, h) is not None}
    todo = [n for n in range(ranks.rank, len(plan.shards), ranks.world_size) if n not in done]
    result.shards_skipped = sum(1 for n in done if n % ranks.world_size == ranks.rank)
    # 3. room on disk
    if ranks.is_main:
        store.remove_temp_files(directory)
        store.check_disk_space(
            directory, sum(b for n, b in enumerate(plan.shard_bytes) if n not in done)
        )
    ranks.barrier()
    # 4. this rank's shards
    total_gib = sum(plan.shard_bytes) / 2**30
    progress = tqdm(
        total=sum(len(samples[i].input_ids) for n in todo for i in plan.shards[n]),
        unit="tok",
        unit_scale=True,
        desc=f"capture ({len(plan.shards)} shards, ~{total_gib:.2f} GiB in all)",
        disable=not ranks.is_main,
    )
    for n in todo:
        shard_samples = [samples[i] for i in plan.shards[n]]
        payload = capture_shard(
            model,
            shard_samples,
            aux_layer_ids=aux_layer_ids,
            dtype=dtype,
            batch_tokens=cfg.capture.batch_tokens,
            max_batch_size=cfg.capture.max_batch_size,
            pad_id=pad_id_of(tokenizer, model.generation_config),
            progress=progress,
        )
        store.write_shard(directory, n, payload, samples=shard_samples, plan_hash=hashes[n])
        result.shards_written += 1
        result.tokens_captured += sum(len(s.input_ids) for s in shard_samples)
    progress.close()
    # 5. merge the manifest
    ranks.barrier()
    if ranks.is_main:
        entries = [store.complete_entry(directory, n, h) for n, h in enumerate(hashes)]
        missing = [store.shard_name(n) for n, e in enumerate(entries) if e is None]
        if missing:
            raise RuntimeError(f"{directory}: shards {missing} are incomplete after capture")
        result.manifest = store.write_manifest(directory, plan, entries)
    return result
