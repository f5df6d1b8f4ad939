"""The EAGLE-3 proposer: a chain (or a tree, :mod:`specforge.serving.tree`) drafted step by step
from the draft's state after the last accepted token, each step feeding back the draft's own
hidden state (the serving path of the TTT unroll, :meth:`Eagle3DraftModel.forward` with a KV
cache).

A sequence's draft state (:class:`DraftState`) is its cache, the logits and hidden state at its
last extended position, and the accepted tokens it has not extended over yet: the runtime hands
each round's accepted tokens and their target features to :meth:`EagleProposer.accepted`, and
the draft extends over them lazily (:meth:`EagleProposer.catch_up`), when a round drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specforge.engine.cache import SlotKVCache, crop_cache
from specforge.engine.draft import chain_draft_engine
from specforge.models.eagle3 import DraftKVCache, Eagle3DraftModel
from specforge.serving.adaptive import first_acceptance
from specforge.serving.drafting import Drafting
from specforge.serving.proposers.base import Proposer
from specforge.serving.tree import build_tree


@dataclass
class DraftState:
    """One sequence's draft: what the next round drafts from."""

    cache: DraftKVCache | SlotKVCache
    logits: torch.Tensor
    """(draft_vocab_size,) float32 logits at the last extended position."""
    hidden: torch.Tensor
    """(1, 1, H) the state the next draft step receives."""
    length: int
    """Positions extended over (the next extension starts here)."""
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    """Accepted tokens (1, T) and their target features (1, T, F) not extended over yet."""


def _check_slot(cache: SlotKVCache, position: int) -> None:
    """A chain's draft positions are its cache's slots: the next one is the cache's length."""
    if position != cache.length:
        raise RuntimeError(f"draft position {position} is not the draft cache's next slot")


class EagleProposer(Proposer):
    """Drafts with an EAGLE-3 draft model (see the module docstring).

    Args:
        draft_model: the draft, in any dtype: its logits are read in float32.
        drafting: the runtime's settings (a cache holds room for their deepest chain).
        engine: the target's engine (:class:`~specforge.engine.target.TargetEngine`), or
            ``None``.
        draft_engine: runs a chain's draft forwards (:class:`~specforge.engine.draft.
            DraftEngine`); default: CUDA graphs where ``engine`` replays them
            (:func:`~specforge.engine.draft.chain_draft_engine`), else the model's own
            forward with a growing cache.
    """

    draft_model: Eagle3DraftModel
    state: DraftState | None

    def __init__(
        self, draft_model: Eagle3DraftModel, drafting: Drafting, *, engine=None, draft_engine=None
    ):
        super().__init__(draft_model, drafting)
        self.draft_engine = chain_draft_engine(draft_model, drafting.topk, engine, draft_engine)

    # -- forwards ------------------------------------------------------------------------------

    def new_cache(self, tokens: int):
        """An empty draft cache with room for ``tokens`` plus the deepest chain."""
        if self.draft_engine is None:
            return DraftKVCache()
        return self.draft_engine.new_cache(tokens + self.drafting.depth + 1)

    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, aux: torch.Tensor, start: int, cache):
        """Run the draft over new positions ``start .. start + T - 1`` (token ``t + 1`` and the
        target feature at ``t`` each); returns the last position's logits and hidden state."""
        if isinstance(cache, SlotKVCache):  # through the draft engine: positions are slots
            _check_slot(cache, start)
            return self.draft_engine.forward(tokens, aux, cache, extend=True)
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        logits, hidden = self.draft_model(
            tokens, self.draft_model.fuse(aux), positions, cache=cache, logits_to_keep=1
        )
        return logits[0, -1].float(), hidden[:, -1:]  # float32 whatever the draft's dtype

    @torch.no_grad()
    def step(self, token: torch.Tensor, hidden: torch.Tensor, position: int, cache):
        """One draft forward over ``token`` (1,) at ``position`` after ``hidden`` (1, 1, H):
        the next logits (float32 whatever the draft's dtype) and hidden state."""
        if isinstance(cache, SlotKVCache):
            _check_slot(cache, position)
            return self.draft_engine.forward(token[None], hidden, cache, extend=False)
        step_position = torch.tensor([[position]], device=token.device)
        step_logits, hidden = self.draft_model(token[None], hidden, step_position, cache=cache)
        return step_logits[0, -1].float(), hidden

    def timed_step(self, ids: torch.Tensor, aux: torch.Tensor):
        """A draft step after a context of ``ids`` (1, T) with their target features
        (1, T, F), as a callable that runs it again each time (dropping what it cached): what
        ``auto``'s cost model times as one draft step (:func:`~specforge.serving.adaptive.
        calibrate`)."""
        context = ids.shape[1]
        cache = self.new_cache(context)
        _, hidden = self.extend(ids[:, 1:], aux[:, :-1], 0, cache)
        token = ids[0, -1:]

        def draft_step() -> None:
            self.step(token, hidden, context - 1, cache)
            crop_cache(cache, context - 1)

        return draft_step

    # -- proposals -----------------------------------------------------------------------------

    def tokens(self, logits: torch.Tensor, *, confidence: bool = False):
        """Draft tokens from ``logits`` (K, Vd), one a row, as target ids (K,): greedy, the
        most likely and, with ``confidence``, their probabilities (K,) (else ``None``);
        sampling, drawn (:meth:`draw`) with their distributions on the target vocabulary
        (K, V)."""
        if confidence and not self.drafting.sampling:
            q, draft_ids = logits.float().softmax(-1).max(-1)
            return self.draft_model.to_target_ids(draft_ids), q
        draft_ids, q = self.draw(logits)
        if q is not None:  # onto the target vocabulary
            vocab_size, hot_ids = self.draft_model.t2d.numel(), self.draft_model.hot_ids
            q = q.new_zeros(len(q), vocab_size).index_copy(1, hot_ids, q)
        return self.draft_model.to_target_ids(draft_ids), q

    @torch.no_grad()
    def chain(self, steps: int):
        """Propose ``steps`` target ids as a chain from the state after the last accepted
        token (:meth:`walk`). Returns the tokens (K,) and, when sampling, their draft
        distributions (K, V)."""
        walk = self.walk()
        drawn = [next(walk), *(walk.send(True) for _ in range(steps - 1))]
        walk.close()
        tokens = torch.cat([token for token, _ in drawn])
        return tokens, (torch.cat([dist for _, dist in drawn]) if self.drafting.sampling else None)

    def walk(self, *, confidence: bool = False):
        """Drafting step by step (a chain; greedy ``auto`` token by token): a generator that
        yields the draft's next token (1,) and its probability or distribution (:meth:`tokens`),
        position by position from the state after the last accepted token; ``send(True)``
        takes a draft step with the token it yielded, closing it ends the walk."""
        state = self.state
        logits, hidden, position = state.logits, state.hidden, state.length - 1
        while True:
            token, q = self.tokens(logits[None], confidence=confidence)
            if not (yield token, q):
                return
            position += 1
            logits, hidden = self.step(token, hidden, position, state.cache)

    def first_acceptance(self, target_probs: torch.Tensor) -> float:
        """The chance that sampling verification accepts the draft's next token, drawn as
        :meth:`token` draws it, against the target's distribution ``target_probs`` (V,)
        (:func:`~specforge.serving.adaptive.first_acceptance` on the draft vocabulary)."""
        draft_probs = self.drafting.warp(self.state.logits)
        return first_acceptance(draft_probs, target_probs[self.draft_model.hot_ids])

    def candidates(self, count: int) -> list[tuple[int, float]]:
        """The draft's ``count`` most likely first tokens ``(target id, q)``, most likely
        first."""
        logits = self.state.logits
        q, draft_ids = logits.float().softmax(-1).topk(min(count, len(logits)))
        target_ids = self.draft_model.to_target_ids(draft_ids)
        return list(zip(target_ids.tolist(), q.tolist(), strict=True))

    @torch.no_grad()
    def tree(self):
        """A tree of the settings' ``num_draft_tokens`` nodes, ``topk`` branches a step,
        ``num_steps`` levels (:func:`~specforge.serving.tree.build_tree`)."""
        state, drafting = self.state, self.drafting
        return build_tree(
            self.draft_model,
            state.logits,
            state.hidden,
            last_position=state.length,
            cache=state.cache,
            topk=drafting.topk,
            num_steps=drafting.depth,
            num_draft_tokens=drafting.num_draft_tokens,
        )

    # -- a sequence's state --------------------------------------------------------------------

    def start(self, tokens: torch.Tensor, aux: torch.Tensor, capacity: int) -> None:
        """A new sequence: the draft over the prompt's features ``aux`` (1, T, F) with tokens
        (1, T) (each position's next token: the prompt's from the second on, then the
        target's first), in a cache with room for ``capacity`` positions."""
        cache = self.new_cache(capacity)
        logits, hidden = self.extend(tokens, aux, 0, cache)
        self.state = DraftState(cache, logits, hidden, tokens.shape[1])

    def accepted(self, tokens: list[int], aux: torch.Tensor) -> None:
        """A round's emitted ``tokens`` and their target features (1, T, F), to extend over
        when the draft next drafts."""
        new = (torch.tensor([tokens], device=aux.device), aux)
        pending = self.state.pending
        if pending is not None:
            new = tuple(torch.cat([old, more], 1) for old, more in zip(pending, new, strict=True))
        self.state.pending = new

    def catch_up(self) -> bool:
        """Drop the draft-time entries and extend over the accepted tokens; returns whether
        there was anything to extend over."""
        state = self.state
        if state.pending is None:
            return False
        path, aux = state.pending
        crop_cache(state.cache, state.length)
        state.logits, state.hidden = self.extend(path, aux, state.length, state.cache)
        state.length += path.shape[1]
        state.pending = None
        return True
