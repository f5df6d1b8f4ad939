"""The built-in speculative runtime (batch size 1): an EAGLE-3 draft proposes a chain (or a
tree, :mod:`specforge.serving.tree`) of tokens, the target verifies them in one forward pass, and
the longest accepted prefix plus one token of the target's is emitted. Greedy verification is
lossless: the output equals the target's own greedy decoding token for token (an fp32 property;
see the tests); sampling verification (:mod:`specforge.serving.sampling`) keeps the target's
distribution exactly.

A round, in small verbs:

1. ``draft``: from the draft state after the last accepted token, propose ``num_steps`` tokens,
   each step feeding back the draft's pre-norm hidden state (the serving path of the TTT
   unroll, :meth:`Eagle3DraftModel.forward` with a KV cache);
2. ``verify``: one target forward over ``[last token, d_1 .. d_K]`` with the target's KV cache,
   capturing the aux hidden states the draft needs next;
3. ``accept``: keep ``d_1 .. d_a`` while they equal the target's argmax, then the target's own
   token (the bonus); crop both KV caches to the accepted path and extend the draft over it.

Accept length ``tau`` = emitted tokens / verifications (bonus token counted, so ``tau >= 1``),
as SGLang's "avg accept length" and the EAGLE papers report it (DESIGN §3.6).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from specforge.config import AUTO_MAX_DEPTH
from specforge.engine.cache import SlotKVCache, crop_cache, gather_cache
from specforge.engine.draft import DraftEngine
from specforge.engine.generation import warp_probs
from specforge.engine.prompt_lookup import longest_match
from specforge.engine.target import TargetEngine
from specforge.errors import UserError
from specforge.models.adapter import check_logits, serving_refusal, tree_refusal
from specforge.models.eagle3 import DraftKVCache, Eagle3DraftModel
from specforge.models.kv_cache import growing_cache
from specforge.models.target import target_hidden_states
from specforge.serving.adaptive import (
    AcceptanceEstimate,
    ConfidenceCalibration,
    CostModel,
    Dormancy,
    best_depth,
    best_siblings,
    calibrate,
    first_acceptance,
    round_rate,
    tree_rate,
)
from specforge.serving.sampling import (
    accept_chain_sampling,
    accept_tree_sampling,
    sample,
)
from specforge.serving.tree import (
    accept_greedy,
    build_tree,
    merged_tree,
    row_argmax,
    tree_attention,
    verification_inputs,
)

AUTO_MAX_SIBLINGS = 3
"""Greedy ``auto``'s default for the most further candidates of the first draft position
verified beside the chain (a fan of up to 4 there), within the verification widths
calibrated."""


@dataclass
class SpecStats:
    """Counters of one or many speculative generations."""

    num_steps: int
    verifications: int = 0
    emitted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)
    """Draft tokens accepted in each verification (0..num_steps), the bonus not counted."""
    depth_per_round: list[int] = field(default_factory=list)
    """Draft tokens verified in each round (``num_steps``, or what ``auto`` chose; 0 is a
    plain decoding step)."""
    seconds: float = 0.0
    """Wall time of the whole generation (prefill included)."""
    draft_seconds: float = 0.0
    """Of which proposing draft tokens (chains or trees)."""
    verify_seconds: float = 0.0
    """Of which the target's verification forwards (the tree mask and the logits included)."""
    extend_seconds: float = 0.0
    """Of which the draft's extension over each round's accepted tokens (with the target's
    features), which also yields the next round's first draft token."""
    prefill_seconds: float = 0.0
    """Of which the prefills: the target over the prompt and the draft over its features."""
    target_prefill_seconds: float = 0.0
    """Of the prefills, the target's forward over the prompt and its first token: what
    decoding with the target alone pays too."""
    dormant_rounds: int = 0
    """Plain rounds the draft slept through (``auto``: no extension, no decision)."""
    sibling_rounds: int = 0
    """Rounds that verified siblings of the first draft token (greedy ``auto``)."""
    sibling_hit_rounds: list[int] = field(default_factory=list)
    """The rounds (indices into :attr:`accepted_per_round`) in which a sibling, not the
    chain's first token, was the target's token: their accepted token counts in ``tau`` but
    not in the chain's :attr:`acceptance_per_position`."""
    lookup_rounds: list[int] = field(default_factory=list)
    """The rounds (indices into :attr:`accepted_per_round`) that verified prompt-lookup tokens,
    instead of the draft's or beside them in one tree (greedy ``auto`` with ``lookup_tokens``):
    their tokens count in ``tau`` but not in the draft's :attr:`acceptance_per_position`."""

    @property
    def tau(self) -> float:
        """Emitted tokens per target verification (the bonus token counted)."""
        return self.emitted / max(self.verifications, 1)

    @property
    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accepted_per_round).items()))

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft token k accepted | tokens < k accepted), k = 1..num_steps, for the chain
        (a sibling accepted in its place counts as the chain's first token rejected)."""
        rates = []
        # rounds recorded without a depth ran the fixed num_steps
        depths = self.depth_per_round or [self.num_steps] * len(self.accepted_per_round)
        chain, depths = list(self.accepted_per_round), list(depths)
        for index in self.sibling_hit_rounds:
            chain[index] = 0  # the chain's own first token was rejected
        for index in self.lookup_rounds:
            chain[index] = depths[index] = 0  # the draft proposed nothing there
        rounds = list(zip(chain, depths, strict=True))
        for k in range(1, self.num_steps + 1):
            reached = sum(a >= k - 1 and depth >= k for a, depth in rounds)
            accepted = sum(a >= k for a, _ in rounds)
            rates.append(accepted / reached if reached else 0.0)
        return rates

    @property
    def depth_histogram(self) -> dict[int, int]:
        """Rounds per verified depth (what ``num_steps: auto`` chose)."""
        return dict(sorted(Counter(self.depth_per_round).items()))

    def merge(self, other: SpecStats) -> None:
        offset = len(self.accepted_per_round)
        self.sibling_hit_rounds.extend(offset + index for index in other.sibling_hit_rounds)
        self.lookup_rounds.extend(offset + index for index in other.lookup_rounds)
        self.verifications += other.verifications
        self.emitted += other.emitted
        self.accepted_per_round.extend(other.accepted_per_round)
        self.depth_per_round.extend(other.depth_per_round)
        self.seconds += other.seconds
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        self.extend_seconds += other.extend_seconds
        self.prefill_seconds += other.prefill_seconds
        self.target_prefill_seconds += other.target_prefill_seconds
        self.dormant_rounds += other.dormant_rounds
        self.sibling_rounds += other.sibling_rounds


def _chain_draft_engine(draft_model, topk: int, engine, draft_engine) -> DraftEngine | None:
    """What runs a chain's draft forwards: ``draft_engine``, else one replaying CUDA graphs
    where the target's engine does; none for a tree (its draft keeps its own cache)."""
    if topk > 1:
        return None
    if draft_engine is None and engine is not None and engine.graphs:
        return DraftEngine(draft_model, graphs=True)
    return draft_engine


def _check_slot(cache: SlotKVCache, position: int) -> None:
    """A chain's draft positions are its cache's slots: the next one is the cache's length."""
    if position != cache.length:
        raise RuntimeError(f"draft position {position} is not the draft cache's next slot")


def _joined(pending, new):
    """``new`` (tokens (1, T), aux rows (1, T, H)) after ``pending`` (the same, or ``None``)."""
    if pending is None:
        return new
    return tuple(torch.cat([old, more], 1) for old, more in zip(pending, new, strict=True))


def _checked_depth(num_steps, topk: int, num_draft_tokens: int | None, max_siblings: int) -> int:
    """The draft depth the runtime works with (``auto``: :data:`AUTO_MAX_DEPTH`), after
    checking the drafting settings.

    Raises:
        UserError: a setting out of range, or settings that do not go together.
    """
    if num_steps == "auto":
        if topk != 1:
            raise UserError(f"num_steps auto drafts chains only (topk 1), got topk={topk}")
        num_steps = AUTO_MAX_DEPTH
    if not isinstance(num_steps, int):
        raise UserError(f"num_steps must be an integer or 'auto', got {num_steps!r}")
    if num_steps < 1 or topk < 1:
        raise UserError(f"num_steps and topk must be >= 1, got {num_steps}, {topk}")
    if not 0 <= max_siblings <= AUTO_MAX_DEPTH:
        raise UserError(f"max_siblings must be in 0..{AUTO_MAX_DEPTH}, got {max_siblings}")
    _check_tree_size(topk, num_steps, num_draft_tokens)
    return num_steps


def _check_decoding(temperature: float, top_p: float, lookup_tokens: int, *, auto: bool) -> None:
    """Refuse sampling settings out of range, and prompt lookup beside a fixed depth or
    sampling (:class:`PromptLookup` competes with greedy ``auto``'s draft only)."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise UserError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    if lookup_tokens < 0 or (lookup_tokens and (not auto or temperature > 0)):
        raise UserError(
            f"lookup_tokens needs num_steps auto and greedy decoding, got {lookup_tokens}"
        )


def _check_tree_size(topk: int, num_steps: int, num_draft_tokens: int | None) -> None:
    """A tree (``topk > 1``) needs a size between 2 and the most its levels hold."""
    largest = 1 + topk + (num_steps - 1) * topk * topk
    if topk > 1 and not (num_draft_tokens and 2 <= num_draft_tokens <= largest):
        raise UserError(
            f"tree drafting needs 2 <= num_draft_tokens <= {largest} for topk={topk}, "
            f"num_steps={num_steps}; got {num_draft_tokens}"
        )


@dataclass
class PromptLookup:
    """Greedy ``auto``'s prompt-lookup proposals and what it learnt of them."""

    tokens: int
    """The most tokens proposed (and verified) in a round."""
    match_buckets: ClassVar[tuple[int, ...]] = (2, 3, 5)
    """The match lengths (:func:`~specforge.engine.prompt_lookup.longest_match`) from which a
    proposal is learnt apart: 1, 2, 3-4 and 5 or more tokens (a proposal after a longer match
    is accepted far more often)."""
    estimates: dict[tuple[bool, int], AcceptanceEstimate] = field(init=False)
    """Running acceptance per position of the proposals, by whether they start with the
    draft's first choice (one it agrees with is accepted far more often) and by their match
    length's bucket, learnt from every round's emitted tokens, verified or not."""
    proposal: torch.Tensor | None = None
    """This round's proposal (``None``: none)."""
    agrees: bool = False
    """Whether :attr:`proposal` starts with the draft's first choice (:meth:`compare`)."""
    bucket: int = 0
    """:attr:`proposal`'s match-length bucket: how many of :attr:`match_buckets` its match
    length reaches (0: a match of one token)."""

    def __post_init__(self) -> None:
        self.estimates = {
            (agrees, bucket): AcceptanceEstimate(self.tokens)
            for agrees in (False, True)
            for bucket in range(len(self.match_buckets) + 1)
        }

    @property
    def estimate(self) -> AcceptanceEstimate:
        """The estimate this round's proposal falls under."""
        return self.estimates[self.agrees, self.bucket]

    def propose(self, prompt: torch.Tensor, output: list[int], *, awake: bool) -> None:
        """This round's :attr:`proposal` after ``prompt`` (T,) and ``output``: ``None`` while
        the draft sleeps or when the last token occurs nowhere earlier."""
        self.proposal, self.agrees, self.bucket = None, False, 0
        if awake:
            sequence = torch.cat([prompt.cpu(), torch.tensor(output)])
            proposal, matched = self.candidates(sequence)
            self.proposal = proposal if len(proposal) else None
            self.bucket = sum(matched >= length for length in self.match_buckets)

    def candidates(self, sequence: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The proposal after ``sequence`` (L,) and its match length
        (:func:`~specforge.engine.prompt_lookup.longest_match`)."""
        return longest_match(sequence, num_tokens=self.tokens)

    def compare(self, draft_first: int) -> None:
        """Note whether the proposal starts with ``draft_first``, the draft's first choice
        (target id) this round."""
        self.agrees = self.proposal is not None and int(self.proposal[0]) == draft_first

    def learn(self, emitted: list[int]) -> None:
        """The estimates after a round, from its emitted tokens (the target's own, whatever
        was verified): the proposal's positions up to its first difference from them, as far
        as the round reached."""
        if self.proposal is not None:
            reached = min(len(self.proposal), len(emitted))
            matched = 0
            while matched < reached and int(self.proposal[matched]) == emitted[matched]:
                matched += 1
            self.estimate.observe(reached, matched)


@dataclass
class Fan:
    """A greedy ``auto`` round verified as one tree (:func:`merged_tree`): the draft's chain,
    further candidates for its first position beside it, and prompt lookup's first tokens."""

    chain: list[int]
    """The draft's chain (target ids), drafted step by step."""
    probs: list[float]
    """The draft's probability of each chain token."""
    ranked: list[tuple[int, float]]
    """The first position's further draft candidates ``(target id, q)``, most likely first:
    all learn from the target's first token, verified or not."""
    siblings: int = 0
    """How many of :attr:`ranked` are verified."""
    lookup: list[int] = field(default_factory=list)
    """Prompt lookup's tokens verified beside the draft's (none: the draft's only)."""
    candidate: tuple[int, float] | None = None
    """The chain's declined next token ``(target id, q)``, as :meth:`SpeculativeDecoder.
    _draft_auto` returns it."""

    def chains(self) -> list[list[int]]:
        """What the tree merges: the chain first (its rows lead), then lookup, then the
        siblings."""
        return [self.chain, self.lookup, *([token] for token, _ in self.ranked[: self.siblings])]


class SpeculativeDecoder:
    """Chain (``topk=1``) or tree drafting with greedy or sampling verification, one sequence
    at a time.

    Sampling at a fixed depth is reproducible from the generator's seed, token for token. Under
    ``num_steps="auto"`` each round's depth follows measured wall-clock costs and decides how
    many random numbers the round draws, so a sampled ``auto`` run is reproducible in
    distribution (lossless) but not token for token; greedy outputs are always the target's.
    """

    def __init__(
        self,
        target_model,
        draft_model: Eagle3DraftModel,
        *,
        aux_layer_ids: list[int],
        num_steps: int | str = 5,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_siblings: int = AUTO_MAX_SIBLINGS,
        lookup_tokens: int = 0,
        engine: TargetEngine | None = None,
        draft_engine: DraftEngine | None = None,
    ):
        """
        Args:
            target_model: the HF target (eval mode).
            draft_model: the draft (e.g. from :func:`load_exported_draft`), in any dtype: its
                logits are read in float32, and only its proposals depend on its precision.
            aux_layer_ids: the target layers the draft was trained on.
            num_steps: draft depth (tokens per chain), or ``"auto"``: each round the depth in
                ``0 .. AUTO_MAX_DEPTH`` with the most expected tokens per second, decided token
                by token from the draft's calibrated confidence when greedy, from the position
                estimates when sampling (:mod:`specforge.serving.adaptive`; chains only).
            topk: branches per step; 1 drafts a chain.
            num_draft_tokens: tree size including the root (tree drafting only).
            temperature: 0 verifies greedily; > 0 samples (lossless rejection sampling).
            top_p: nucleus filtering of the target distribution when sampling.
            max_siblings: greedy ``auto``: at most this many further candidates for the first
                draft position verified beside the chain where the costs say they pay (0:
                chains only; none on a target whose attention cannot verify a tree).
            lookup_tokens: greedy ``auto``: prompt lookup's up to this many tokens (may pass
                ``num_steps``; :func:`~specforge.engine.prompt_lookup.longest_match`) are
                verified instead of the draft's, or beside them in one tree, in a round where
                their acceptance promises more tokens per second (0: the draft's always).
            engine: a :class:`~specforge.engine.target.TargetEngine` over ``target_model`` that
                runs its forwards, or ``None``: transformers' forward with a growing cache.
            draft_engine: runs a chain's draft forwards (:class:`~specforge.engine.draft.
                DraftEngine`); default: CUDA graphs where ``engine`` replays them, else none.

        Raises:
            UserError: inconsistent drafting settings, or a target the runtime cannot serve
                (recurrent layers; a tree on flash attention), before any generation.
        """
        self.auto = num_steps == "auto"
        num_steps = _checked_depth(num_steps, topk, num_draft_tokens, max_siblings)
        _check_decoding(temperature, top_p, lookup_tokens, auto=self.auto)
        no_tree = None if engine is not None else tree_refusal(target_model)
        refusal = serving_refusal(target_model) or (topk > 1 and no_tree)
        if refusal:
            raise UserError(refusal)
        self.target, self.engine = target_model, engine
        self.transform = check_logits(target_model)
        """What the target does to ``lm_head``'s output (verification uses its logits)."""
        self.draft_model = draft_model
        self.draft_engine = _chain_draft_engine(draft_model, topk, engine, draft_engine)
        self.aux_layer_ids, self.num_steps = list(aux_layer_ids), num_steps
        self.topk, self.num_draft_tokens = topk, num_draft_tokens
        self.temperature, self.top_p = temperature, top_p
        self.generator: torch.Generator | None = None
        self.device = next(target_model.parameters()).device
        self.estimate = AcceptanceEstimate(num_steps) if self.auto else None
        """Running conditional acceptance per draft position (``auto`` only)."""
        self.confidence = ConfidenceCalibration() if self.auto else None
        """Acceptance given the draft's own probability of its token (greedy ``auto`` only)."""
        self.lookup_confidence = (ConfidenceCalibration(), ConfidenceCalibration())
        """The same for the draft's first token where prompt lookup proposes another first
        token, and where it proposes the same (greedy ``auto`` with ``lookup_tokens``)."""
        self.sibling_confidence = ConfidenceCalibration() if self.auto else None
        """The same for the first position's further candidates (greedy ``auto`` only)."""
        self.trees = not no_tree
        """Whether the target can verify a tree (greedy ``auto``'s siblings, lookup beside)."""
        self.max_siblings = max_siblings if self.trees else 0
        self.costs: CostModel | None = None
        """This device's round costs (``auto``; measured by :meth:`calibrate`)."""
        self.lookup = PromptLookup(lookup_tokens) if lookup_tokens else None
        """Prompt lookup competing with the draft (``lookup_tokens``)."""

    @torch.no_grad()
    def calibrate(self, input_ids: torch.Tensor, *, context: int = 256) -> CostModel:
        """Measure :attr:`costs` after a ``context``-token prefix (``input_ids`` (1, T)
        repeated): the target's forward over 1 .. ``num_steps + 1`` new tokens, one draft
        step."""
        ids = input_ids.to(self.device).repeat(1, -(-context // input_ids.shape[1]))[:, :context]
        target_cache, draft_cache = self._target_cache(context), self._draft_cache(context)
        _, aux = self._target_forward(ids, target_cache, logits_to_keep=1)
        _, hidden = self._draft_extend(ids[:, 1:], aux[:, :-1], 0, draft_cache)
        token = ids[:, -1:]

        def verify(n: int) -> None:
            self._target_forward(token.repeat(1, n), target_cache)
            crop_cache(target_cache, context)

        def draft_step() -> None:  # what a round's draft step runs
            self._draft_step(token[0], hidden, context - 1, draft_cache)
            crop_cache(draft_cache, context - 1)

        self.costs = calibrate(verify, draft_step, max_depth=self._widest_chain, clock=self._clock)
        return self.costs

    @property
    def _widest_chain(self) -> int:
        """The most tokens a round verifies after its last token, siblings aside: the draft's
        depth, or prompt lookup's longer proposals (``lookup_tokens``)."""
        return max(self.num_steps, self.lookup.tokens if self.lookup is not None else 0)

    # -- the target --------------------------------------------------------------------------

    def _target_cache(self, tokens: int):
        """An empty target cache with room for ``tokens`` plus the widest verification."""
        if self.engine is None:
            return growing_cache()
        widest = 1 + max(self._widest_chain, self.num_draft_tokens or 0) + self.max_siblings
        return self.engine.new_cache(tokens + widest)

    @torch.no_grad()
    def _target_forward(
        self, input_ids: torch.Tensor, cache, positions=None, logits_to_keep=0, visible=None
    ):
        """Target logits (T, V) and fused-aux inputs (1, T, 3 * Ht) for new tokens ``input_ids``
        (1, T), extending ``cache`` (tree verification passes positions and, through the
        engine, the (T, T) ``visible`` table; else inside :func:`tree_attention`).
        ``logits_to_keep``: logits of the last this many positions only (0: all; a prefill
        needs its last alone, as HF's ``generate`` computes)."""
        if self.engine is not None:
            keep = logits_to_keep
            return self.engine.forward(
                input_ids, cache, positions=positions, visible=visible, logits_to_keep=keep
            )
        states = target_hidden_states(
            self.target,
            input_ids,
            aux_layer_ids=self.aux_layer_ids,
            past_key_values=cache,
            position_ids=positions,
        )
        logits = self.target.get_output_embeddings()(states.last_hidden_state[0, -logits_to_keep:])
        return self.transform(logits.float()), states.aux_hidden_states

    # -- the draft ---------------------------------------------------------------------------

    def _draft_cache(self, tokens: int):
        """An empty draft cache with room for ``tokens`` plus the deepest chain."""
        if self.draft_engine is None:
            return DraftKVCache()
        return self.draft_engine.new_cache(tokens + self.num_steps + 1)

    @torch.no_grad()
    def _draft_extend(self, tokens: torch.Tensor, aux: torch.Tensor, start: int, cache):
        """Run the draft over new positions ``start .. start + T - 1`` (token ``t + 1`` and the
        target feature at ``t`` each); returns the last position's logits and hidden state."""
        if isinstance(cache, SlotKVCache):  # through the draft engine: positions are slots
            _check_slot(cache, start)
            return self.draft_engine.forward(tokens, aux, cache, extend=True)
        positions = torch.arange(start, start + tokens.shape[1], device=self.device)[None]
        logits, hidden = self.draft_model(
            tokens, self.draft_model.fuse(aux), positions, cache=cache, logits_to_keep=1
        )
        return logits[0, -1].float(), hidden[:, -1:]  # float32 whatever the draft's dtype

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def _draft_token(self, logits: torch.Tensor):
        """The next draft token (target id) and, when sampling, the draft distribution it was
        drawn from on the target vocabulary."""
        if not self.sampling:
            return self.draft_model.to_target_ids(logits.argmax(-1, keepdim=True)), None
        q = warp_probs(logits, self.temperature, self.top_p)
        draft_id = torch.multinomial(q, 1, generator=self.generator)
        vocab_size = self.draft_model.t2d.numel()
        hot_ids = self.draft_model.hot_ids
        q_target = torch.zeros(vocab_size, device=q.device).index_copy(0, hot_ids, q)
        return self.draft_model.to_target_ids(draft_id), q_target

    @torch.no_grad()
    def draft(
        self, logits: torch.Tensor, hidden: torch.Tensor, position: int, cache, steps: int = 0
    ):
        """1. Propose ``steps`` (default ``num_steps``) target ids as a chain, starting from the
        draft's logits and hidden state at ``position`` (the last accepted feature). Returns the
        tokens (K,) and, when sampling, their draft distributions (K, V)."""
        steps = steps or self.num_steps
        tokens, dists = [], []
        for k in range(steps):
            token, dist = self._draft_token(logits)
            tokens.append(token)
            dists.append(dist)
            if k == steps - 1:
                break
            logits, hidden = self._draft_step(token, hidden, position + 1 + k, cache)
        return torch.cat(tokens), (torch.stack(dists) if self.sampling else None)

    def _draft_step(self, token: torch.Tensor, hidden: torch.Tensor, position: int, cache):
        """One draft forward over ``token`` (1,) at ``position`` after ``hidden`` (1, 1, H):
        the next logits (float32 whatever the draft's dtype) and hidden state."""
        if isinstance(cache, SlotKVCache):
            _check_slot(cache, position)
            return self.draft_engine.forward(token[None], hidden, cache, extend=False)
        step_position = torch.tensor([[position]], device=self.device)
        step_logits, hidden = self.draft_model(token[None], hidden, step_position, cache=cache)
        return step_logits[0, -1].float(), hidden

    @staticmethod
    def accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
        """3. Greedy acceptance: the number ``a`` of leading draft tokens equal to the target's
        argmax, and the target's token after them (the bonus)."""
        predicted, accepted = row_argmax(target_logits), 0  # rows 0 .. K
        for token in draft_tokens.tolist():
            if predicted(accepted) != token:
                break
            accepted += 1
        return accepted, predicted(accepted)

    def _clock(self) -> float:
        """Wall time, after the device's queued work (so phases are timed on CUDA too)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _chain_round(
        self, next_token, length, draft_logits, hidden, target_cache, draft_cache, stats
    ):
        """One chain round; returns the emitted tokens, accepted count and their aux rows."""
        # 0-1. depth and draft: fixed, or the cost-aware choice (greedy: token by token, from
        # the draft's confidence; sampling: from the position estimates)
        start = self._clock()
        draft_tokens, draft_probs, fan = None, None, None
        if self.auto and not self.sampling:
            fan = self._greedy_plan(draft_logits, hidden, length - 1, draft_cache)
            if isinstance(fan, int) or fan.siblings or fan.lookup:
                stats.draft_seconds += self._clock() - start
                if isinstance(fan, int):  # prompt lookup's first tokens promise the most
                    return self._lookup_round(next_token, length, fan, target_cache, stats)
                return self._fan_round(next_token, length, fan, target_cache, stats)
            depth = len(fan.chain)
            if depth:
                draft_tokens = torch.tensor(fan.chain, device=self.device)
        else:
            depth = self._estimated_depth() if self.auto else self.num_steps
            if depth:
                draft_tokens, draft_probs = self.draft(
                    draft_logits, hidden, length - 1, draft_cache, steps=depth
                )
        drafted = self._clock()
        stats.draft_seconds += drafted - start
        # 2. verify: [last token, d_1 .. d_K] at positions length .. length + K
        verify_ids = torch.tensor([next_token], device=self.device)
        if depth:
            verify_ids = torch.cat([verify_ids, draft_tokens[:depth]])
        target_logits, aux = self._target_forward(verify_ids[None], target_cache)
        verify_seconds = self._clock() - drafted
        stats.verify_seconds += verify_seconds
        if self.auto:
            self.costs.observe_verify(depth + 1, verify_seconds)
        # 3. accept
        if not depth:
            accepted, bonus = 0, self._plain_token(target_logits[-1])
        elif self.sampling:
            target_probs = warp_probs(target_logits, self.temperature, self.top_p)
            accepted, bonus = accept_chain_sampling(
                draft_tokens[:depth], draft_probs[:depth], target_probs, self.generator
            )
        else:
            accepted, bonus = self.accept(draft_tokens[:depth], target_logits)
        if fan is not None:
            self._learn(depth, accepted, bonus, fan.probs, fan.candidate)
            self._learn_siblings(fan.ranked, target_logits)
        elif self.auto:
            self._learn(depth, accepted, bonus, [], None)
            if self.sampling and not depth:  # what the first draft token's chance would have been
                draft_probs = warp_probs(draft_logits, self.temperature, self.top_p)
                target_probs = warp_probs(target_logits[-1], self.temperature, self.top_p)
                chance = first_acceptance(draft_probs, target_probs[self.draft_model.hot_ids])
                self.estimate.counts.observe(1, chance)
        stats.depth_per_round.append(depth)
        crop_cache(target_cache, length + 1 + accepted)
        emitted = (draft_tokens[:accepted].tolist() if depth else []) + [bonus]
        return emitted, accepted, aux[:, : accepted + 1]

    def _greedy_plan(self, draft_logits, hidden, position: int, draft_cache) -> int | Fan:
        """Greedy ``auto``'s proposal for a round: a number of prompt lookup's tokens to verify
        alone, or a :class:`Fan` (a chain, alone or in a tree with siblings and lookup's
        tokens). Lookup is weighed first (:meth:`_lookup_first`); when the draft drafts, the
        chain and its siblings are weighed against and beside lookup (:meth:`_with_lookup`)."""
        needed = self.max_siblings or self.lookup is not None
        ranked = self._first_candidates(draft_logits) if needed else []
        first = self._lookup_first(ranked)
        if first is not None:
            return first
        draft_tokens, probs, candidate = self._draft_auto(
            draft_logits, hidden, position, draft_cache
        )
        draft_tokens, probs, candidate, ranked, siblings = self._siblings(
            ranked, draft_tokens, probs, candidate
        )
        chain = [] if draft_tokens is None else draft_tokens.tolist()
        return self._with_lookup(Fan(chain, probs, ranked, siblings, candidate=candidate))

    def _first_candidates(self, draft_logits: torch.Tensor) -> list[tuple[int, float]]:
        """The draft's most likely first tokens ``(target id, q)``, most likely first: enough
        for its chain's first token and :attr:`max_siblings` others (what prompt lookup's tree
        and the siblings choose from)."""
        q, draft_ids = (
            draft_logits.float().softmax(-1).topk(min(2 + self.max_siblings, len(draft_logits)))
        )
        return list(
            zip(self.draft_model.to_target_ids(draft_ids).tolist(), q.tolist(), strict=True)
        )

    def _sibling_chains(self, ranked: list[tuple[int, float]]):
        """Further first-position candidates ``(target id, q)`` as one-token chains with their
        calibrated acceptance (what :func:`tree_rate` weighs)."""
        return [([token], [self.sibling_confidence.acceptance(q)]) for token, q in ranked]

    def _lookup_first(self, ranked: list[tuple[int, float]]) -> int | Fan | None:
        """Before any draft step: prompt lookup's proposal, alone (its depth) or as a tree
        beside the draft's most likely first tokens (free: their logits came with the
        extension), when that promises more tokens per second than the best chain that the
        draft's confidence in its first token and the position estimates beyond promise; else
        ``None``. Such a round drafts nothing (it pays its verification and the round's other
        time only); when the draft is drafted, :meth:`_with_lookup` weighs lookup again."""
        if self.lookup is None or self.lookup.proposal is None:
            return None
        (top, top_q), further = ranked[0], ranked[1 : 1 + self.max_siblings]
        self.lookup.compare(top)
        rates, depth = self._lookup_plan()
        if not depth:
            return None
        guess = [self._calibration(1).acceptance(top_q), *self.estimate.rates()[1:]]
        drafted = max(round_rate(guess[:k], [], self.costs) for k in range(len(guess) + 1))
        best, choice = round_rate(rates[:depth], [], self.costs), depth
        if self.trees:
            firsts = [([top], guess[:1]), *self._sibling_chains(further)]
            rate, tokens, count = self._lookup_tree([], firsts, 0, rates, least=1)
            if rate > best:
                best, choice = rate, Fan([top], [top_q], further, count - 1, tokens)
        return choice if best > drafted else None

    def _with_lookup(self, fan: Fan) -> int | Fan:
        """After drafting: ``fan`` as drafted, prompt lookup's tokens alone (their count) in
        its place, or both in one tree (the siblings chosen again beside them): whichever
        promises the most tokens per second under the draft's calibrated confidence and the
        lookup estimates (``fan`` without ``lookup_tokens`` or a proposal)."""
        rates, depth = self._lookup_plan()
        if not depth:
            return fan
        drafted = [(fan.chain, self._calibrated(fan.probs))]
        others = self._sibling_chains(fan.ranked)
        steps = len(fan.chain)
        best = tree_rate(drafted + others[: fan.siblings], steps, self.costs)
        choice: int | Fan = fan
        alone = round_rate(rates[:depth], [], self.costs)
        if alone > best:
            best, choice = alone, depth
        if self.trees and fan.chain:
            rate, tokens, count = self._lookup_tree(drafted, others, steps, rates, least=0)
            if rate > best:
                choice = replace(fan, siblings=count, lookup=tokens)
        return choice

    def _lookup_tree(self, chains, others, steps: int, rates: list[float], *, least: int):
        """The best tree of ``chains`` (``(tokens, acceptances)`` pairs, ``steps`` of them
        drafted), prompt lookup's first ``m >= 1`` tokens and the first ``n >= least`` of
        ``others``: its expected tokens per second (:func:`tree_rate`), those tokens and
        ``n`` (the fewer on a tie)."""
        proposal = self.lookup.proposal.tolist()
        options = [(m, n) for m in range(1, len(rates) + 1) for n in range(least, len(others) + 1)]
        rated = [
            (tree_rate([*chains, (proposal[:m], rates[:m]), *others[:n]], steps, self.costs), m, n)
            for m, n in options
        ]
        rate, m, n = max(rated, key=lambda option: (option[0], -option[1], -option[2]))
        return rate, proposal[:m], n

    def _lookup_plan(self) -> tuple[list[float], int]:
        """Prompt lookup's acceptance estimates for this round's proposal and the depth with
        the most expected tokens per second under them (0: no ``lookup_tokens``, no proposal,
        or no depth pays)."""
        if self.lookup is None or self.lookup.proposal is None:
            return [], 0
        rates = self.lookup.estimate.rates()[: len(self.lookup.proposal)]
        return rates, best_depth(rates, self.costs)

    def _lookup_round(self, next_token, length, depth, target_cache, stats):
        """A round verifying the first ``depth`` prompt-lookup tokens instead of the draft's;
        returns what :meth:`_chain_round` does."""
        start = self._clock()
        proposal = self.lookup.proposal[:depth]
        verify_ids = torch.cat([torch.tensor([next_token]), proposal]).to(self.device)
        target_logits, aux = self._target_forward(verify_ids[None], target_cache)
        seconds = self._clock() - start
        stats.verify_seconds += seconds
        self.costs.observe_verify(depth + 1, seconds)
        accepted, bonus = self.accept(proposal, target_logits)
        stats.lookup_rounds.append(len(stats.accepted_per_round))
        stats.depth_per_round.append(depth)
        crop_cache(target_cache, length + 1 + accepted)
        return proposal[:accepted].tolist() + [bonus], accepted, aux[:, : accepted + 1]

    def _fan_round(self, next_token, length, fan: Fan, target_cache, stats):
        """Greedy ``auto``'s tree round: verify ``fan`` as one tree (:func:`merged_tree`),
        accept the longest matching path, keep its cache rows only; the chain learns from the
        target's tokens along it. Returns what :meth:`_chain_round` does."""
        tree, paths = merged_tree(fan.chains(), self.device)
        target_logits, aux, seconds = self._verify_tree(
            tree, next_token, length, target_cache, stats
        )
        self.costs.observe_verify(1 + len(tree.tokens), seconds, tree=True)  # root and tree
        self._learn_siblings(fan.ranked, target_logits)
        path, bonus = accept_greedy(tree, target_logits)
        chain, accepted = paths[0], 0  # the chain's tokens on the accepted path
        while accepted < min(len(path), len(chain)) and path[accepted] == chain[accepted]:
            accepted += 1
        # the target's token after them: the path's next, or the bonus where the path ends
        after = int(tree.tokens[path[accepted]]) if accepted < len(path) else bonus
        self._learn(len(chain), accepted, after, fan.probs, fan.candidate)
        stats.depth_per_round.append(int(tree.depths.max()))
        index = len(stats.accepted_per_round)
        stats.sibling_rounds += bool(fan.siblings)
        if fan.lookup:
            stats.lookup_rounds.append(index)
        if path[:1] in paths[2:]:  # a sibling (one node each), not the chain's first token
            stats.sibling_hit_rounds.append(index)
        return self._keep_path(tree, path, bonus, length, target_cache, aux)

    def _verify_tree(self, tree, next_token: int, length: int, target_cache, stats):
        """The target's forward over the root ``next_token`` and ``tree`` with the tree mask
        (timed into ``stats.verify_seconds``): its logits and fused-aux inputs per row, and the
        seconds it took."""
        start = self._clock()
        ids, positions, visible = verification_inputs(tree, next_token, length)
        if self.engine is not None:
            target_logits, aux = self._target_forward(ids, target_cache, positions, visible=visible)
        else:
            with tree_attention(self.target, positions[0], visible, prefix=length):
                target_logits, aux = self._target_forward(ids, target_cache, positions)
        seconds = self._clock() - start
        stats.verify_seconds += seconds
        return target_logits, aux, seconds

    @staticmethod
    def _keep_path(tree, path: list[int], bonus: int, length: int, target_cache, aux):
        """Keep the accepted ``path``'s cache rows only; returns what a round returns: the
        emitted tokens, how many draft tokens were accepted and their aux rows."""
        rows = [0] + [node + 1 for node in path]
        gather_cache(target_cache, length, rows)
        return [int(tree.tokens[node]) for node in path] + [bonus], len(path), aux[:, rows]

    def _learn_siblings(self, ranked: list[tuple[int, float]], target_logits: torch.Tensor):
        """Every further candidate of the first position ``(target id, q)`` learns from the
        target's token there (row 0 of any verification), verified or not."""
        if ranked:
            first = int(target_logits[0].argmax())
            for token, q in ranked:
                self.sibling_confidence.observe(q, token == first)

    def _draft_auto(self, logits: torch.Tensor, hidden: torch.Tensor, position: int, cache):
        """Greedy ``auto`` drafting, token by token: a token is drafted while the best depth,
        under the calibrated acceptance of the tokens so far (this one's included) and the
        position estimates beyond, is deeper than what is drafted; a draft step is taken only
        while a deeper depth still pays. Returns the tokens (K,) or ``None``, the draft's
        probability of each, and the declined candidate ``(token, q)`` (``None`` if there was
        none: depth reached or no step taken)."""
        rates = self.estimate.rates()
        tokens, probs, known = [], [], []
        while True:
            q, draft_id = logits.float().softmax(-1).max(-1)
            token, q = self.draft_model.to_target_ids(draft_id[None]), float(q)
            depth = len(tokens)
            guess = [*known, self._calibration(depth + 1).acceptance(q), *rates[depth + 1 :]]
            if best_depth(guess, self.costs) <= depth:
                # K x (1,) -> (K,)
                return (torch.cat(tokens) if tokens else None), probs, (int(token), q)
            tokens.append(token)
            probs.append(q)
            known.append(guess[depth])
            depth += 1
            if depth == self.num_steps or best_depth([*known, *rates[depth:]], self.costs) <= depth:
                return torch.cat(tokens), probs, None
            logits, hidden = self._draft_step(token, hidden, position + depth, cache)

    def _siblings(self, candidates, tokens, probs: list[float], candidate):
        """Greedy ``auto``: the first position's next most likely draft tokens (of
        ``candidates``, :meth:`_first_candidates`) and how many of them to verify beside the
        chain (:func:`best_siblings`); a plain round becomes a depth-1 round when its first
        token and siblings together pay. Returns the chain's tokens, probabilities and declined
        candidate (updated when a plain round drafts), the ranked further candidates
        ``(target id, q)`` and how many of them to verify."""
        if not self.max_siblings:
            return tokens, probs, candidate, [], 0
        # the chain's own first token is not a sibling
        first = int(tokens[0]) if tokens is not None else None
        ranked = [(token, value) for token, value in candidates if token != first]
        if first is None:  # a plain round, unless the most likely token and its siblings pay
            (top, top_q), ranked = ranked[0], ranked[1 : 1 + self.max_siblings]
            chain = [self._calibration(1).acceptance(top_q)]
            rates = [self.sibling_confidence.acceptance(value) for _, value in ranked]
            count = best_siblings(rates, chain, self.costs)
            plain = round_rate([], [], self.costs)
            if not count or round_rate(chain, rates[:count], self.costs) <= plain:
                return tokens, probs, candidate, ranked, 0
            return torch.tensor([top], device=self.device), [top_q], None, ranked, count
        ranked = ranked[: self.max_siblings]
        chain = self._calibrated(probs)
        rates = [self.sibling_confidence.acceptance(value) for _, value in ranked]
        return tokens, probs, candidate, ranked, best_siblings(rates, chain, self.costs)

    def _estimated_depth(self) -> int:
        """The depth the per-position estimates alone choose (``auto``): 0 when drafting does
        not pay in general, whatever the draft's confidence in one token."""
        return best_depth(self.estimate.rates(), self.costs)

    def _learn(self, depth: int, accepted: int, bonus: int, probs: list[float], candidate):
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

    def _plain_round(self, next_token: int, target_cache, stats: SpecStats):
        """A round the draft sleeps through (``auto``'s dormancy): the target decodes one
        token alone, keeping the aux row the draft extends over when it wakes."""
        start = self._clock()
        logits, aux = self._target_forward(
            torch.tensor([[next_token]], device=self.device), target_cache
        )
        verify_seconds = self._clock() - start
        stats.verify_seconds += verify_seconds
        self.costs.observe_verify(1, verify_seconds)
        stats.depth_per_round.append(0)
        stats.dormant_rounds += 1
        return [self._plain_token(logits[-1])], 0, aux

    def _plain_token(self, logits: torch.Tensor) -> int:
        """The target's next token from its own logits (a depth-0 round)."""
        if self.sampling:
            return sample(warp_probs(logits, self.temperature, self.top_p), self.generator)
        return int(logits.argmax())

    def _tree_round(
        self, next_token, length, draft_logits, hidden, target_cache, draft_cache, stats
    ):
        """One tree round (see :mod:`specforge.serving.tree`)."""
        # 1. draft a tree
        start = self._clock()
        tree = build_tree(
            self.draft_model,
            draft_logits,
            hidden,
            last_position=length,
            cache=draft_cache,
            topk=self.topk,
            num_steps=self.num_steps,
            num_draft_tokens=self.num_draft_tokens,
        )
        stats.draft_seconds += self._clock() - start
        # 2. verify root + tree in one forward with the tree mask
        target_logits, aux, _ = self._verify_tree(tree, next_token, length, target_cache, stats)
        # 3. accept the longest matching path; keep its cache rows only
        if self.sampling:
            target_probs = warp_probs(target_logits, self.temperature, self.top_p)
            path, bonus = accept_tree_sampling(tree, target_probs, self.generator)
        else:
            path, bonus = accept_greedy(tree, target_logits)
        stats.depth_per_round.append(self.num_steps)
        return self._keep_path(tree, path, bonus, length, target_cache, aux)

    def _observe_other(self, round_start: float, measured: float, stats: SpecStats) -> None:
        """``auto``: the time outside drafting and verification of a round the draft is awake
        for (its extension included: every such round but the first has one), into the
        running average; ``measured`` is the drafting and verification time before it."""
        inside = stats.draft_seconds + stats.verify_seconds - measured
        self.costs.observe_other(self._clock() - round_start - inside)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], SpecStats]:
        """Generate up to ``max_new_tokens`` after ``input_ids`` (1, T), stopping after an EOS.
        ``generator`` seeds sampling (``temperature > 0``; reproducibility: the class docstring).

        Returns:
            The new token ids (EOS included when generated) and the round statistics.
        """
        input_ids = input_ids.to(self.device)
        if self.auto and self.costs is None:
            self.calibrate(input_ids)  # once per decoder, before anything is timed
        start_time = self._clock()
        stats = SpecStats(num_steps=self.num_steps)
        eos = set(eos_token_ids)
        prompt_length = input_ids.shape[1]
        # prefill: the target over the prompt, then the draft over its features
        # both caches append in place (spare columns) and crop by moving their end
        target_cache = self._target_cache(prompt_length + max_new_tokens)
        draft_cache = self._draft_cache(prompt_length + max_new_tokens)
        self.generator = generator
        logits, aux = self._target_forward(input_ids, target_cache, logits_to_keep=1)
        next_token = self._plain_token(logits[-1])
        stats.target_prefill_seconds = self._clock() - start_time
        output = [next_token]
        tokens = torch.cat([input_ids[:, 1:], torch.tensor([[next_token]], device=self.device)], 1)
        draft_logits, hidden = self._draft_extend(tokens, aux, 0, draft_cache)
        length = prompt_length  # tokens whose target features are known (and cached)
        stats.prefill_seconds = self._clock() - start_time
        round_ = self._chain_round if self.topk == 1 else self._tree_round
        dormancy = Dormancy() if self.auto else None
        # the tokens emitted since the draft's last extension and their aux rows: the draft
        # extends over them lazily, when a round needs it (not after a turn's last round, nor
        # while it sleeps), from position draft_length
        pending, draft_length = None, length
        while len(output) < max_new_tokens and next_token not in eos:
            round_start, measured = self._clock(), stats.draft_seconds + stats.verify_seconds
            asleep = dormancy is not None and dormancy.sleeping()
            if self.lookup is not None:
                self.lookup.propose(input_ids[0], output, awake=not asleep)
            if pending is not None and not asleep:
                # the draft drops its draft-time entries and extends over the accepted paths
                path, aux = pending
                crop_cache(draft_cache, draft_length)
                draft_logits, hidden = self._draft_extend(path, aux, draft_length, draft_cache)
                pending, draft_length = None, draft_length + path.shape[1]
                stats.extend_seconds += self._clock() - round_start
            if asleep:
                new_tokens, accepted, aux = self._plain_round(next_token, target_cache, stats)
            else:
                new_tokens, accepted, aux = round_(
                    next_token, length, draft_logits, hidden, target_cache, draft_cache, stats
                )
                if dormancy is not None:  # one unsure token's plain round is no reason to sleep
                    dormancy.woke(stats.depth_per_round[-1] or self._estimated_depth())
            length += len(new_tokens)
            if self.lookup is not None:
                self.lookup.learn(new_tokens)
            stats.verifications += 1
            stats.accepted_per_round.append(accepted)
            for token in new_tokens:
                output.append(token)
                if token in eos or len(output) >= max_new_tokens:
                    break
            next_token = output[-1]
            pending = _joined(pending, (torch.tensor([new_tokens], device=self.device), aux))
            if self.auto and stats.verifications > 1 and not asleep:
                self._observe_other(round_start, measured, stats)
        stats.emitted = len(output) - 1  # the first token comes from the prefill
        stats.seconds = self._clock() - start_time
        return output[:max_new_tokens], stats
