"""Who decides each round: a policy plans a round (which proposer's tokens, how many, verified
as a chain or a tree) and observes its outcome.

- :class:`FixedDepth` drafts ``num_steps`` tokens every round (a chain, or a tree's levels).
- :class:`AutoPolicy` is ``num_steps: auto`` (:mod:`specforge.serving.adaptive`): the depth with
  the most expected tokens per second from this device's measured costs and the running
  acceptance; greedy, token by token from the draft's calibrated confidence, with siblings of
  the first draft token beside the chain and prompt lookup competing with the draft; dormancy
  while plain decoding wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specforge.engine.prompt_lookup import ngram_candidates
from specforge.serving.adaptive import (
    AcceptanceEstimate,
    ConfidenceCalibration,
    CostModel,
    Dormancy,
    best_depth,
    round_rate,
    tree_rate,
)
from specforge.serving.drafting import Drafting
from specforge.serving.proposers.eagle import EagleProposer
from specforge.serving.proposers.lookup import PromptLookup
from specforge.serving.tree import DraftTree, merged_tree


@dataclass
class Fan:
    """A greedy ``auto`` round's candidates and the part of each it verifies, merged into one
    tree (:func:`merged_tree`): the draft's chain, its first position's further candidates
    (siblings) and prompt lookup's proposal."""

    chain: list[int]
    """The draft's chain (target ids): drafted step by step, or its first token alone (free:
    its logits came with the extension)."""
    probs: list[float]
    """The draft's probability of each chain token."""
    ranked: list[tuple[int, float]]
    """The first position's further draft candidates ``(target id, q)``, most likely first:
    all learn from the target's first token, verified or not."""
    lookup: list[int] = field(default_factory=list)
    """Prompt lookup's proposal (none: no ``lookup_tokens``, or nothing matched)."""
    candidate: tuple[int, float] | None = None
    """The token the walk declined after the chain ``(target id, q)``, if any."""
    depth: int = 0
    """How many of :attr:`chain` are verified: all or none."""
    siblings: int = 0
    """How many of :attr:`ranked` are verified."""
    lookups: int = 0
    """How many of :attr:`lookup` are verified."""

    def chains(self) -> list[list[int]]:
        """What the tree merges: the chain first (its rows lead), then lookup, then the
        siblings."""
        siblings = ([token] for token, _ in self.ranked[: self.siblings])
        return [self.chain[: self.depth], self.lookup[: self.lookups], *siblings]

    def next_candidate(self) -> tuple[int, float] | None:
        """The draft's token after the verified chain: the first unverified chain token, or
        the one the walk declined."""
        if self.depth < len(self.chain):
            return self.chain[self.depth], self.probs[self.depth]
        return self.candidate


@dataclass
class Plan:
    """A round as a policy planned it: its depth and what it verifies (:attr:`tree`; a chain
    is a tree of width one)."""

    depth: int
    """Tokens verified after the last one (0 decodes one token alone; a tree's depth)."""
    tree: DraftTree | None = None
    """What the round verifies, where the policy proposes it (prompt lookup's chain, greedy
    ``auto``'s fan merged by :func:`~specforge.serving.tree.merged_tree` with each part's
    nodes in :attr:`paths`); else the runtime sets the proposer's chain of :attr:`depth` (or
    its tree)."""
    fan: Fan | None = None
    """Greedy ``auto``: what the round weighed, to learn from."""
    paths: list[list[int]] = field(default_factory=list)
    """Greedy ``auto``: each part's nodes in :attr:`tree`, in :meth:`Fan.chains`'s order."""
    dormant: bool = False
    """A round the draft sleeps through (:class:`~specforge.serving.adaptive.Dormancy`): the
    target decodes one token alone."""


@dataclass
class Context:
    """What a policy plans a round from."""

    prompt: torch.Tensor
    """(T,) the request's prompt."""
    output: list[int]
    """The tokens emitted so far."""
    room: int
    """The most tokens the round may verify after the last one: a round emits at most its
    verified tokens and the target's own, so past what is left of the turn's budget a token
    costs verification and cannot be used."""
    awake: bool = True
    """``False``: the draft sleeps through this round (the policy's :meth:`sleeping`)."""


@dataclass
class Outcome:
    """What a verified round gives its policy to learn from."""

    depth: int
    path: list[int]
    """The accepted nodes of the round's proposal (a chain's: ``0 .. accepted - 1``)."""
    bonus: int
    target_logits: torch.Tensor
    """(rows, V) float32: the target's logits over the verified tokens."""
    seconds: float
    """The verification's wall time."""
    tokens: list[int] = field(default_factory=list)
    """The tokens the round emitted (the accepted ones and the bonus)."""
    other_seconds: float | None = None
    """The round's time outside drafting and verification (the extension included), where
    it is a drafting round's and not the request's first."""

    @property
    def accepted(self) -> int:
        return len(self.path)


class FixedDepth:
    """``num_steps`` draft tokens (or tree levels) every round: it learns nothing, so every
    verb of the policy protocol (:class:`AutoPolicy`'s) but :meth:`plan` does nothing."""

    def __init__(self, num_steps: int):
        self.num_steps = num_steps
        self.costs: CostModel | None = None

    def begin_request(self) -> None:
        pass

    def needs_costs(self) -> bool:
        return False

    def use_costs(self, costs: CostModel) -> None:
        self.costs = costs

    def widths(self) -> tuple[int, int]:
        return 0, 0

    def sleeping(self) -> bool:
        return False

    def plan(self, proposer, context: Context) -> Plan:
        return Plan(min(self.num_steps, context.room))

    def observe(self, plan: Plan, outcome: Outcome, proposer, stats) -> None:
        pass

    def report(self) -> dict | None:
        return None


class LookupOnly(FixedDepth):
    """Prompt-lookup decoding, the bench's free baseline: each round verifies the up to
    ``num_steps`` tokens that followed the last n-gram's earlier occurrence
    (:func:`~specforge.engine.prompt_lookup.ngram_candidates`, as transformers' prompt lookup
    proposes), or none (a plain round) when nothing matches."""

    def __init__(self, num_steps: int, device: torch.device):
        super().__init__(num_steps)
        self.device = device

    def plan(self, proposer, context: Context) -> Plan:
        sequence = torch.cat([context.prompt.cpu(), torch.tensor(context.output)])
        tokens = ngram_candidates(sequence, num_tokens=self.num_steps)[: context.room]
        return Plan(len(tokens), tree=DraftTree.chain(tokens.to(self.device)))


def new_policy(drafting: Drafting, **settings) -> FixedDepth | AutoPolicy:
    """The policy a runtime plans its rounds with: :class:`AutoPolicy` for ``auto`` (its
    ``settings``: :class:`AutoPolicy`'s keyword arguments), else :class:`FixedDepth`."""
    return AutoPolicy(drafting, **settings) if drafting.auto else FixedDepth(drafting.depth)


class AutoPolicy:
    """``num_steps: auto`` (see the module docstring) under ``drafting``'s settings; ``trees``:
    whether the target can verify a tree (else no siblings)."""

    def __init__(self, drafting: Drafting, *, trees: bool, device: torch.device):
        self.drafting, self.num_steps, self.device = drafting, drafting.depth, device
        self.trees, self.max_siblings = trees, drafting.max_siblings if trees else 0
        self.costs: CostModel | None = None
        """This device's round costs (measured by the runtime's ``calibrate``): the machine's,
        so they carry from request to request."""
        self.lookup = PromptLookup(drafting.lookup_tokens) if drafting.lookup_tokens else None
        """Prompt lookup competing with the draft (``lookup_tokens``)."""
        self.begin_request()

    def begin_request(self) -> None:
        """Before a request: what the policy learns of acceptance starts again from its
        priors, so a request's rounds do not depend on the requests before it (nor on a
        bench's warm-up); only the device's :attr:`costs` carry over."""
        self.estimate = AcceptanceEstimate(self.num_steps)
        """Running conditional acceptance per draft position."""
        self.confidence = ConfidenceCalibration()
        """Acceptance given the draft's own probability of its token (greedy)."""
        self.lookup_confidence = (ConfidenceCalibration(), ConfidenceCalibration())
        """The same for the draft's first token where prompt lookup proposes another first
        token, and where it proposes the same (greedy with ``lookup_tokens``)."""
        self.sibling_confidence = ConfidenceCalibration()
        """The same for the first position's further candidates (greedy)."""
        if self.lookup is not None:
            self.lookup.reset()
        self.dormancy = Dormancy()

    # -- what the runtime asks and tells (the policy protocol; FixedDepth's do nothing) ------

    def needs_costs(self) -> bool:
        """Whether this device's round costs are still to be measured (before the first
        sequence: the runtime's ``calibrate``)."""
        return self.costs is None

    def use_costs(self, costs: CostModel) -> None:
        self.costs = costs

    def widths(self) -> tuple[int, int]:
        """The most first-position siblings a round verifies beside the chain, and the most
        prompt-lookup tokens: what the target's caches and graphs must make room for."""
        return self.max_siblings, self.lookup.tokens if self.lookup is not None else 0

    def report(self) -> dict:
        """What ``bench.json`` records of ``auto`` (its ``calibration``): the costs, and of
        the last request the final acceptance estimates and the measured acceptance at the
        centre of each bin of the draft's confidence (greedy), for the first token also by
        whether prompt lookup proposed the same."""
        return {
            **self.costs.as_dict(),
            "final_acceptance_estimate": [round(r, 4) for r in self.estimate.rates()],
            "acceptance_by_confidence": self.confidence.by_bin(),
            "first_acceptance_by_confidence_with_lookup": {
                "differs": self.lookup_confidence[False].by_bin(),
                "agrees": self.lookup_confidence[True].by_bin(),
            },
        }

    # -- planning and learning ---------------------------------------------------------------

    def sleeping(self) -> bool:
        """Whether the draft sleeps through this round (:class:`Dormancy`); asked once a
        round, before the draft catches up."""
        return self.dormancy.sleeping()

    def plan(self, proposer: EagleProposer, context: Context) -> Plan:
        """1. This round: greedy, the parts of the draft's chain (drafted token by token), its
        siblings and prompt lookup's tokens that promise the most (:meth:`_greedy_plan`), in
        one tree; sampling, the depth the position estimates choose; none past the context's
        room, nothing while asleep."""
        if self.lookup is not None:
            room = context.room if context.awake else 0
            self.lookup.propose(context.prompt, context.output, room=room)
        if not context.awake:
            return Plan(0, dormant=True)
        if self.drafting.sampling:
            return Plan(min(self.estimated_depth(), context.room))
        fan = self._greedy_plan(proposer, context.room) if context.room else Fan([], [], [])
        tree, paths = merged_tree(fan.chains(), self.device)
        return Plan(max(tree.depths.tolist(), default=0), fan=fan, tree=tree, paths=paths)

    def observe(self, plan: Plan, outcome: Outcome, proposer: EagleProposer, stats) -> None:
        """3. What a round teaches: the verification's cost (a sleeping round's: one token's)
        and, when the draft was awake, what :meth:`_learn` takes and whether to sleep; prompt
        lookup's estimates from the emitted tokens; the round's other time."""
        if plan.dormant:
            self.costs.observe_verify(1, outcome.seconds)
        else:
            self._learn(plan, outcome, proposer, stats)
            # one unsure token's plain round is no reason to sleep
            self.dormancy.woke(plan.depth or self.estimated_depth())
        if self.lookup is not None:
            self.lookup.learn(outcome.tokens)
        if outcome.other_seconds is not None:
            self.costs.observe_other(outcome.other_seconds)

    def _learn(self, plan: Plan, outcome: Outcome, proposer: EagleProposer, stats) -> None:
        """A round's lesson: greedy, :meth:`_observe_fan`; sampling, its cost, the positions
        reached and, for a plain round, the first position's would-be acceptance."""
        if plan.fan is not None:
            return self._observe_fan(plan.fan, plan, outcome, stats)
        self.costs.observe_verify(outcome.depth + 1, outcome.seconds)
        self.learn(outcome.depth, outcome.accepted, outcome.bonus, [], None)
        if not outcome.depth:  # the first draft token's chance, had it run
            target_probs = self.drafting.warp(outcome.target_logits[-1])
            self.estimate.counts.observe(1, proposer.first_acceptance(target_probs))

    def _observe_fan(self, fan: Fan, plan: Plan, outcome: Outcome, stats) -> None:
        """What a greedy round teaches: its cost (a tree's, unless it is a chain), the
        siblings' confidences, and the chain's along the accepted path (the chain's tokens on
        it, then the target's next; a chain not verified: its first token against the
        target's); what was verified and accepted is marked in ``stats``."""
        tree, path = plan.tree, outcome.path
        self.costs.observe_verify(1 + len(tree.tokens), outcome.seconds, tree=not tree.is_chain)
        self.learn_siblings(fan.ranked, outcome.target_logits)
        chain, accepted = plan.paths[0], 0  # the chain's tokens on the accepted path
        while accepted < min(len(path), len(chain)) and path[accepted] == chain[accepted]:
            accepted += 1
        # the target's token after them: the path's next, or the bonus where the path ends
        after = int(tree.tokens[path[accepted]]) if accepted < len(path) else outcome.bonus
        self.learn(fan.depth, accepted, after, fan.probs[: fan.depth], fan.next_candidate())
        index = len(stats.accepted_per_round)
        stats.sibling_rounds += bool(fan.siblings)
        if fan.lookups:
            stats.lookup_rounds.append(index)
        if path[:1] in plan.paths[2:]:  # a sibling (one node each), not the chain's first
            stats.sibling_hit_rounds.append(index)

    def _greedy_plan(self, proposer: EagleProposer, room: int) -> Fan:
        """Greedy ``auto``'s round: the draft's chain drafted token by token (:meth:`_walk`),
        then the parts of it, its siblings and prompt lookup's proposal to verify
        (:meth:`best_round`). Where lookup proposes, it is weighed first beside the draft's
        free first token and its siblings: a round of those that promises more than the best
        chain the draft's first-token confidence and the position estimates beyond promise
        drafts nothing."""
        ranked = proposer.candidates(1 + self.max_siblings)
        (top, top_q), ranked = ranked[0], ranked[1:]
        lookup, lookup_rates = self._lookup_proposal(top)
        fan = Fan([top], [top_q], ranked, lookup)
        if lookup:
            guess = [self._calibration(1).acceptance(top_q), *self.estimate.rates()[1:]]
            drafted = max(round_rate(guess[:k], [], self.costs) for k in range(len(guess) + 1))
            rate, choice = self.best_round(fan, guess[:1], lookup_rates, least_lookup=1)
            if rate > drafted:
                return choice
        tokens, probs, candidate = self._walk(proposer, min(self.num_steps, room))
        if tokens:  # else the chain is the draft's first token alone, declined by the walk
            fan.chain, fan.probs, fan.candidate = tokens, probs, candidate
        return self.best_round(fan, self._calibrated(fan.probs), lookup_rates)[1]

    def best_round(
        self, fan: Fan, rates: list[float], lookup_rates: list[float], *, least_lookup: int = 0
    ) -> tuple[float, Fan]:
        """The parts of ``fan`` to verify with the most expected tokens per second
        (:func:`tree_rate`; the fewest tokens on a tie): its whole chain (acceptances
        ``rates``) with its first ``n`` siblings, or no chain; and prompt lookup's first
        ``m >= least_lookup`` tokens (acceptances ``lookup_rates``), beside the chain only
        where the target verifies trees. Returns the rate and ``fan`` with its choice."""
        siblings = [([token], [self.sibling_confidence.acceptance(q)]) for token, q in fan.ranked]
        shapes = [(0, 0), *((len(fan.chain), n) for n in range(len(siblings) + 1))]
        best = None
        for depth, n in shapes:
            for m in range(least_lookup, len(fan.lookup) + 1):
                if depth and m and not self.trees:
                    continue
                chain = (fan.chain[:depth], rates[:depth])
                lookup = (fan.lookup[:m], lookup_rates[:m])
                parts = [part for part in (chain, lookup, *siblings[:n]) if part[0]]
                rate = tree_rate(parts, depth, self.costs)
                if best is None or (rate, -depth - m - n) > best[:2]:
                    best = rate, -depth - m - n, replace(fan, depth=depth, siblings=n, lookups=m)
        return best[0], best[2]

    def _lookup_proposal(self, top: int) -> tuple[list[int], list[float]]:
        """Prompt lookup's proposal this round, noted against the draft's first choice
        ``top``, and its acceptance estimates (none: no ``lookup_tokens``, or no proposal)."""
        if self.lookup is None or self.lookup.proposal is None:
            return [], []
        self.lookup.compare(top)
        proposal = self.lookup.proposal.tolist()
        return proposal, self.lookup.estimate.rates()[: len(proposal)]

    def learn_siblings(self, ranked: list[tuple[int, float]], target_logits: torch.Tensor):
        """Every further candidate of the first position ``(target id, q)`` learns from the
        target's token there (row 0 of any verification), verified or not."""
        if ranked:
            first = int(target_logits[0].argmax())
            for token, q in ranked:
                self.sibling_confidence.observe(q, token == first)

    def _walk(self, proposer: EagleProposer, deepest: int):
        """Greedy ``auto`` drafting, token by token: a token is drafted while the best depth,
        under the calibrated acceptance of the tokens so far (this one's included) and the
        position estimates beyond, is deeper than what is drafted; a draft step is taken only
        while a deeper depth still pays. Returns the tokens (target ids), the draft's
        probability of each, and the declined candidate ``(token, q)`` (``None`` if there was
        none: depth reached or no step taken)."""
        walk = proposer.walk(confidence=True)
        token, q = next(walk)
        q = float(q)
        rates = self.estimate.rates()
        tokens, probs, known = [], [], []
        while True:
            depth = len(tokens)
            guess = [*known, self._calibration(depth + 1).acceptance(q), *rates[depth + 1 :]]
            if best_depth(guess, self.costs) <= depth:
                walk.close()
                return tokens, probs, (int(token), q)
            tokens.append(int(token))
            probs.append(q)
            known.append(guess[depth])
            depth += 1
            if depth == deepest or best_depth([*known, *rates[depth:]], self.costs) <= depth:
                walk.close()
                return tokens, probs, None
            token, q = walk.send(True)
            q = float(q)

    def estimated_depth(self) -> int:
        """The depth the per-position estimates alone choose (``auto``): 0 when drafting does
        not pay in general, whatever the draft's confidence in one token."""
        return best_depth(self.estimate.rates(), self.costs)

    def learn(self, depth: int, accepted: int, bonus: int, probs: list[float], candidate):
        """``auto``'s estimates after a round: the positions reached, the drafted tokens'
        confidences, and the declined candidate when everything drafted was accepted."""
        guess = None if candidate is None else candidate[0] == bonus
        self.estimate.observe(depth, accepted, guess)
        for k, q in enumerate(probs[: accepted + 1], start=1):
            self._calibration(k).observe(q, k <= accepted)
        if candidate is not None and accepted == depth:
            self._calibration(depth + 1).observe(candidate[1], guess)

    def _calibration(self, position: int) -> ConfidenceCalibration:
        """The confidence calibration of the draft's token at ``position`` (1: the first)
        this round: the first's apart where prompt lookup proposes (:attr:`lookup_confidence`,
        by whether its first token is the draft's)."""
        if position == 1 and self.lookup is not None and self.lookup.proposal is not None:
            return self.lookup_confidence[self.lookup.agrees]
        return self.confidence

    def _calibrated(self, probs: list[float]) -> list[float]:
        """The calibrated acceptance of a chain whose tokens the draft gave ``probs``."""
        return [self._calibration(k).acceptance(q) for k, q in enumerate(probs, start=1)]
