"""The target's states kept in memory between passes of online training
(``train.state_cache_gb``): an offline capture made on the fly.

Online training runs the frozen target over every micro-batch, and on a CPU that forward is
about two thirds of a step. A conversation trained on again in a later pass (or evaluated
again) needs exactly the states it had before, so the first forward over a conversation keeps
what the loss reads of it, as ``specforge capture`` stores it (:mod:`specforge.data.hidden_states`):
the aux layers at every token and the final hidden state at the positions the loss scores,
in the target's dtype, and there the full-vocabulary argmax of the target's logits. A later
batch whose conversations are all kept is rebuilt from them and the target does not run; the
target distribution is derived from the kept final states by the same code as online and
offline training, without the full-vocabulary logits (on SmolLM2 they cost more than the
rest of the distribution six times over). Conversations are kept in the order they come until
the budget is spent.

A kept conversation is matched by its id and its token ids (two files may give one id to
different conversations: a mismatch is a miss, never another conversation's states). At one
conversation a micro-batch in float32, a pass from the cache equals a pass with the target
(tested); in a batch padded to another width a 16-bit forward rounds differently, as
it would in any other batch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specforge.data.batching import Batch, padded_rows
from specforge.data.chat import scored_positions

logger = logging.getLogger(__name__)


@dataclass
class _Kept:
    """One conversation's states."""

    input_ids: torch.Tensor
    """(T,) its token ids (what a lookup must match)."""
    aux: torch.Tensor
    """(T, 3 * Ht) the aux layers."""
    positions: torch.Tensor
    """(M,) the positions the loss scores."""
    last: torch.Tensor
    """(M, Ht) the final hidden state there."""
    argmax: torch.Tensor
    """(M,) the target's full-vocabulary argmax there."""

    @property
    def nbytes(self) -> int:
        tensors = (self.input_ids, self.aux, self.positions, self.last, self.argmax)
        return sum(t.nbytes for t in tensors)


class TargetStateCache:
    """Conversations' target states by sample id, within ``budget_bytes`` of host memory."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self.hits = 0
        """Batches rebuilt from kept states (the target's forward skipped)."""
        self.misses = 0
        self._kept: dict[str, _Kept] = {}
        self._full_logged = False

    def __len__(self) -> int:
        return len(self._kept)

    def _match(self, batch: Batch, row: int) -> _Kept | None:
        kept = self._kept.get(batch.sample_ids[row])
        length = int(batch.attention_mask[row].sum())
        if kept is None or len(kept.input_ids) != length:
            return None
        if not torch.equal(kept.input_ids, batch.input_ids[row, :length].cpu()):
            return None
        return kept

    def lookup(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(aux (B, T, 3Ht), last hidden (B, T, Ht), argmax (B, T))`` on the batch's device
        when every row is kept (the last hidden state and the argmax are zero where the loss
        does not read them), else ``None``."""
        kept = [self._match(batch, row) for row in range(len(batch.sample_ids))]
        if not kept or any(k is None for k in kept):
            self.misses += 1
            return None
        length = batch.input_ids.shape[1]
        aux = padded_rows([k.aux for k in kept], length)
        # the final states at the positions the loss reads, zero elsewhere (as the offline
        # store gives them)
        positions = [k.positions for k in kept]
        last = padded_rows([k.last for k in kept], length, positions)
        argmax = padded_rows([k.argmax[:, None] for k in kept], length, positions)[..., 0]
        self.hits += 1
        device = batch.input_ids.device
        return aux.to(device), last.to(device), argmax.to(device)

    def store(
        self, batch: Batch, aux: torch.Tensor, last: torch.Tensor, argmax: torch.Tensor
    ) -> None:
        """Keep the rows of a batch the target just ran over (those not kept yet, while the
        budget holds them); ``argmax`` (B, T): the target's full-vocabulary argmax, read where
        the loss scores."""
        scored = scored_positions(batch.loss_mask, batch.attention_mask)
        for row, sample_id in enumerate(batch.sample_ids):
            if sample_id in self._kept:
                continue  # kept (or another conversation under this id: left to the target)
            length = int(batch.attention_mask[row].sum())
            positions = scored[row, :length].nonzero()[:, 0]
            kept = _Kept(
                input_ids=batch.input_ids[row, :length].cpu().clone(),
                aux=aux[row, :length].to("cpu", copy=True),
                positions=positions.cpu(),
                last=last[row, positions].to("cpu", copy=True),
                argmax=argmax[row, positions].to("cpu", copy=True),
            )
            if self.used_bytes + kept.nbytes > self.budget_bytes:
                if not self._full_logged:
                    logger.info(
                        "train.state_cache_gb is full at %d conversations (%.2f GiB): the rest "
                        "run the target every pass",
                        len(self._kept),
                        self.used_bytes / 2**30,
                    )
                    self._full_logged = True
                return
            self._kept[sample_id] = kept
            self.used_bytes += kept.nbytes
