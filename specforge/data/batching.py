"""Deterministic, resumable batching shared by every rank.

Each epoch shuffles the samples with ``seed + epoch``, groups them into micro-batches of
``batch_size`` (split further when a micro-batch's padded size exceeds ``max_tokens_per_batch``)
or, under a token budget (``batch_tokens``), of samples of similar length up to that many
padded tokens (the batches in a shuffled order), and deals them out: optimizer step ``s`` of an
epoch consumes the micro-batches ``[s * W * A, (s + 1) * W * A)`` (``W`` ranks, ``A``
accumulation steps); rank ``r`` takes the ``a``-th of its share at index ``s * W * A + a * W +
r``. So one process with ``A = 2`` and two processes with ``A = 1`` see the same global batch,
and a resumed run recomputes its data position from the step number alone.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from dataclasses import dataclass

import torch

from specforge.data.chat import TokenizedSample
from specforge.errors import UserError


@dataclass
class Batch:
    """A padded micro-batch (right padding)."""

    input_ids: torch.Tensor
    """(B, T) int64"""
    attention_mask: torch.Tensor
    """(B, T) int64, 1 for real tokens"""
    loss_mask: torch.Tensor
    """(B, T) bool"""
    aux_hidden_states: torch.Tensor | None = None
    """(B, T, 3 * Ht) offline mode: the captured aux layers (zero on padding)."""
    last_hidden_state: torch.Tensor | None = None
    """(B, T, Ht) offline mode: the captured final hidden state (zero where not stored)."""
    sample_ids: list[str] = dataclasses.field(default_factory=list)
    """The samples' ids, row by row (named when a batch gives a non-finite loss)."""

    def to(self, device) -> Batch:
        moved = {
            f.name: value.to(device) if isinstance(value, torch.Tensor) else value
            for f in dataclasses.fields(self)
            if (value := getattr(self, f.name)) is not None
        }
        return Batch(**moved)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())


def collate(samples: list[TokenizedSample], pad_id: int = 0) -> Batch:
    length = max(len(s.input_ids) for s in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(samples), length, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), length, dtype=torch.bool)
    for row, sample in enumerate(samples):
        n = len(sample.input_ids)
        input_ids[row, :n] = sample.input_ids
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = sample.loss_mask
    return Batch(input_ids, attention_mask, loss_mask, sample_ids=[s.id for s in samples])


SAMPLED_ANSWER = re.compile(r"#s\d+$")
"""The id suffix of one of several answers to a prompt (``regenerate.num_samples``)."""


def padded_rows(
    rows: list[torch.Tensor], length: int, positions: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """Per-conversation states ``(T_i, H)`` as one ``(B, length, H)`` tensor, zero elsewhere:
    the states of a collated batch's rows, each row's at its first ``T_i`` positions or, with
    ``positions``, at those (``(T_i,)`` each: states kept only where the loss reads them)."""
    out = rows[0].new_zeros(len(rows), length, rows[0].shape[-1])
    for index, row in enumerate(rows):
        where = slice(len(row)) if positions is None else positions[index]
        out[index, where] = row
    return out


def split_key(sample_id: str) -> str:
    """What decides a sample's split: its id, without the suffix of a sampled answer, so the
    answers to one prompt are held out together (one in training would leak the prompt)."""
    return SAMPLED_ANSWER.sub("", sample_id)


def split_train_eval(
    samples: list[TokenizedSample], eval_fraction: float
) -> tuple[list[TokenizedSample], list[TokenizedSample]]:
    """Hash-based, stable split by sample id (:func:`split_key`; at least one eval sample when
    the fraction > 0).

    Both parts are sorted by id, so the batches do not depend on the order samples were read
    in (a capture stores them sorted by length; online reads them in file order).
    """
    samples = sorted(samples, key=lambda s: s.id)
    if eval_fraction <= 0:
        return samples, []
    buckets = 10_000
    is_eval = [
        zlib.crc32(split_key(s.id).encode()) % buckets < eval_fraction * buckets for s in samples
    ]
    if not any(is_eval) and len(samples) > 1:  # the last prompt's answers, if some remain
        last = split_key(samples[-1].id)
        forced = [split_key(s.id) == last for s in samples]
        is_eval = forced if not all(forced) else [False] * (len(samples) - 1) + [True]
    train = [s for s, e in zip(samples, is_eval, strict=True) if not e]
    held_out = [s for s, e in zip(samples, is_eval, strict=True) if e]
    return train, held_out


def epoch_micro_batches(
    samples: list[TokenizedSample],
    *,
    epoch: int,
    seed: int,
    batch_size: int,
    max_tokens_per_batch: int | None,
    batch_tokens: int | None = None,
) -> list[list[int]]:
    """The epoch's micro-batches as lists of sample indices (by token budget when
    ``batch_tokens`` is set: :func:`token_budget_batches`)."""
    generator = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(len(samples), generator=generator).tolist()
    if batch_tokens is not None:
        return token_budget_batches(samples, order, batch_tokens, generator)
    batches = []
    for start in range(0, len(order), batch_size):
        group = order[start : start + batch_size]
        current: list[int] = []
        for index in group:
            longest = max([len(samples[i].input_ids) for i in current + [index]])
            if (
                current
                and max_tokens_per_batch
                and longest * (len(current) + 1) > max_tokens_per_batch
            ):
                batches.append(current)
                current = []
            current.append(index)
        batches.append(current)
    return batches


def token_budget_batches(
    samples: list[TokenizedSample], order: list[int], budget: int, generator: torch.Generator
) -> list[list[int]]:
    """Micro-batches of about ``budget`` padded tokens each: the samples in ``order`` (an
    epoch's shuffle) sorted by length, so that equal lengths stay shuffled, filled longest
    first while rows x longest length stays within ``budget`` (a sample longer than the budget
    is a micro-batch alone), then the batches in an order drawn from ``generator``. Every
    optimizer step sees about the same number of tokens, whatever the lengths (with one
    sample a micro-batch, long conversations make fewer steps per token than short ones)."""
    by_length = sorted(order, key=lambda i: -len(samples[i].input_ids))
    batches: list[list[int]] = []
    for index in by_length:  # longest first: a batch's first sample sets its padded width
        if batches and len(samples[batches[-1][0]].input_ids) * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(index)
        else:
            batches.append([index])
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


class StepBatches:
    """Micro-batches of optimizer step ``step`` for one rank, across epochs."""

    def __init__(
        self,
        samples,
        *,
        seed,
        batch_size,
        max_tokens_per_batch,
        world_size,
        rank,
        grad_accumulation,
        pad_id=0,
        batch_tokens=None,
    ):
        self.samples = samples
        self.seed = seed
        self.batch_size = batch_size
        self.max_tokens_per_batch = max_tokens_per_batch
        self.batch_tokens = batch_tokens
        self.world_size = world_size
        self.rank = rank
        self.grad_accumulation = grad_accumulation
        self.pad_id = pad_id
        self._epoch_cache: dict[int, list[list[int]]] = {}
        per_step = world_size * grad_accumulation
        self.steps_per_epoch = len(self._epoch(0)) // per_step
        if self.steps_per_epoch == 0:
            raise UserError(
                f"{len(samples)} training samples make {len(self._epoch(0))} micro-batches, fewer "
                f"than one optimizer step needs ({per_step} = ranks x grad_accumulation)"
            )

    @classmethod
    def from_config(cls, samples, train, *, world_size=1, rank=0, pad_id=0) -> StepBatches:
        """The batches ``train`` (a :class:`~specforge.config.TrainConfig`) asks for."""
        return cls(
            samples,
            seed=train.seed,
            batch_size=train.batch_size,
            max_tokens_per_batch=train.max_tokens_per_batch,
            batch_tokens=train.batch_tokens,
            world_size=world_size,
            rank=rank,
            grad_accumulation=train.grad_accumulation,
            pad_id=pad_id,
        )

    def _epoch(self, epoch: int) -> list[list[int]]:
        if epoch not in self._epoch_cache:
            self._epoch_cache = {
                epoch: epoch_micro_batches(
                    self.samples,
                    epoch=epoch,
                    seed=self.seed,
                    batch_size=self.batch_size,
                    max_tokens_per_batch=self.max_tokens_per_batch,
                    batch_tokens=self.batch_tokens,
                )
            }
        return self._epoch_cache[epoch]

    def indices_for_step(self, step: int) -> list[list[int]]:
        """This rank's micro-batches of optimizer step ``step``, as sample indices."""
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        micro = self._epoch(epoch)
        per_step = self.world_size * self.grad_accumulation
        base = step_in_epoch * per_step
        return [
            micro[base + a * self.world_size + self.rank] for a in range(self.grad_accumulation)
        ]

    def for_step(self, step: int) -> list[Batch]:
        return [
            collate([self.samples[i] for i in group], self.pad_id)
            for group in self.indices_for_step(step)
        ]
