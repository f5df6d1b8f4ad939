"""The DFlash block objective, as pure functions of tensors (the same for online and offline
training):

1. ``sample_anchors``: up to ``num_anchors`` random anchor positions per sequence, each the
   start of a block whose first predicted token is an assistant token;
2. ``block_targets``: what slot ``k`` of each block predicts (the token at ``anchor + k``) and
   its weight: only slots after the anchor, inside the sequence, on assistant tokens, of kept
   blocks;
3. ``block_loss``: cross-entropy per slot (hard labels, or soft to the target's distribution
   at the position before the label), weighted ``exp(-(k - 1) / gamma)`` by slot, and the
   tokens a greedy verification of each block would accept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from specforge.data.batching import Batch
from specforge.families.dflash.model import DFlashDraftModel


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, S) bool: the positions a block may be anchored at, ``a >= 1`` (some context before
    it) with an assistant token after it (``loss_mask[a + 1]``)."""
    eligible = torch.zeros_like(loss_mask, dtype=torch.bool)
    eligible[:, 1:-1] = loss_mask[:, 2:].bool()
    return eligible


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random anchors per sequence of ``loss_mask`` (B, S) bool: positions ``a`` with some
    context before them (``a >= 1``) and an assistant token after them (``loss_mask[a + 1]``),
    at most ``num_anchors`` each, without repeats, ascending.

    Returns:
        anchors (B, N) long and keep (B, N) bool, ``N`` the most any sequence has (a
        sequence with fewer pads with position 0 and ``keep`` False).
    """
    batch, length = loss_mask.shape
    eligible = eligible_anchors(loss_mask)
    counts = eligible.sum(1).clamp(max=num_anchors)
    blocks = max(int(counts.max()), 1)
    # random scores; ineligible positions sort last
    scores = torch.rand(batch, length, generator=generator).to(loss_mask.device)
    scores = scores.masked_fill(~eligible, 2.0)
    chosen = scores.argsort(dim=1)[:, :blocks]
    keep = torch.arange(blocks, device=loss_mask.device)[None] < counts[:, None]
    anchors = torch.where(keep, chosen, torch.zeros_like(chosen))
    # ascending, kept anchors first
    order = torch.where(keep, anchors, length).argsort(dim=1)
    return anchors.gather(1, order), keep.gather(1, order)


def block_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token slot ``k`` of each block predicts and whether it counts.

    Args:
        input_ids, loss_mask: (B, S).
        anchors, keep: (B, N) from :func:`sample_anchors`.

    Returns:
        labels (B, N, Bk) long (the token at ``anchor + k``; 0 past the end) and counts
        (B, N, Bk) bool: ``k >= 1``, inside the sequence, an assistant token, a kept block.
    """
    length = input_ids.shape[1]
    # (B, N, 1) + (Bk,) -> (B, N, Bk)
    positions = anchors[..., None] + torch.arange(block_size, device=anchors.device)
    inside = positions < length
    safe = positions.clamp(max=length - 1).flatten(1)
    labels = input_ids.gather(1, safe).view_as(positions).masked_fill(~inside, 0)
    assistant = loss_mask.bool().gather(1, safe).view_as(positions)
    counts = inside & assistant & keep[..., None]
    counts[..., 0] = False  # the anchor is given, not predicted
    return labels, counts


def greedy_labels(
    argmax: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels from the target's own greedy tokens, what greedy verification accepts: slot
    ``k`` of a block anchored at ``a`` is labelled with the target's argmax at ``a + k - 1``.

    Args:
        argmax: (B, S) the target's next-token argmax per position, ``-1`` where none was
            computed (positions not followed by an assistant token, padding).
        anchors, keep: (B, N) from :func:`sample_anchors`.

    Returns:
        labels (B, N, Bk) and counts (B, N, Bk) bool: ``k >= 1``, inside the sequence, an
        argmax there, a kept block.
    """
    length = argmax.shape[1]
    # (B, N, 1) + (Bk,) - 1 -> (B, N, Bk): the position whose argmax labels slot k
    source = anchors[..., None] + torch.arange(block_size, device=anchors.device) - 1
    inside = (source >= 0) & (source < length)
    labels = argmax.gather(1, source.clamp(0, length - 1).flatten(1)).view_as(source)
    counts = inside & (labels >= 0) & keep[..., None]
    counts[..., 0] = False  # the anchor is given, not predicted
    return labels.clamp(min=0), counts


def slot_weights(block_size: int, gamma: float | None, device=None) -> torch.Tensor:
    """(Bk,) the loss weight of each slot: ``exp(-(k - 1) / gamma)`` for ``k >= 1`` (1 with
    no ``gamma``), 0 for the anchor."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    weights = torch.ones(block_size, device=device) if not gamma else torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


@dataclass
class BlockLoss:
    """What :func:`block_loss` returns."""

    loss: torch.Tensor
    """The weighted mean over the counted slots (a scalar with a graph)."""
    slot_correct: list[int]
    """Per slot ``1 .. Bk - 1``: counted slots whose argmax is the label."""
    slot_counted: list[int]
    """Per slot ``1 .. Bk - 1``: counted slots."""
    accepted: int
    """Over the kept blocks whose first slot counts: the leading slots a greedy verification
    would accept (argmax equal to the label, up to the first miss or uncounted slot)."""
    blocks: int
    """How many such blocks."""

    @property
    def slot_accuracy(self) -> list[float]:
        return [c / max(n, 1) for c, n in zip(self.slot_correct, self.slot_counted, strict=True)]

    @property
    def tau(self) -> float:
        """The predicted accept length: 1 + the mean accepted count (the bonus counted)."""
        return 1.0 + self.accepted / max(self.blocks, 1)


def block_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    counts: torch.Tensor,
    *,
    gamma: float | None,
    target_probs: torch.Tensor | None = None,
) -> BlockLoss:
    """The block objective over ``logits`` (B, N, Bk, V).

    Args:
        labels, counts: (B, N, Bk) from :func:`block_targets` or :func:`greedy_labels`.
        gamma: the slot decay (:func:`slot_weights`); ``None``: every slot alike.
        target_probs: (B, N, Bk, V) the target's distribution over each slot's token (its
            softmax at the position before the label), for the soft cross-entropy; ``None``:
            hard labels.
    """
    block_size = logits.shape[2]
    log_q = logits.float().log_softmax(-1)
    if target_probs is None:
        per_slot = -log_q.gather(-1, labels[..., None])[..., 0]
    else:
        per_slot = -(target_probs.float() * log_q).sum(-1)
    weights = counts.float() * slot_weights(block_size, gamma, logits.device)
    loss = (per_slot * weights).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        hits = (logits.argmax(-1) == labels) & counts
        slot_correct = [int(hits[..., k].sum()) for k in range(1, block_size)]
        slot_counted = [int(counts[..., k].sum()) for k in range(1, block_size)]
        # leading hits per block, over blocks whose first slot counts
        run = hits[..., 1:].long().cumprod(-1).sum(-1)
        started = counts[..., 1]
    return BlockLoss(loss, slot_correct, slot_counted, int(run[started].sum()), int(started.sum()))


def soft_targets(
    target_probs: torch.Tensor, anchors: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The target's distribution over each slot's token: its distribution at
    ``anchor + k - 1`` ((B, S, V) -> (B, N, Bk, V); the anchor's own row is a placeholder,
    never counted)."""
    length = target_probs.shape[1]
    positions = anchors[..., None] + torch.arange(block_size, device=anchors.device) - 1
    rows = torch.arange(anchors.shape[0], device=anchors.device)[:, None, None]
    return target_probs[rows, positions.clamp(0, length - 1)]


@dataclass
class BlockVocabulary:
    """What a hidden-state source reads of a draft's vocabulary (``hot_ids``, ``t2d``) for the
    block objective: every id is in the vocabulary; hard labels need the target's argmax
    alone (one id's probability, never read, is computed beside it), soft labels its
    distribution over every id."""

    t2d: torch.Tensor
    """(V,) all True."""
    hot_ids: torch.Tensor
    """The ids whose probabilities the source computes: ``[0]`` (hard) or all (soft)."""

    @classmethod
    def of(cls, vocab_size: int, device, labels: str = "hard") -> BlockVocabulary:
        ids = vocab_size if labels == "soft" else 1
        return cls(
            t2d=torch.ones(vocab_size, dtype=torch.bool, device=device),
            hot_ids=torch.arange(ids, dtype=torch.long, device=device),
        )


class DFlashObjective(nn.Module):
    """The DFlash draft and its block loss as one module (DDP sees the whole step in
    ``forward``): training draws ``anchors`` random blocks per sequence (the global RNG, saved
    with each checkpoint); evaluation scores every eligible block, ``anchors`` at a time.
    ``labels``: ``hard`` (the target's greedy tokens) or ``soft`` (its distributions, which
    the source computes over the whole vocabulary: :class:`BlockVocabulary`)."""

    def __init__(
        self,
        draft: DFlashDraftModel,
        *,
        anchors: int,
        block_decay: float | None,
        labels: str = "hard",
    ):
        super().__init__()
        self.draft, self.anchors, self.block_decay = draft, anchors, block_decay
        self.labels = labels

    def forward(self, batch: Batch, aux_hidden_states: torch.Tensor, target_dist) -> BlockLoss:
        loss_mask = batch.loss_mask.bool() & batch.attention_mask.bool()
        block_size = self.draft.config.block_size
        if self.training:
            anchors, keep = sample_anchors(loss_mask, self.anchors)
            groups = [(anchors.to(loss_mask.device), keep.to(loss_mask.device))]
        else:
            groups = every_anchor(loss_mask, self.anchors)
        results = []
        for anchors, keep in groups:
            logits = self.draft.train_blocks(aux_hidden_states, batch.input_ids, anchors, keep)
            labels, counts = greedy_labels(target_dist.argmax, anchors, keep, block_size)
            probs = None
            if self.labels == "soft":
                if target_dist.probs.shape[-1] != logits.shape[-1]:
                    raise ValueError(
                        f"soft labels need the target's distribution over all "
                        f"{logits.shape[-1]} ids, got {target_dist.probs.shape[-1]} "
                        "(BlockVocabulary.of(..., labels='soft'))"
                    )
                probs = soft_targets(target_dist.probs, anchors, block_size)
            results.append(
                block_loss(logits, labels, counts, gamma=self.block_decay, target_probs=probs)
            )
        return merged(results)


def every_anchor(loss_mask: torch.Tensor, chunk: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every eligible anchor of a one-sequence batch (as :func:`sample_anchors` chooses among
    them), ``chunk`` at a time: an evaluation's blocks, deterministic."""
    positions = eligible_anchors(loss_mask)[0].nonzero()[:, 0]
    if not len(positions):
        positions = torch.zeros(1, dtype=torch.long, device=loss_mask.device)
        return [(positions[None], torch.zeros(1, 1, dtype=torch.bool, device=loss_mask.device))]
    return [
        (group[None], torch.ones(1, len(group), dtype=torch.bool, device=loss_mask.device))
        for group in positions.split(chunk)
    ]


def merged(results: list[BlockLoss]) -> BlockLoss:
    """One result of several (the loss a mean weighted by counted slots)."""
    if len(results) == 1:
        return results[0]
    counted = [sum(r.slot_counted) for r in results]
    total = max(sum(counted), 1)
    return BlockLoss(
        sum(r.loss * n / total for r, n in zip(results, counted, strict=True)),
        [sum(v) for v in zip(*(r.slot_correct for r in results), strict=True)],
        [sum(v) for v in zip(*(r.slot_counted for r in results), strict=True)],
        sum(r.accepted for r in results),
        sum(r.blocks for r in results),
    )


def block_metrics(results: list[BlockLoss]) -> dict[str, float]:
    """Loss, ``acc_k`` (slot ``k + 1``'s accuracy, as EAGLE's ``acc_k`` counts the ``k + 1``-th
    proposal) and ``tau_pred`` over several results (summed across ranks when distributed)."""
    slots = len(results[0].slot_correct)
    counts = torch.tensor(
        [
            [float(sum(r.slot_correct[k] for r in results)) for k in range(slots)],
            [float(sum(r.slot_counted[k] for r in results)) for k in range(slots)],
        ]
    )
    totals = torch.tensor(
        [
            sum(float(r.loss) for r in results),
            float(len(results)),
            float(sum(r.accepted for r in results)),
            float(sum(r.blocks for r in results)),
        ]
    )
    if dist.is_initialized():
        dist.all_reduce(counts)
        dist.all_reduce(totals)
    metrics = {"loss": float(totals[0] / totals[1].clamp(min=1))}
    for k in range(slots):
        metrics[f"acc_{k}"] = float(counts[0, k] / counts[1, k].clamp(min=1))
    metrics["tau_pred"] = 1.0 + float(totals[2] / totals[3].clamp(min=1))
    return metrics
