"""The training-time-test (TTT) loss of EAGLE-3 (docs/design.md §3.3): a pure function of tensors.

Indexing, for target tokens ``x_0 .. x_{T-1}``: at step ``k`` the draft position ``t`` receives
token ``x_{t+1+k}`` (input ids shifted left by ``1 + k``) and, at ``k = 0``, the fused target
feature at ``t``; at ``k > 0`` its own hidden state of step ``k - 1`` at ``t``. It predicts
``x_{t+2+k}``, so it is scored against the target's distribution at position ``t+1+k`` (the
target logits there predict the same token) and counts where the loss mask holds on
``x_{t+2+k}``. Its RoPE position is ``t + k``, and it attends causally to step 0 plus
diagonally to its own steps ``1..k``, as serving does when it extends a draft chain.

Loss at step ``k``: soft cross-entropy between the draft's log-softmax over the draft vocabulary
and the target's probabilities restricted to the draft vocabulary and renormalized, averaged over
positions where the mask holds *and* the target's argmax lies in the draft vocabulary (EAGLE's
and SpecForge's rule); or, with ``loss="lk"``, ``-log sum_v min(p_v, q_v)``: minus the log of
the acceptance probability of a token drawn from the draft ``q`` and verified against the
target ``p`` (the "LK" losses, which optimise acceptance instead of KL). The target's
distribution can be sharpened first (``target_temperature``: ``softmax(log p / T)``, one-hot
at ``T = 0``). Total:
``sum_k 0.8**k * loss_k``. Accuracy ``acc_k``: the draft's argmax,
mapped through ``d2t``, equals the target's argmax, over all masked positions (an argmax outside
the draft vocabulary counts as a miss, as it would be at serving time).

Replayed rounds (the on-policy phase, ``train.on_policy``): the serving runtime's greedy chain
of depth ``K`` over a sequence the target wrote starts its first round at the anchor ``t = m -
1`` of each assistant run starting at ``m`` (the target's first token ``x_m`` comes from the
prefill), accepts steps ``0 .. a - 1`` while the draft's step-``k`` token at ``t`` equals
``x_{t+2+k}``, and starts the next round at ``t + a + 1``. These are exactly the unroll's
states at those positions and steps (TTT equals serving), so :func:`replay_rounds` finds the
rounds from the unroll's argmaxes, and ``ttt_loss(reach=...)`` scores at each anchor the steps
through the first rejected one (``min(a + 1, K)`` of them): the states the draft's own
proposals reach and whose verification decides acceptance; past the first rejection a chain
discards the draft's tokens whatever they are. Accept length of the replay: the run's tokens
after its first over the rounds, the runtime's ``tau``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from specforge.data.batching import Batch
from specforge.models.eagle3 import Eagle3DraftModel, TTTCache


@dataclass
class TargetDistribution:
    """What the loss needs from the target, per position (computed once per batch)."""

    probs: torch.Tensor
    """(B, T, draft_vocab_size) float32, target probabilities renormalized on the draft vocab."""
    argmax: torch.Tensor
    """(B, T) the target's full-vocabulary argmax."""
    in_draft: torch.Tensor
    """(B, T) bool: that argmax is in the draft vocabulary."""


@torch.no_grad()
def target_distribution(
    last_hidden_state: torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    hot_ids: torch.Tensor,
    t2d: torch.Tensor,
    rows: torch.Tensor | None = None,
    chunk_size: int = 256,
    bias: torch.Tensor | None = None,
    transform=None,
    argmax: torch.Tensor | None = None,
) -> TargetDistribution:
    """The target's next-token distribution from its final hidden state and ``lm_head``.

    The probabilities come from the draft vocabulary's rows of ``lm_head`` alone; the
    full-vocabulary logits, six times that product for a 49k vocabulary and 8k draft ids,
    exist only for the argmax (and are that product when the draft vocabulary is every id
    in order), ``chunk_size`` positions at a time, and not at all when an earlier pass's
    ``argmax`` is given (``train.state_cache_gb``).

    Args:
        last_hidden_state: (B, T, Ht) after the target's final norm.
        lm_head_weight: (V, Ht) the target's output embedding.
        hot_ids: (Vd,) target ids of the draft vocabulary.
        t2d: (V,) bool membership of target ids in the draft vocabulary.
        rows: optional (B, T) bool, the positions to compute
            (:func:`specforge.data.chat.scored_positions`); the others get zero probabilities,
            argmax ``-1`` and ``in_draft`` False.
        bias: (V,) the output layer's bias, if it has one.
        transform: what the model does to ``lm_head``'s output
            (:class:`specforge.models.adapter.LogitTransform`), if anything.
        argmax: optional (B, T), the full-vocabulary argmax this function gave for the same
            states before (read at ``rows``).
    """
    batch, length, width = last_hidden_state.shape
    if rows is None:
        rows = torch.ones(batch, length, dtype=torch.bool, device=last_hidden_state.device)
    # (B, T, Ht) -> (N, Ht), the N selected positions
    flat = last_hidden_state[rows]
    weight = lm_head_weight.to(flat.dtype)
    # every id in order (a block draft's soft labels): one product gives both
    every_id = len(hot_ids) == weight.shape[0] and torch.equal(
        hot_ids, torch.arange(len(hot_ids), device=hot_ids.device)
    )
    hot_weight, hot_bias = weight, bias
    if not every_id:
        hot_weight, hot_bias = weight[hot_ids], None if bias is None else bias[hot_ids]
    probs, argmaxes = [], []
    for start in range(0, flat.shape[0], chunk_size):
        chunk = flat[start : start + chunk_size]
        # (chunk, Ht) @ (Ht, Vd) -> (chunk, Vd)
        hot = _logits(chunk, hot_weight, hot_bias, transform)
        if argmax is None:
            # (chunk, Ht) @ (Ht, V) -> (chunk, V)
            # the first maximum, as argmax; faster in bf16
            full = hot if every_id else _logits(chunk, weight, bias, transform)
            argmaxes.append(full.max(-1).indices)
        probs.append(hot.float().softmax(-1))
    out_probs = flat.new_zeros(batch, length, len(hot_ids), dtype=torch.float32)
    out_argmax = torch.full((batch, length), -1, dtype=torch.long, device=flat.device)
    if probs:
        out_probs[rows] = torch.cat(probs)
        out_argmax[rows] = (
            argmax[rows].to(out_argmax) if argmax is not None else torch.cat(argmaxes)
        )
    return TargetDistribution(
        probs=out_probs, argmax=out_argmax, in_draft=(out_argmax >= 0) & t2d[out_argmax]
    )


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias, transform) -> torch.Tensor:
    """``transform(hidden @ weight.T + bias)``."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias.to(logits.dtype)
    return logits if transform is None else transform(logits)


def first_needed_position(loss_mask: torch.Tensor, ttt_length: int) -> int:
    """The first position whose output some step of a ``ttt_length`` unroll scores: ``t`` with
    ``loss_mask[t + 2 + k]`` for some ``k < ttt_length`` (over the whole batch). Earlier
    positions are only step-0 keys; computing their other outputs changes nothing."""
    masked = loss_mask.bool().any(0).nonzero()
    if len(masked) == 0:
        return 0
    return max(0, int(masked[0]) - 1 - ttt_length)


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """(B, T, ...) -> (B, T, ...) with ``out[:, t] = x[:, t + n]`` and ``fill`` past the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


@dataclass
class TTTResult:
    """Per-step results of one TTT unroll."""

    loss: torch.Tensor
    """Scalar ``sum_k weight**k * loss_k`` (what is back-propagated)."""
    step_losses: list[torch.Tensor]
    """``loss_k`` per step (detached scalars)."""
    step_correct: list[torch.Tensor]
    """Masked positions where the draft's argmax equals the target's, per step."""
    step_counted: list[torch.Tensor]
    """Masked positions per step (the accuracy denominator)."""
    step_prev_correct: list[torch.Tensor]
    """Per step ``k``: positions counted at ``k`` whose steps ``0..k-1`` were all correct."""
    step_chain_correct: list[torch.Tensor]
    """Per step ``k``: positions whose steps ``0..k`` were all correct."""
    replayed: Rounds | None = None
    """The greedy chain rounds replayed from the unroll (``replay_depth``), else ``None``."""

    @property
    def accuracies(self) -> list[float]:
        return [
            float(c) / max(float(n), 1.0)
            for c, n in zip(self.step_correct, self.step_counted, strict=True)
        ]


def sharpened(probs: torch.Tensor, temperature: float) -> torch.Tensor:
    """(N, V) probabilities ``p`` -> ``softmax(log p / temperature)``
    (``train.target_temperature``); at ``0`` one-hot on each row's argmax (the first, as
    ``argmax``)."""
    if temperature == 1.0:
        return probs
    if temperature == 0.0:
        return torch.zeros_like(probs).scatter_(-1, probs.argmax(-1, keepdim=True), 1.0)
    # a probability that underflowed to 0 stays (about) 0
    return (probs.clamp(min=torch.finfo(probs.dtype).tiny).log() / temperature).softmax(-1)


def position_losses(logits: torch.Tensor, target_probs: torch.Tensor, loss: str) -> torch.Tensor:
    """(N, Vd) draft logits and (N, Vd) target probabilities -> (N,) per-position losses."""
    log_probs = logits.float().log_softmax(-1)
    if loss == "kl":
        # soft cross-entropy: KL(p || q) up to the target's (constant) entropy
        return -(target_probs * log_probs).sum(-1)
    if loss == "lk":
        accepted = torch.minimum(target_probs, log_probs.exp()).sum(-1)
        return -accepted.clamp(min=1e-6).log()
    raise ValueError(f"unknown loss {loss!r}: expected 'kl' or 'lk'")


@dataclass
class Rounds:
    """The greedy chain rounds the serving runtime runs over a batch's assistant runs."""

    reach: torch.Tensor
    """(B, T) int64: at a round's anchor, the draft steps it runs through its first rejection
    (``1 .. depth``); 0 at other positions."""
    rounds: torch.Tensor
    """Scalar: the rounds (target verifications)."""
    emitted: torch.Tensor
    """Scalar: the tokens they emit, each run's first (the prefill's) aside."""


def replay_rounds(matched: torch.Tensor, loss_mask: torch.Tensor) -> Rounds:
    """The rounds of a greedy chain of depth ``K`` from ``matched`` (B, T, K) bool: the draft's
    step-``k`` token at anchor ``t`` equals ``x_{t+2+k}``, a token under ``loss_mask``. In each
    assistant run ``[m, end)`` the first round's anchor is ``m - 1``; a round at ``t`` accepts
    the leading matches ``a`` and the next starts at ``t + a + 1``, while the first token it
    predicts (``x_{t+2}``) is in the run (module docstring)."""
    depth = matched.shape[-1]
    # (B, T, K) -> (B, T): the accepted count of a round anchored at each t
    accepted = matched.long().cumprod(-1).sum(-1).tolist()
    flags_by_row = loss_mask.bool().tolist()
    reach = [[0] * len(flags) for flags in flags_by_row]
    rounds = emitted = 0
    for row, flags in enumerate(flags_by_row):
        for first, end in assistant_runs(flags):
            t = first - 1
            while t + 2 < end:
                a = accepted[row][t]
                reach[row][t] = min(a + 1, depth)
                rounds += 1
                emitted += min(a + 1, end - (t + 2))  # none past the run's end-of-turn token
                t += a + 1
    reached = torch.tensor(reach, dtype=torch.long, device=loss_mask.device)
    return Rounds(reached, torch.tensor(rounds), torch.tensor(emitted))


def assistant_runs(flags: list[bool]) -> list[tuple[int, int]]:
    """``[first, end)`` of each run of True ``flags`` that has a token before it (an anchor)."""
    runs, index = [], 1
    while index < len(flags):
        if flags[index] and not flags[index - 1]:
            first = index
            while index < len(flags) and flags[index]:
                index += 1
            runs.append((first, index))
        index += 1
    return runs


def ttt_unroll(
    draft: Eagle3DraftModel,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    ttt_length: int,
    start: int = 0,
) -> Iterator[torch.Tensor]:
    """Yield the draft's pre-norm hidden states (B, T - start, H) of positions ``start..T-1``
    at steps ``0 .. ttt_length - 1`` (logits: ``draft.logits``).

    Step ``k`` feeds token ``t + 1 + k`` at RoPE position ``t + k`` and, for ``k > 0``, the
    draft's own pre-norm hidden state of step ``k - 1`` (both as the draft's
    :meth:`~specforge.models.eagle3.Eagle3DraftModel.unrolled_inputs` gives them). Step 0 reads
    every position (all are keys); later steps compute positions ``start..T-1`` alone.
    """
    batch, length = input_ids.shape
    key_padding_mask = attention_mask.bool()
    positions = torch.arange(length, device=input_ids.device).expand(batch, length)
    cache = TTTCache()
    # (B, T, 3 * Ht) -> (B, T, H)
    hidden = draft.fuse(aux_hidden_states)
    for k in range(ttt_length):
        ids, step_positions = shift_left(input_ids, 1 + k), positions + k
        if k > 0:
            # (B, T) -> (B, T - start)
            ids, step_positions = ids[:, start:], step_positions[:, start:]
            ids, hidden = draft.unrolled_inputs(ids, hidden)
        hidden = draft.ttt_step(
            ids,
            hidden,
            step_positions,
            cache=cache,
            key_padding_mask=key_padding_mask,
            start=start,
        )
        yield hidden


def ttt_loss(
    draft: Eagle3DraftModel,
    *,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    target_dist: TargetDistribution,
    ttt_length: int = 7,
    step_weight: float = 0.8,
    loss: str = "kl",
    target_temperature: float = 1.0,
    reach: torch.Tensor | None = None,
    replay_depth: int = 0,
) -> TTTResult:
    """Unroll the draft ``ttt_length`` steps and score every step against the target.

    Only what the loss reads is computed: after step 0's keys, positions from
    :func:`first_needed_position` on, and the draft's logits at counted positions alone.
    With ``reach`` (the on-policy phase) only the replayed rounds' states count, each alike:
    the loss is their mean, ``step_weight`` unused.

    Args:
        draft: the draft model (its parameters receive gradients).
        input_ids: (B, T) target token ids, right-padded.
        attention_mask: (B, T) 1 for real tokens.
        loss_mask: (B, T) 1 on tokens the draft should learn to predict (assistant tokens).
        aux_hidden_states: (B, T, 3 * Ht) the target's aux layers.
        target_dist: the target's distribution per position (:func:`target_distribution`), at
            least at :func:`specforge.data.chat.scored_positions`.
        ttt_length: number of unrolled steps.
        step_weight: step ``k`` is weighted ``step_weight ** k``.
        loss: ``kl`` or ``lk`` (module docstring).
        target_temperature: the target distribution's temperature in the loss
            (:func:`sharpened`); accuracy counts the target's argmax either way.
        reach: optional (B, T) :attr:`Rounds.reach`: step ``k`` counts where ``reach > k``.
        replay_depth: chain rounds of this depth replayed into ``replayed`` (:func:`replay`).

    Returns:
        The weighted loss and per-step losses / accuracy counts.
    """
    _check_lengths(ttt_length, replay_depth)
    loss_mask = loss_mask.bool() & attention_mask.bool()
    total = states = torch.zeros((), device=input_ids.device, dtype=torch.float32)
    result = TTTResult(total, [], [], [], [], [])
    matched = torch.zeros(*loss_mask.shape, replay_depth, dtype=torch.bool, device=loss_mask.device)
    chain = torch.ones_like(loss_mask)
    start = first_needed_position(loss_mask, ttt_length)
    # 1. unroll: step k sees token t+1+k at RoPE position t+k
    steps = ttt_unroll(
        draft,
        input_ids=input_ids,
        attention_mask=attention_mask,
        aux_hidden_states=aux_hidden_states,
        ttt_length=ttt_length,
        start=start,
    )
    for k, hidden in enumerate(steps):
        # 2. it predicts t+2+k: counted where the mask holds there, scored by the target at t+1+k
        counted = shift_left(loss_mask, 2 + k, fill=False)
        if reach is not None:
            counted = counted & (reach > k)
        rows, cols = counted[:, start:].nonzero(as_tuple=True)
        cols = cols + start
        states_k = hidden[rows, cols - start]  # 3. the loss at counted positions: (N, H)
        step = _score_step(
            draft, states_k, target_dist, rows, cols + 1 + k, loss, target_temperature
        )
        if reach is None:
            total = total + step_weight**k * step.loss
        else:
            total, states = total + step.loss_sum, states + step.scored.sum()
        # 4. accuracy: draft argmax mapped to target ids vs the target's argmax
        chain = _tally(result, step, counted, (rows, cols), chain)
        if k < replay_depth:  # the replay's matches: the draft's token is the sequence's
            matched[rows, cols, k] = step.drafted == shift_left(input_ids, 2 + k)[rows, cols]
    result.loss = total if reach is None else total / states.clamp(min=1)
    if replay_depth:
        result.replayed = replay_rounds(matched, loss_mask)
    return result


@dataclass
class StepScore:
    """One unrolled step's loss over its counted positions."""

    loss: torch.Tensor
    """The mean over the scored positions."""
    loss_sum: torch.Tensor
    scored: torch.Tensor
    """(N,) bool: the target's argmax is in the draft vocabulary there."""
    drafted: torch.Tensor
    """(N,) the draft's argmax as target ids."""
    target_argmax: torch.Tensor


def _score_step(draft, hidden, target_dist, rows, cols, loss, temperature) -> StepScore:
    """The draft's logits from ``hidden`` (N, H) scored against the target's distribution at
    ``(rows, cols)``."""
    target_probs = sharpened(target_dist.probs[rows, cols], temperature)
    scored = target_dist.in_draft[rows, cols]
    # (N, H) -> (N, draft_vocab_size)
    logits = draft.logits(hidden)
    per_position = position_losses(logits, target_probs, loss) * scored
    with torch.no_grad():
        drafted = draft.to_target_ids(logits.max(-1).indices)
    return StepScore(
        per_position.sum() / scored.sum().clamp(min=1),
        per_position.sum(),
        scored,
        drafted,
        target_dist.argmax[rows, cols],
    )


def _check_lengths(ttt_length: int, replay_depth: int) -> None:
    if ttt_length < 1:
        raise ValueError(f"ttt_length must be >= 1, got {ttt_length}")
    if not 0 <= replay_depth <= ttt_length:
        raise ValueError(f"replay_depth must be in 0..{ttt_length}, got {replay_depth}")


@torch.no_grad()
def _tally(result: TTTResult, step: StepScore, counted, where, chain) -> torch.Tensor:
    """Append a step's loss and accuracy counts to ``result`` (its counted positions
    ``where``: rows and columns); returns the positions whose steps so far were all right (a
    step-k prediction continues its chain from step k - 1)."""
    correct = torch.zeros_like(counted)
    correct[where] = step.drafted == step.target_argmax
    result.step_losses.append(step.loss.detach())
    result.step_correct.append(correct.sum())
    result.step_counted.append(counted.sum())
    result.step_prev_correct.append((chain & counted).sum())
    chain = chain & correct
    result.step_chain_correct.append(chain.sum())
    return chain


@torch.no_grad()
def replay(draft: Eagle3DraftModel, *, depth: int, **inputs: torch.Tensor) -> Rounds:
    """The greedy chain rounds of depth ``depth`` the current draft runs over a batch (a
    no-grad unroll, :func:`replay_rounds`); ``inputs``: :func:`ttt_loss`'s tensors
    (``input_ids``, ``attention_mask``, ``loss_mask``, ``aux_hidden_states``, ``target_dist``)."""
    return ttt_loss(draft, **inputs, ttt_length=depth, replay_depth=depth).replayed


class TTTObjective(nn.Module):
    """The draft plus its TTT loss as one module, so DDP sees the whole step in ``forward``."""

    def __init__(
        self,
        draft: Eagle3DraftModel,
        ttt_length: int,
        step_weight: float,
        loss: str = "kl",
        target_temperature: float = 1.0,
        replay_depth: int = 0,
        replay: bool = True,
    ):
        super().__init__()
        self.draft = draft
        self.ttt_length = ttt_length
        self.step_weight = step_weight
        self.loss = loss
        self.target_temperature = target_temperature
        self.replay_depth = replay_depth
        """The depth of the replayed chain rounds (``train.on_policy.depth``): the on-policy
        loss's rounds, and the accept length evaluations report beside the TTT loss."""
        self.replay = replay
        """``False``: on-policy steps train as supervised ones (``train.on_policy.replay``)."""

    def forward(
        self,
        batch: Batch,
        aux_hidden_states: torch.Tensor,
        target_dist: TargetDistribution,
        on_policy: bool = False,
    ) -> TTTResult:
        """The TTT loss, or with ``on_policy`` the loss on the current draft's replayed
        rounds (module docstring)."""
        inputs = {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "loss_mask": batch.loss_mask,
            "aux_hidden_states": aux_hidden_states,
            "target_dist": target_dist,
        }
        common = {"loss": self.loss, "target_temperature": self.target_temperature}
        if not (on_policy and self.replay):
            # evaluation reports the replay's accept length (from the unroll where it is deep
            # enough); a supervised training step leaves it out of its hot path
            reported = 0 if self.training else self.replay_depth
            shared = reported <= self.ttt_length
            result = ttt_loss(
                self.draft,
                **inputs,
                **common,
                ttt_length=self.ttt_length,
                step_weight=self.step_weight,
                replay_depth=reported if shared else 0,
            )
            if not shared:
                result.replayed = replay(self.draft, **inputs, depth=reported)
            return result
        rounds = replay(self.draft, **inputs, depth=self.replay_depth)
        result = ttt_loss(
            self.draft, **inputs, **common, ttt_length=self.replay_depth, reach=rounds.reach
        )
        result.replayed = rounds
        return result
