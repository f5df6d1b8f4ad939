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
import torch.nn.functional as F


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
    eligible = torch.zeros_like(loss_mask, dtype=torch.bool)
    eligible[:, 1 : length - 1] = loss_mask[:, 2:].bool()
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
    slot_accuracy: list[float]
    """Per slot ``1 .. Bk - 1``: the share of counted slots whose argmax is the label."""
    accepted: list[int]
    """Per kept block whose first slot counts: how many leading slots a greedy verification
    would accept (argmax equal to the label, up to the first miss or uncounted slot)."""

    @property
    def tau(self) -> float:
        """The predicted accept length: 1 + the mean accepted count (the bonus counted)."""
        return 1.0 + (sum(self.accepted) / len(self.accepted) if self.accepted else 0.0)


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
        labels, counts: (B, N, Bk) from :func:`block_targets`.
        gamma: the slot decay (:func:`slot_weights`); ``None``: every slot alike.
        target_probs: (B, N, Bk, V) the target's distribution over each slot's token (its
            softmax at the position before the label), for the soft cross-entropy; ``None``:
            hard labels (on regenerated data, the target's own tokens).
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
        slot_accuracy = [
            float(hits[..., k].sum()) / max(int(counts[..., k].sum()), 1)
            for k in range(1, block_size)
        ]
        # leading hits per block, over blocks whose first slot counts
        run = hits[..., 1:].long().cumprod(-1).sum(-1)
        accepted = run[counts[..., 1]].tolist()
    return BlockLoss(loss, slot_accuracy, accepted)


def soft_targets(
    target_logits: torch.Tensor, anchors: torch.Tensor, block_size: int
) -> torch.Tensor:
    """The target's distribution over each slot's token: its softmax at ``anchor + k - 1``
    ((B, S, V) -> (B, N, Bk, V); the anchor's own row is a placeholder, never counted)."""
    length = target_logits.shape[1]
    positions = anchors[..., None] + torch.arange(block_size, device=anchors.device) - 1
    safe = positions.clamp(0, length - 1)
    batch, blocks = anchors.shape
    rows = target_logits.gather(
        1, safe.flatten(1)[..., None].expand(-1, -1, target_logits.shape[-1])
    )
    return F.softmax(rows.float(), -1).view(batch, blocks, block_size, -1)
