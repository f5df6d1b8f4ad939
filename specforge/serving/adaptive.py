"""Cost-aware adaptive drafting (``bench.num_steps: auto``, chain drafting): before each round,
pick the depth that maximises expected tokens per second on this device.

- **Costs** (:class:`CostModel`, measured at start-up by :func:`calibrate`): the target's
  forward over ``n = 1 .. max_depth + 1`` new tokens after a context, and one draft step; plus
  the time a round spends outside both. During generation, each verification's width and the
  time outside keep running averages of what rounds really cost.
- **Acceptance** (:class:`AcceptanceEstimate`): the conditional acceptance ``c_k`` of draft
  position ``k`` given positions ``< k`` were accepted, from counts that decay with each new
  observation of that position (a window of about ``1 / (1 - decay)`` observations, so a
  position seen rarely keeps what it learnt). The prior of position ``k`` is the estimate of
  ``k - 1`` (acceptance rarely rises with depth), so depths never tried are neither ignored nor
  assumed perfect.
- **Confidence** (:class:`ConfidenceCalibration`, greedy rounds): the draft's own probability
  ``q`` of the token it proposes, mapped to the acceptance measured for such ``q`` (binned,
  decayed counts; prior ``q`` itself). A greedy round drafts token by token: the next token's
  calibrated acceptance replaces ``c_k`` for the positions already drafted, and drafting stops
  as soon as the best depth under that estimate is no deeper than what is drafted. The
  candidate it declines costs nothing (its logits came with the last step) and is checked
  against the target's bonus token when every drafted token was accepted, so the estimates keep
  learning one position beyond the depth verified.
- **Choice** (:func:`best_depth`): ``E(K) = 1 + sum_{k<=K} prod_{j<=k} c_j`` tokens per round for
  ``T(K) = verify(K + 1) + max(K - 1, 0) * draft_step + other`` seconds (the first token
  comes with the draft's extension, which every round pays); the ``K`` in
  ``0 .. max_depth`` with the largest ``E / T`` (0 is plain decoding: one target forward,
  while the draft still follows the text). Verification is unchanged, so it stays lossless.
- **Siblings** (greedy rounds, :func:`tree_rate`): the first draft position may also get
  the draft's next most likely tokens, verified beside the chain as a small tree (a fan at
  position 1). Only one of them can be the target's token, so each adds its own acceptance to
  ``E`` (its ``q`` calibrated apart, :class:`ConfidenceCalibration`, learnt every round from
  the target's first token, which every verification computes), for one more verified token.
  On a CPU, where verifying 4 tokens costs little more than 2, that buys accepted tokens a
  deeper chain cannot. A tree's verification (its mask and positions) costs a little more than
  a chain's of the same width: the excess is learnt apart from the chain widths
  (:attr:`CostModel.tree_extra`). Which of the chain, its siblings and prompt lookup's first
  tokens a round verifies is chosen together, as the tree of them with the most expected
  tokens per second (:meth:`~specforge.serving.policy.AutoPolicy.best_round`).
- **Dormancy** (:class:`Dormancy`): while plain decoding wins, the draft need not follow every
  token. After a plain round that the position estimates chose too (not one where a single
  token the draft was unsure of stopped a draft that pays in general), it sleeps for a span of
  rounds (no extension, no decision: the target decodes alone), then extends over everything it
  skipped in one forward and decides again. The span doubles with each such probe that decodes
  plainly again and resets when a round drafts, so a draft that pays now and then is looked at
  often, and one that never pays costs a forward every ``max_span`` tokens instead of one per
  token.
- **Sampling** rounds learn from plain rounds too: with the target's distribution ``p`` and the
  draft's ``q`` for the next position in hand, the first position's acceptance would have been
  ``sum(min(p, q))`` (:func:`first_acceptance`), observed as a fractional hit.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass
class CostModel:
    """What a round costs on this device, in seconds."""

    verify: list[float]
    """``verify[n - 1]``: the target's forward over ``n`` new tokens (n = 1 .. max_depth + 1)."""
    draft_step: float
    """One draft forward over one token."""
    other: float = 0.0
    """Per round, outside drafting and verification (the draft's extension over the accepted
    tokens, acceptance, cache crops, Python): a running average the runtime keeps."""
    tree_extra: float = 0.0
    """What verifying a tree (siblings, prompt lookup beside the draft) costs beyond a chain
    of the same width, its tree mask and positions: a running average of tree verifications'
    excess over the chain estimate of their width, 0 until one is seen."""
    calibrated: list[float] = field(init=False)
    """``verify`` as measured at start-up (:meth:`observe_verify` moves ``verify`` since)."""

    adapt: ClassVar[float] = 0.1
    """The weight of each new measurement in the running averages."""
    stall: ClassVar[float] = 2.0
    """A verification counts as at most this many times its width's estimate: a pause of the
    machine (another process, a page fault) is not what that width costs."""
    follow: ClassVar[float] = 0.02
    """The share by which each verification pulls every other width's estimate toward its
    start-up figure times the verified width's current ratio to its own. Widths not verified
    for a while then follow the machine's speed in the calibration's shape, instead of keeping
    a figure from a slow moment that the picker, seeing it expensive, would never revisit."""

    def __post_init__(self) -> None:
        self.calibrated = list(self.verify)

    @property
    def max_depth(self) -> int:
        return len(self.verify) - 1

    def round_seconds(
        self, depth: int, siblings: int = 0, *, tree: bool = False, drafted: bool = True
    ) -> float:
        """``T(K)``: a round of depth ``K`` (with ``siblings`` more tokens verified beside its
        chain, as a ``tree`` or not). Its first draft token comes with the draft's extension
        over the last round's tokens (in ``other``, paid at every depth, 0 included), so
        drafting ``K`` tokens takes ``K - 1`` draft steps; siblings cost only their
        verification (their logits came with the extension). A chain that was not ``drafted``
        (prompt lookup's) costs its verification and the round's other time only."""
        width = depth + siblings  # verify[n - 1] is n tokens: the last token, then these
        verify = self.verify[width] + (self.tree_extra if tree else 0.0)
        steps = max(depth - 1, 0) if drafted else 0
        return verify + steps * self.draft_step + self.other

    def observe_verify(self, width: int, seconds: float, *, tree: bool = False) -> None:
        """A verification of ``width`` tokens measured during generation: the start-up
        figure becomes a running average of what rounds of that width really cost (the
        context grows; a calibration timed in a noisy moment is corrected by the depths it
        makes the picker choose), a stall counting as :attr:`stall` times the estimate; the
        other widths :attr:`follow` the machine's speed seen there. A ``tree``'s seconds
        feed :attr:`tree_extra` instead (its excess over the chain of its width)."""
        index = width - 1
        if tree:
            seconds = min(seconds, self.stall * (self.verify[index] + self.tree_extra))
            self.tree_extra += self.adapt * (seconds - self.verify[index] - self.tree_extra)
            return
        seconds = min(seconds, self.stall * self.verify[index])
        self.verify[index] += self.adapt * (seconds - self.verify[index])
        speed = self.verify[index] / self.calibrated[index]
        for other, calibrated in enumerate(self.calibrated):
            if other != index:
                self.verify[other] += self.follow * (calibrated * speed - self.verify[other])

    def observe_other(self, seconds: float) -> None:
        """A round's time outside drafting and verification, into the running average."""
        self.other += self.adapt * (seconds - self.other)

    def as_dict(self) -> dict[str, object]:
        return {
            "calibrated_verify_ms": [round(1000 * s, 3) for s in self.calibrated],
            "verify_ms": [round(1000 * s, 3) for s in self.verify],
            "draft_step_ms": round(1000 * self.draft_step, 3),
            "other_ms": round(1000 * self.other, 3),
            "tree_extra_ms": round(1000 * self.tree_extra, 3),
        }


def expected_tokens(acceptance: list[float], depth: int) -> float:
    """``E(K)``: tokens a round of depth ``K`` emits on average, the bonus token included."""
    total, chain = 1.0, 1.0
    for rate in acceptance[:depth]:
        chain *= rate
        total += chain
    return total


def round_rate(
    chain: list[float], siblings: list[float], costs: CostModel, *, drafted: bool = True
) -> float:
    """Expected tokens per second of a round verifying a chain with acceptances ``chain`` (its
    depth ``K = len(chain)``) and ``len(siblings)`` more candidates for the first position with
    acceptances ``siblings`` (exclusive of the chain's first token and of each other: the
    target has one token there): ``K + 1 + len(siblings)`` tokens verified; a chain not
    ``drafted`` (prompt lookup's) runs no draft step."""
    depth = len(chain)
    seconds = costs.round_seconds(depth, len(siblings), tree=bool(siblings), drafted=drafted)
    return (expected_tokens(chain, depth) + sum(siblings)) / seconds


def tree_rate(chains: list[tuple[list[int], list[float]]], depth: int, costs: CostModel) -> float:
    """Expected tokens per second of a round verifying ``chains`` (each its target ids and the
    acceptance of each given the ones before) merged into one tree (a shared prefix verified
    once), of which the first ``depth`` tokens of the first chain were drafted step by step.
    Each node adds the chance that its path is accepted (the most any chain through it
    promises): the accepted path is one path, so ``E = 1 + sum`` over the nodes. More than
    one chain is verified as a tree (:attr:`CostModel.tree_extra`), even where they share
    every token. A tree wider than the widths calibrated promises nothing (0)."""
    reach: dict[tuple[int, ...], float] = {}
    for tokens, rates in chains:
        path, chance = (), 1.0
        for token, rate in zip(tokens, rates, strict=True):
            path, chance = (*path, token), chance * rate
            reach[path] = max(reach.get(path, 0.0), chance)
    if len(reach) > costs.max_depth:
        return 0.0
    seconds = costs.round_seconds(depth, len(reach) - depth, tree=len(chains) > 1)
    return (1 + sum(reach.values())) / seconds


def best_depth(acceptance: list[float], costs: CostModel, *, drafted: bool = True) -> int:
    """The depth in ``0 .. len(acceptance)`` (within the widths calibrated) with the most
    expected tokens per second (the shallower one on a tie), for a chain the draft drafts or
    one it does not (prompt lookup's: verification and the round's other time only)."""
    rates = [
        expected_tokens(acceptance, depth) / costs.round_seconds(depth, drafted=drafted)
        for depth in range(min(len(acceptance), costs.max_depth) + 1)
    ]
    return max(range(len(rates)), key=lambda depth: (rates[depth], -depth))


class DecayedCounts:
    """Hits and trials per slot, each slot forgetting its past by ``decay`` at each new
    observation in it; a slot's rate leans on a prior with ``prior_weight`` pseudo-trials."""

    def __init__(self, slots: int, decay: float, prior_weight: float):
        self.decay, self.prior_weight = decay, prior_weight
        self.hits = [0.0] * slots
        self.trials = [0.0] * slots

    def observe(self, slot: int, hit: bool | float) -> None:
        """One observation: a hit, a miss, or the probability of a hit."""
        self.hits[slot] = self.hits[slot] * self.decay + float(hit)
        self.trials[slot] = self.trials[slot] * self.decay + 1.0

    def rate(self, slot: int, prior: float) -> float:
        weight = self.prior_weight
        return (self.hits[slot] + weight * prior) / (self.trials[slot] + weight)


@dataclass
class AcceptanceEstimate:
    """Decayed counts of draft positions reached and accepted (see the module docstring)."""

    max_depth: int
    decay: float = 0.98
    """Weight of a position's past at each new observation of it."""
    prior_weight: float = 2.0
    """Pseudo-counts of each position's prior (the estimate of the position before it)."""
    first_prior: float = 0.5
    """The prior acceptance of position 1."""
    counts: DecayedCounts = field(init=False)
    """Slot ``k``: draft position ``k`` reached (trials) and accepted (hits)."""

    def __post_init__(self) -> None:
        self.counts = DecayedCounts(self.max_depth + 1, self.decay, self.prior_weight)

    def rates(self) -> list[float]:
        """``c_1 .. c_max_depth``."""
        rates, prior = [], self.first_prior
        for k in range(1, self.max_depth + 1):
            prior = self.counts.rate(k, prior)
            rates.append(prior)
        return rates

    def observe(self, depth: int, accepted: int, lookahead: bool | None = None) -> None:
        """One round: ``accepted`` of ``depth`` draft tokens accepted, and whether the extra
        draft token after them matched the target's bonus (``None``: not checked)."""
        for k in range(1, min(accepted + 1, depth) + 1):
            self.counts.observe(k, k <= accepted)
        if lookahead is not None and accepted == depth and depth < self.max_depth:
            self.counts.observe(depth + 1, lookahead)


@dataclass
class Dormancy:
    """When the draft sleeps through plain rounds (see the module docstring)."""

    max_span: int = 16
    """The longest sleep, in rounds."""
    span: int = 0
    """The sleep after the last plain round the draft was awake for."""
    left: int = 0
    """Rounds of the current sleep still to come."""

    def sleeping(self) -> bool:
        """Whether this round decodes plainly without the draft (counts the sleep down)."""
        if self.left:
            self.left -= 1
            return True
        return False

    def woke(self, depth: int) -> None:
        """After a round the draft was awake for, with the depth that round verified, or for a
        plain round, the depth the position estimates alone would choose (0: sleep)."""
        self.span = min(max(2 * self.span, 1), self.max_span) if depth == 0 else 0
        self.left = self.span


def first_acceptance(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> float:
    """The probability that sampling verification accepts a first draft token drawn from
    ``draft_probs`` when the target's distribution is ``target_probs`` (same vocabulary):
    ``sum(min(p, q))``."""
    return float(torch.minimum(draft_probs, target_probs).sum())


@dataclass
class ConfidenceCalibration:
    """P(a greedy draft token is accepted | the draft's probability ``q`` of it), from decayed
    counts in ``bins`` equal bins of ``q`` with ``q`` itself as the prior."""

    bins: int = 10
    decay: float = 0.99
    """Weight of a bin's past at each new observation in it."""
    prior_weight: float = 2.0
    counts: DecayedCounts = field(init=False)

    def __post_init__(self) -> None:
        self.counts = DecayedCounts(self.bins, self.decay, self.prior_weight)

    def _bin(self, q: float) -> int:
        return min(int(q * self.bins), self.bins - 1)

    def acceptance(self, q: float) -> float:
        return self.counts.rate(self._bin(q), prior=q)

    def observe(self, q: float, hit: bool) -> None:
        self.counts.observe(self._bin(q), hit)

    def by_bin(self) -> list[float]:
        """The acceptance measured at the centre of each bin (what ``bench.json`` reports)."""
        return [round(self.acceptance((b + 0.5) / self.bins), 3) for b in range(self.bins)]


@torch.no_grad()
def calibrate(
    verify_forward: Callable[[int], object],
    draft_step: Callable[[], object],
    *,
    max_depth: int,
    repeats: int = 7,
    clock: Callable[[], float] = time.perf_counter,
) -> CostModel:
    """Measure a :class:`CostModel`: ``verify_forward(n)`` runs the target over ``n`` new
    tokens after a fixed context (and restores it); ``draft_step()`` runs one draft step. Every
    width is run twice to warm up before anything is timed (the first forwards after loading
    ran up to 1.5x slower here). Then ``repeats`` passes each time every width and a draft
    step, and each keeps its median: interleaved, a slow spell of the machine touches every
    width alike instead of all the runs of one (timed one width after another, a single
    spell once made 3 tokens look dearer than 4-6 here)."""
    widths = range(1, max_depth + 2)
    for _ in range(2):
        for n in widths:
            verify_forward(n)
        draft_step()
    verify: list[list[float]] = [[] for _ in widths]
    draft: list[float] = []
    for _ in range(repeats):
        for n in widths:
            verify[n - 1].append(_seconds(lambda n=n: verify_forward(n), clock))
        draft.append(_seconds(draft_step, clock))
    return CostModel(
        verify=[statistics.median(times) for times in verify], draft_step=statistics.median(draft)
    )


def _seconds(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    start = clock()
    fn()
    return clock() - start
