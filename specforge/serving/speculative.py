"""The built-in speculative runtime (batch size 1): a proposer drafts tokens (an EAGLE-3 chain
or tree, :mod:`specforge.serving.proposers`), the target verifies them in one forward pass, and
the longest accepted prefix plus one token of the target's is emitted. Greedy verification is
lossless: the output equals the target's own greedy decoding token for token (an fp32 property;
see the tests); sampling verification (:mod:`specforge.serving.sampling`) keeps the target's
distribution exactly. A policy (:mod:`specforge.serving.policy`) plans each round (a fixed depth,
or ``auto``) and observes its outcome.

A round, in small verbs:

1. ``plan`` and ``propose``: the policy says how deep; the proposer drafts from its state after
   the last accepted token (extending over the accepted tokens first);
2. ``verify``: one target forward over ``[last token, d_1 .. d_K]`` (or a tree) with the
   target's KV cache, capturing the target features the draft needs next;
3. ``accept``: keep ``d_1 .. d_a`` while they equal the target's argmax (or pass rejection
   sampling), then the target's own token (the bonus); crop the target's cache to the accepted
   path and hand it to the proposer; the policy observes the round.

Accept length ``tau`` (:class:`~specforge.serving.stats.SpecStats`) = emitted tokens /
verifications, the bonus token counted.
"""

from __future__ import annotations

import time

import torch

from specforge.engine.cache import crop_cache
from specforge.engine.draft import DraftEngine
from specforge.engine.target import TargetEngine
from specforge.errors import UserError
from specforge.serving.adaptive import CostModel, calibrate
from specforge.serving.drafting import Drafting
from specforge.serving.policy import Context, LookupOnly, Outcome, Plan, new_policy
from specforge.serving.proposers.base import Proposer
from specforge.serving.proposers.eagle import EagleProposer
from specforge.serving.sampling import accept_sampling, sample
from specforge.serving.stats import SpecStats
from specforge.serving.tree import DraftTree, accept_greedy
from specforge.serving.verifier import TargetVerifier


class SpeculativeDecoder:
    """Chain (``topk=1``) or tree drafting with greedy or sampling verification, one sequence
    at a time.

    Sampling at a fixed depth is reproducible from the generator's seed, token for token. Under
    ``num_steps="auto"`` each round's depth follows measured wall-clock costs and decides how
    many random numbers the round draws, so a sampled ``auto`` run is reproducible in
    distribution (lossless) but not token for token; greedy outputs are always the target's.
    What ``auto`` learns of acceptance starts again with every request (``generate`` call):
    only the device's costs carry from one to the next, so at fixed costs a request's rounds
    are the same whatever was asked before it.

    Args:
        target_model: the HF target (eval mode).
        draft_model: the draft, any dtype (only proposals depend on it).
        aux_layer_ids: the target layers the draft was trained on.
        proposer: the draft family's proposer factory
            (:attr:`specforge.families.base.DraftFamily.proposer`: refuses the settings
            the family cannot run); default: an EAGLE-3 draft's
            (:class:`~specforge.serving.proposers.eagle.EagleProposer`).
        settings: :class:`~specforge.serving.drafting.Drafting`'s (``num_steps``, ``topk``,
            ``temperature``, ``max_siblings``, ...).
        engine: a :class:`~specforge.engine.target.TargetEngine` over ``target_model`` that
            runs its forwards, or ``None``: transformers' forward with a growing cache.
        draft_engine: what runs a chain's draft forwards, handed to the proposer (EAGLE-3's
            default: CUDA graphs where ``engine`` replays them).

    Raises:
        UserError: inconsistent drafting settings, or a target the runtime cannot serve
            (recurrent layers; a tree on flash attention), before any generation.
    """

    def __init__(
        self,
        target_model,
        draft_model,
        *,
        aux_layer_ids: list[int],
        proposer=None,
        engine: TargetEngine | None = None,
        draft_engine: DraftEngine | None = None,
        **settings,
    ):
        self.drafting = drafting = Drafting(**settings)
        self.verifier = TargetVerifier(target_model, aux_layer_ids=aux_layer_ids, engine=engine)
        if drafting.topk > 1 and self.verifier.tree_refusal:
            raise UserError(self.verifier.tree_refusal)
        self.target, self.engine, self.aux_layer_ids = target_model, engine, list(aux_layer_ids)
        self.num_steps = drafting.depth
        self.generator: torch.Generator | None = None
        self.device = next(target_model.parameters()).device
        engines = {"engine": engine, "draft_engine": draft_engine}
        self.proposer = (proposer or EagleProposer)(draft_model, drafting, **engines)
        trees = self.verifier.tree_refusal is None
        self.policy = new_policy(drafting, trees=trees, device=self.device)

    @classmethod
    def prompt_lookup(cls, engine: TargetEngine, num_tokens: int) -> SpeculativeDecoder:
        """Prompt-lookup decoding (greedy) through ``engine``: this runtime's rounds with no
        draft, each verifying the n-gram proposal of up to ``num_tokens`` tokens
        (:class:`~specforge.serving.policy.LookupOnly`), so the baseline a draft has to beat
        runs the same loop, verification and acceptor as the draft."""
        decoder = cls(
            engine.model,
            None,
            aux_layer_ids=engine.aux_layer_ids,
            proposer=lambda draft_model, drafting, **_: Proposer(draft_model, drafting),
            num_steps=num_tokens,
            engine=engine,
        )
        decoder.policy = LookupOnly(num_tokens, decoder.device)
        return decoder

    # -- what the policy and the proposer hold -----------------------------------------------

    @property
    def draft_model(self):
        return self.proposer.draft_model

    @property
    def draft_engine(self) -> DraftEngine | None:
        """What runs a chain's draft forwards (CUDA graphs), or ``None``."""
        return self.proposer.draft_engine

    @torch.no_grad()
    def calibrate(self, input_ids: torch.Tensor, *, context: int = 256) -> CostModel:
        """Measure the policy's ``costs`` after a ``context``-token prefix (``input_ids`` (1, T)
        repeated): the target's forward over 1 .. ``num_steps + 1`` new tokens, one draft
        step."""
        ids = input_ids.to(self.device).repeat(1, -(-context // input_ids.shape[1]))[:, :context]
        target_cache = self._new_target_cache(context)
        _, aux = self.verifier.forward(ids, target_cache, logits_to_keep=1)
        token = ids[:, -1:]

        def verify(n: int) -> None:
            self.verifier.forward(token.repeat(1, n), target_cache)
            crop_cache(target_cache, context)

        draft_step = self.proposer.timed_step(ids, aux)  # what a round's draft step runs
        costs = calibrate(verify, draft_step, max_depth=self._widest_chain, clock=self._clock)
        self.policy.use_costs(costs)
        return costs

    @torch.no_grad()
    def prepare(self, tokens: int, widest: int = 0) -> int:
        """Before anything is timed, for sequences of up to ``tokens`` tokens: the engines'
        buffers taken once and every graph their forwards need built (``prepare`` of each), so
        no turn captures or compiles; ``widest``: the most tokens another user of the target's
        engine verifies at once (prompt lookup alone). Returns the graphs built."""
        if self.engine is None:
            return 0
        widest = max(widest, self._widest)  # one take of the buffers: none dropped later
        built = self.engine.prepare(tokens + widest, range(1, widest + 1))
        if self.draft_engine is not None:
            built += self.draft_engine.prepare(tokens + self.num_steps + 1)
        return built

    def _new_target_cache(self, tokens: int):
        """An empty target cache with room for ``tokens`` plus the widest verification."""
        return self.verifier.new_cache(tokens, self._widest)

    @property
    def _widest(self) -> int:
        """The most tokens a round's verification forward runs."""
        siblings, _ = self.policy.widths()
        return 1 + max(self._widest_chain, self.drafting.num_draft_tokens or 0) + siblings

    @property
    def _widest_chain(self) -> int:
        """The most tokens a round verifies after its last token, siblings aside: the draft's
        depth, or prompt lookup's longer proposals (``lookup_tokens``)."""
        return max(self.num_steps, self.policy.widths()[1])

    def _clock(self) -> float:
        """Wall time, after the device's queued work (so phases are timed on CUDA too)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # -- a round: plan and propose, verify, accept ------------------------------------------

    def _propose(self, context: Context, stats: SpecStats) -> Plan:
        """1. The policy's plan for this round with its proposal (:attr:`Plan.tree`): the
        policy's own (greedy ``auto``'s chain or fan, prompt lookup's tokens), else the
        proposer's chain of the planned depth or its tree (``topk > 1``), none past the
        context's room (none at all while the draft sleeps); timed as drafting."""
        start = self._clock()
        plan = self.policy.plan(self.proposer, context)
        if plan.tree is None and not plan.depth:
            plan.tree = DraftTree.chain(torch.empty(0, dtype=torch.long, device=self.device))
        elif plan.tree is None and self.drafting.topk > 1:
            plan.tree = self.proposer.tree().within(plan.depth)
        elif plan.tree is None:
            plan.tree = DraftTree.chain(*self.proposer.chain(plan.depth))
        if not plan.dormant:
            stats.draft_seconds += self._clock() - start
        return plan

    def _verified(self, plan: Plan, next_token: int, length: int, target_cache, stats):
        """2. and 3. The target verifies the plan's proposal after ``next_token``, the one
        acceptor keeps its longest accepted path (greedy, or by rejection sampling) and the
        target's next token, the cache keeps their rows. Returns the round's
        :class:`~specforge.serving.policy.Outcome` and the aux rows of its emitted tokens."""
        tree, start = plan.tree, self._clock()
        target_logits, aux = self.verifier.verify(tree, next_token, length, target_cache)
        seconds = self._clock() - start
        stats.verify_seconds += seconds
        if self.drafting.sampling:
            path, bonus = accept_sampling(tree, self.drafting.warp(target_logits), self.generator)
        else:
            path, bonus = accept_greedy(tree, target_logits)
        outcome = Outcome(plan.depth, path, bonus, target_logits, seconds)
        outcome.tokens, aux = self.verifier.keep_path(tree, path, bonus, length, target_cache, aux)
        return outcome, aux

    def _plain_token(self, logits: torch.Tensor) -> int:
        """The target's next token from its own logits (the prefill's)."""
        if self.drafting.sampling:
            return sample(self.drafting.warp(logits), self.generator)
        return int(logits.argmax())

    # -- a sequence ----------------------------------------------------------------------------

    def _prefill(self, input_ids: torch.Tensor, capacity: int, stats: SpecStats, start: float):
        """The target over the prompt (its first token), then the draft over its features;
        returns the target's cache and the first token."""
        target_cache = self._new_target_cache(capacity)
        logits, aux = self.verifier.forward(input_ids, target_cache, logits_to_keep=1)
        first = self._plain_token(logits[-1])
        stats.target_prefill_seconds = self._clock() - start
        tokens = torch.cat([input_ids[:, 1:], torch.tensor([[first]], device=self.device)], 1)
        self.proposer.start(tokens, aux, capacity)
        stats.prefill_seconds = self._clock() - start
        return target_cache, first

    def _round(self, next_token: int, length: int, target_cache, stats: SpecStats, context):
        """One round: the draft catches up over the tokens accepted since it last drafted and
        proposes, or sleeps (``auto``'s dormancy) while the target decodes alone; the policy
        observes the outcome. Returns the emitted tokens."""
        round_start, measured = self._clock(), stats.draft_seconds + stats.verify_seconds
        context.awake = not self.policy.sleeping()
        if context.awake and self.proposer.catch_up():
            stats.extend_seconds += self._clock() - round_start
        plan = self._propose(context, stats)
        outcome, aux = self._verified(plan, next_token, length, target_cache, stats)
        if stats.verifications and context.awake:  # the time outside drafting and verifying
            inside = stats.draft_seconds + stats.verify_seconds - measured
            outcome.other_seconds = self._clock() - round_start - inside
        self.policy.observe(plan, outcome, self.proposer, stats)
        stats.dormant_rounds += plan.dormant
        stats.depth_per_round.append(plan.depth)
        stats.accepted_per_round.append(outcome.accepted)
        stats.verifications += 1
        self.proposer.accepted(outcome.tokens, aux)
        return outcome.tokens

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        *,
        max_new_tokens: int,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], SpecStats]:
        """Generate up to ``max_new_tokens`` after ``input_ids`` (1, T), stopping after an EOS;
        ``generator`` seeds sampling (reproducibility: the class docstring). Returns the new
        token ids (EOS included when generated) and the round statistics."""
        input_ids = input_ids.to(self.device)
        if self.policy.needs_costs():
            self.calibrate(input_ids)  # once per decoder, before anything is timed
        self.policy.begin_request()  # what it learnt of acceptance was the last request's
        start_time = self._clock()
        stats = SpecStats(num_steps=self.num_steps)
        eos = set(eos_token_ids)
        self.generator = self.proposer.generator = generator
        capacity = input_ids.shape[1] + max_new_tokens
        target_cache, next_token = self._prefill(input_ids, capacity, stats, start_time)
        output = [next_token]
        length = input_ids.shape[1]  # tokens whose target features are known (and cached)
        while len(output) < max_new_tokens and next_token not in eos:
            room = max_new_tokens - len(output) - 1  # a round emits its bonus token too
            context = Context(input_ids[0], output, room)
            new_tokens = self._round(next_token, length, target_cache, stats, context)
            length += len(new_tokens)
            for token in new_tokens:
                output.append(token)
                if token in eos or len(output) >= max_new_tokens:
                    break
            next_token = output[-1]
        stats.emitted = len(output) - 1  # the first token comes from the prefill
        stats.seconds = self._clock() - start_time
        return output[:max_new_tokens], stats
