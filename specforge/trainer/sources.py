"""Where a training step's target states come from: a live target (online) or the shards
``specforge capture`` wrote (offline). Both give the training loop the same things (samples,
the target's embedding / ``lm_head`` / final norm, and per batch the aux hidden states plus the
target distribution), so the loop, the TTT loss, the metrics and the checkpoints are shared.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

import torch
from torch.utils.data import DataLoader, Dataset

from specforge.config import SpecForgeConfig
from specforge.data.batching import Batch, StepBatches, collate, padded_rows
from specforge.data.chat import (
    TokenizedSample,
    pad_id_of,
    scored_positions,
    set_chat_template,
    tokenize_conversations,
)
from specforge.data.hidden_states import HiddenStateStore, check_manifest_matches
from specforge.data.sources import read_prepared
from specforge.distributed import Distributed, shard_decoder_layers
from specforge.errors import UserError
from specforge.models.adapter import LogitTransform
from specforge.models.eagle3 import Eagle3DraftModel
from specforge.models.target import (
    TargetHead,
    decoder_layers,
    load_generation_config,
    load_target,
    load_target_head,
    load_tokenizer,
    resolve_aux_layer_ids,
    target_fingerprint,
    target_head,
    target_hidden_states,
)
from specforge.trainer.state_cache import TargetStateCache
from specforge.trainer.ttt import TargetDistribution, target_distribution

logger = logging.getLogger(__name__)


class HiddenStateSource(Protocol):
    """What the training loop needs from the target, wherever it comes from."""

    head: TargetHead
    """The target's config, embedding, ``lm_head`` and final norm."""
    tokenizer: object
    generation_config: object | None
    aux_layer_ids: list[int]
    samples: list[TokenizedSample]
    """Every training sample (the loop splits train / eval by id)."""
    pad_id: int
    """The id batches are padded with."""

    def step_batches(self, batches: StepBatches, steps: range) -> Iterator[list[Batch]]:
        """The micro-batches of each optimizer step in ``steps``, in order."""
        ...

    def eval_batch(self, sample: TokenizedSample) -> Batch:
        """One held-out sample as a batch."""
        ...

    def states(self, batch: Batch, draft: Eagle3DraftModel):
        """``(aux_hidden_states (B, T, 3Ht), target_dist)`` for a batch on the device."""
        ...


def draft_target_distribution(
    last_hidden_state: torch.Tensor,
    head: TargetHead,
    draft: Eagle3DraftModel,
    batch: Batch,
    argmax: torch.Tensor | None = None,
) -> TargetDistribution:
    """The target's distribution on the draft's vocabulary at the positions the loss scores,
    with the model's own logit transform (the same code for both sources); ``argmax``: the
    full-vocabulary argmax an earlier pass found there."""
    return target_distribution(
        last_hidden_state.to(head.lm_head.dtype),
        head.lm_head,
        hot_ids=draft.hot_ids,
        t2d=draft.t2d,
        rows=scored_positions(batch.loss_mask, batch.attention_mask),
        bias=head.lm_head_bias,
        transform=head.transform,
        argmax=argmax,
    )


# ---------------------------------------------------------------------------------------------
# Online: the frozen target runs inside the step


def load_training_samples(cfg: SpecForgeConfig, tokenizer, path=None):
    """Tokenized conversations of ``path``, by default ``train.data_path`` (or what prepare
    wrote).

    Raises:
        UserError: the file is missing (run ``specforge prepare`` first), is not prepare's
            output, or holds no conversation with assistant tokens.
    """
    path = path or cfg.training_data_path
    conversations = read_prepared(path)
    samples, stats = tokenize_conversations(
        tokenizer,
        conversations,
        max_length=cfg.data.max_length,
        system_prompt=cfg.data.system_prompt,
    )
    if not samples:
        raise UserError(f"{path}: no conversation with assistant tokens to train on")
    logger.info("training data %s: %s", path, stats.as_dict())
    return samples


class OnlineTarget:
    """The whole frozen target on every rank, or its decoder layers sharded with FSDP2."""

    def __init__(self, cfg: SpecForgeConfig, ranks: Distributed, device: str):
        self.model, self.tokenizer = load_target(cfg.target, device=device)
        set_chat_template(self.tokenizer, cfg.data.chat_template)
        self.generation_config = self.model.generation_config
        self.head = target_head(self.model)
        self.aux_layer_ids = resolve_aux_layer_ids(
            cfg.target.aux_layer_ids, self.head.config.num_hidden_layers
        )
        if cfg.train.target_sharding == "fsdp" and ranks.world_size > 1:
            shard_decoder_layers(decoder_layers(self.model), device)
        self.samples = load_training_samples(cfg, self.tokenizer)
        self.pad_id = pad_id_of(self.tokenizer, self.generation_config)
        gib = cfg.train.state_cache_gb
        self.cache = TargetStateCache(int(gib * 2**30)) if gib > 0 else None

    def step_batches(self, batches: StepBatches, steps: range) -> Iterator[list[Batch]]:
        for step in steps:
            yield batches.for_step(step)

    def eval_batch(self, sample: TokenizedSample) -> Batch:
        return collate([sample], self.pad_id)

    @torch.no_grad()
    def states(self, batch: Batch, draft: Eagle3DraftModel):
        kept = self.cache.lookup(batch) if self.cache is not None else None
        if kept is not None:  # an earlier pass's states (train.state_cache_gb)
            aux, last, argmax = kept
            return aux, draft_target_distribution(last, self.head, draft, batch, argmax)
        states = target_hidden_states(
            self.model, batch.input_ids, batch.attention_mask, aux_layer_ids=self.aux_layer_ids
        )
        aux, last = states.aux_hidden_states, states.last_hidden_state
        distribution = draft_target_distribution(last, self.head, draft, batch)
        if self.cache is not None:
            self.cache.store(batch, aux, last, distribution.argmax)
        return aux, distribution


# ---------------------------------------------------------------------------------------------
# Offline: shards on disk


def attach_hidden_states(
    batch: Batch, samples: list[TokenizedSample], store: HiddenStateStore
) -> Batch:
    """Fill a collated batch's ``aux_hidden_states`` / ``last_hidden_state`` from the store."""
    aux_rows, last_rows = zip(*(store.hidden_states(s) for s in samples), strict=True)
    length = batch.input_ids.shape[1]
    batch.aux_hidden_states = padded_rows(aux_rows, length)
    batch.last_hidden_state = padded_rows(last_rows, length)
    return batch


def stored_batch(samples: list[TokenizedSample], pad_id: int, store: HiddenStateStore) -> Batch:
    """Samples collated with their captured hidden states."""
    return attach_hidden_states(collate(samples, pad_id), samples, store)


class OfflineSteps(Dataset):
    """Item ``i``: the micro-batches of optimizer step ``steps[i]``, hidden states included.
    A ``DataLoader`` with workers reads the next steps' shards while this one trains."""

    def __init__(self, batches: StepBatches, store: HiddenStateStore, steps: range):
        self.batches = batches
        self.store = store
        self.steps = steps

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int) -> list[Batch]:
        samples = self.batches.samples
        return [
            stored_batch([samples[i] for i in group], self.batches.pad_id, self.store)
            for group in self.batches.indices_for_step(self.steps[index])
        ]


def _no_collate(item):
    return item


class OfflineShards:
    """Captured hidden states on disk plus only the target's embedding, ``lm_head`` and norm."""

    def __init__(self, cfg: SpecForgeConfig, ranks: Distributed, device: str):
        directory = cfg.capture_dir
        self.store = HiddenStateStore(directory)
        self.head = load_target_head(cfg.target, device=device)
        self.tokenizer = load_tokenizer(cfg.target)
        set_chat_template(self.tokenizer, cfg.data.chat_template)
        self.generation_config = load_generation_config(cfg.target)
        self.aux_layer_ids = resolve_aux_layer_ids(
            cfg.target.aux_layer_ids, self.head.config.num_hidden_layers
        )
        fingerprint = target_fingerprint(self.head.config, self.tokenizer, cfg.target.name_or_path)
        expected = {
            f"target.{k}": fingerprint[k]
            for k in ("config_hash", "tokenizer_hash", "hidden_size", "vocab_size")
        }
        check_manifest_matches(
            self.store.manifest, {**expected, "aux_layer_ids": self.aux_layer_ids}, str(directory)
        )
        measured = self.store.manifest.get("logit_transform")
        if measured is not None:  # what the capture measured on the whole model
            self.head.transform = LogitTransform(**measured)
        self.samples = self.store.samples()
        self.pad_id = pad_id_of(self.tokenizer, self.generation_config)
        self.num_workers = cfg.train.num_workers
        logger.info(
            "offline: %d samples, %d tokens from %s",
            len(self.samples),
            self.store.manifest["num_tokens"],
            directory,
        )

    def step_batches(self, batches: StepBatches, steps: range) -> Iterator[list[Batch]]:
        loader = DataLoader(
            OfflineSteps(batches, self.store, steps),
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_no_collate,
        )
        yield from loader

    def eval_batch(self, sample: TokenizedSample) -> Batch:
        return stored_batch([sample], self.pad_id, self.store)

    @torch.no_grad()
    def states(self, batch: Batch, draft: Eagle3DraftModel):
        distribution = draft_target_distribution(batch.last_hidden_state, self.head, draft, batch)
        return batch.aux_hidden_states.to(self.head.lm_head.dtype), distribution


def hidden_state_source(cfg: SpecForgeConfig, ranks: Distributed, device: str) -> HiddenStateSource:
    """The source ``data.mode`` asks for."""
    if cfg.data.mode == "offline":
        if cfg.train.state_cache_gb:
            logger.warning(
                "train.state_cache_gb (%s) keeps the target's states of the online mode; "
                "data.mode offline reads every state from its shards and keeps none",
                cfg.train.state_cache_gb,
            )
        return OfflineShards(cfg, ranks, device)
    return OnlineTarget(cfg, ranks, device)
