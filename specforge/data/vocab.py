"""The draft vocabulary: the ``draft_vocab_size`` most frequent target tokens (docs/design.md §3.4).

Frequencies are counted over **assistant tokens only** (the loss mask), because those are what
the draft predicts. The selection is deterministic: by count, ties broken by the smaller id; the
tokens that end a turn are always included (they replace the least frequent picks if needed);
a size larger than the number of distinct seen tokens is filled with unseen ids in id order.

The map follows SGLang/SpecForge: the selected target ids sorted ascending are ``hot_ids``;
``d2t[d] = hot_ids[d] - d`` (so target id = ``d + d2t[d]``); ``t2d[t]`` says whether target id
``t`` is in the draft vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from specforge.errors import UserError
from specforge.io import read_safetensors

logger = logging.getLogger(__name__)


def hot_ids(d2t: torch.Tensor) -> torch.Tensor:
    """(Vd,) the target ids of the draft vocabulary, ``arange(Vd) + d2t`` (docs/design.md §3.4)."""
    return torch.arange(d2t.numel(), dtype=torch.long, device=d2t.device) + d2t


@dataclass
class VocabMap:
    """The draft <-> target vocabulary maps."""

    d2t: torch.Tensor
    """(draft_vocab_size,) int64 offsets: target id = draft id + d2t[draft id]."""
    t2d: torch.Tensor
    """(vocab_size,) bool: target id is in the draft vocabulary."""

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def hot_ids(self) -> torch.Tensor:
        """(draft_vocab_size,) int64 target ids of the draft vocabulary, ascending."""
        return hot_ids(self.d2t)

    def check(self) -> None:
        """Raise UserError unless the maps are consistent with each other."""
        hot = self.hot_ids
        if self.d2t.dtype != torch.long or self.t2d.dtype != torch.bool:
            raise UserError(
                f"d2t must be int64 and t2d bool, got {self.d2t.dtype}, {self.t2d.dtype}"
            )
        if hot.numel() and (hot.min() < 0 or hot.max() >= self.vocab_size):
            raise UserError("d2t maps draft ids outside the target vocabulary")
        if hot.unique().numel() != hot.numel():
            raise UserError("d2t is not injective: it maps two draft ids to the same target id")
        if int(self.t2d.sum()) != self.draft_vocab_size or not bool(self.t2d[hot].all()):
            raise UserError("t2d does not mark exactly the target ids that d2t reaches")


def count_token_frequencies(
    samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int
) -> torch.Tensor:
    """Count target tokens under the loss mask.

    Args:
        samples: ``(input_ids, loss_mask)`` pairs, each ``(T,)``.
        vocab_size: the target's vocabulary size.

    Returns:
        (vocab_size,) int64 counts.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in samples:
        ids = input_ids[loss_mask.bool()]
        if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
            raise UserError(f"token id {int(ids.max())} is outside vocab_size={vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_vocab_map(
    counts: torch.Tensor,
    draft_vocab_size: int,
    *,
    always_include: Iterable[int] = (),
) -> VocabMap:
    """Select the draft vocabulary from token counts.

    Args:
        counts: (vocab_size,) token counts (see :func:`count_token_frequencies`).
        draft_vocab_size: how many target ids the draft predicts; at most ``vocab_size``.
        always_include: target ids kept whatever their count (the end-of-turn tokens).

    Returns:
        The vocabulary map.

    Raises:
        UserError: a size out of range or an ``always_include`` id outside the vocabulary.
    """
    vocab_size = counts.numel()
    if not 1 <= draft_vocab_size <= vocab_size:
        raise UserError(f"draft_vocab_size must be in 1..{vocab_size}, got {draft_vocab_size}")
    forced = sorted(set(int(i) for i in always_include))
    for i in forced:
        if not 0 <= i < vocab_size:
            raise UserError(f"always-included token id {i} is outside vocab_size={vocab_size}")
    if len(forced) > draft_vocab_size:
        raise UserError(
            f"draft_vocab_size={draft_vocab_size} cannot hold the {len(forced)} forced ids {forced}"
        )
    # Rank by count (descending), then id (ascending): a stable sort on -count keeps id order.
    order = torch.sort(-counts, stable=True).indices
    seen = int((counts > 0).sum())
    if draft_vocab_size > seen:
        logger.info(
            "draft_vocab_size=%d exceeds the %d distinct assistant tokens seen; the remaining "
            "%d slots take unseen ids in id order",
            draft_vocab_size,
            seen,
            draft_vocab_size - seen,
        )
    chosen = [int(i) for i in order[:draft_vocab_size]]
    missing = [i for i in forced if i not in set(chosen)]
    if missing:
        kept = [i for i in chosen if i not in forced][: draft_vocab_size - len(forced)]
        chosen = kept + forced
    hot_ids = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = hot_ids - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[hot_ids] = True
    vocab_map = VocabMap(d2t=d2t, t2d=t2d)
    vocab_map.check()
    return vocab_map


def vocab_map_from_samples(
    samples, *, vocab_size: int, draft_vocab_size: int, end_of_turn: list[int]
) -> tuple[VocabMap, torch.Tensor]:
    """The draft vocabulary of tokenized samples (``.input_ids``/``.loss_mask``): counts over
    their assistant tokens, ``draft_vocab_size`` capped at ``vocab_size``, end-of-turn ids kept.

    Returns:
        The map and the (vocab_size,) counts it was built from.
    """
    counts = count_token_frequencies(((s.input_ids, s.loss_mask) for s in samples), vocab_size)
    vocab_map = build_vocab_map(
        counts, min(draft_vocab_size, vocab_size), always_include=end_of_turn
    )
    return vocab_map, counts


def save_vocab_map(vocab_map: VocabMap, path: str | Path) -> None:
    """Write ``d2t``/``t2d`` to a safetensors file (temp file + rename).

    Raises:
        UserError: ``path`` names a directory.
    """
    path = Path(path)
    check_vocab_output(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file({"d2t": vocab_map.d2t.contiguous(), "t2d": vocab_map.t2d.contiguous()}, str(tmp))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_vocab_output(path: str | Path) -> None:
    """Raise :class:`UserError` where a vocab map could not be written to ``path`` (a
    directory), before any work is done."""
    if Path(path).is_dir():
        raise UserError(
            f"the vocab map output {path} is a directory: name the file to write "
            f"(e.g. {Path(path) / 'vocab.safetensors'})"
        )


def load_vocab_map(path: str | Path) -> VocabMap:
    """Read and check a map written by :func:`save_vocab_map`."""
    tensors = read_safetensors(path)
    missing = {"d2t", "t2d"} - set(tensors)
    if missing:
        raise UserError(f"{path}: not a vocab map, missing {sorted(missing)}")
    vocab_map = VocabMap(d2t=tensors["d2t"], t2d=tensors["t2d"])
    vocab_map.check()
    return vocab_map


def mask_token_for(requested: int | None, tokenizer, samples, target_config) -> int:
    """``draft.mask_token_id``, else the tokenizer's mask token, else the largest id that no
    training sample holds (a target without a mask token: its embedding row is then one the
    draft never reads as text while it learns).

    Raises:
        UserError: a requested id outside the target's vocabulary.
    """
    vocab_size = target_config.vocab_size
    if requested is not None:
        if requested >= vocab_size:
            raise UserError(
                f"draft.mask_token_id {requested} is outside the target's vocabulary "
                f"(0..{vocab_size - 1})"
            )
        return requested
    own = getattr(tokenizer, "mask_token_id", None)
    if own is not None and 0 <= own < vocab_size:
        return int(own)
    seen = torch.zeros(vocab_size, dtype=torch.bool)
    for sample in samples:
        seen[sample.input_ids.clamp(0, vocab_size - 1)] = True
    unseen = (~seen).nonzero()
    mask = int(unseen[-1]) if len(unseen) else vocab_size - 1
    logger.info("draft.mask_token_id: %d (a token the training data never holds)", mask)
    return mask
