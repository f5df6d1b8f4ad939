"""The draft's serving forwards through the engine: its single layer's keys and values in a
preallocated :class:`~specforge.engine.cache.SlotKVCache` written by slot, an explicit mask over
a bucketed key span, and, on a GPU, each forward replayed as a CUDA graph
(:class:`~specforge.engine.graphs.CudaGraphs`): a chain's draft steps then cost one replay each
instead of the few dozen kernel launches of an eager step.

Two forwards, each with its own graphs: an **extension** over the target's fused aux states of
the tokens a round accepted (at most ``MAX_GRAPH_TOKENS`` of them in a graph; a longer one, as
after the prompt or a dormant stretch, runs eagerly), and a **step** over the draft's own state
of one drafted token. Draft positions are the cache's slots, as in a chain (a tree's draft
keeps its own cache, :class:`~specforge.models.eagle3.DraftKVCache`).
"""

from __future__ import annotations

import logging

import torch

from specforge.engine.cache import SPAN_STEP, SlotKVCache, SlotKVPool, whole_spans
from specforge.engine.graphs import graph_runner
from specforge.engine.host_sync import HostSync, host_sync
from specforge.models.eagle3 import AUX_STATES, Eagle3DraftModel

MAX_GRAPH_TOKENS = 16
"""Extensions over more tokens than this run eagerly (each count is a graph of its own)."""


logger = logging.getLogger(__name__)


class DraftEngine:
    """The draft's extension and step forwards over a slot cache, eager or as CUDA graphs.

    Args:
        draft: the draft model (eval mode, on its device).
        graphs: replay each forward shape as a CUDA graph (a CUDA device only).
    """

    def __init__(self, draft: Eagle3DraftModel, *, graphs: bool):
        self.draft = draft
        self.device = draft.lm_head.weight.device
        runner = graph_runner(self.device)
        if graphs and runner is None:
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}")
        self._pool = SlotKVPool()
        self._extend, self._step = self._extend_eager, self._step_eager
        if graphs:
            self._extend = runner(self._extend_eager, self._pool)
            self._step = runner(self._step_eager, self._pool)

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far (none eagerly)."""
        return sum(getattr(run, "captures", 0) for run in (self._extend, self._step))

    def new_cache(self, capacity: int) -> SlotKVCache:
        """An empty cache for one sequence's draft entries, at most ``capacity`` of them; its
        first forward takes the engine's buffers (older caches then refuse to run)."""
        return SlotKVCache(1, whole_spans(capacity), self._pool)

    def _extend_eager(self, tokens, aux, positions, slots, mask, *, cache):
        hidden = self.draft.fuse(aux)
        return self._step_eager(tokens, hidden, positions, slots, mask, cache=cache)

    def _step_eager(self, tokens, hidden, positions, slots, mask, *, cache):
        cache.write_at(slots, mask.shape[-1])
        return self.draft(
            tokens, hidden, positions, cache=cache, attention_mask=mask, logits_to_keep=1
        )

    def _blank(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` token ids and target aux states (zeros) in the draft's dtype: inputs of
        forwards run for their shapes (the host-sync probe, graphs captured in advance)."""
        aux = torch.zeros(1, count, AUX_STATES * self.draft.config.target_hidden_size)
        tokens = torch.zeros(1, count, dtype=torch.long, device=self.device)
        return tokens, aux.to(self.device, self.draft.norm.weight.dtype)

    def _inputs(self, tokens: torch.Tensor, states: torch.Tensor, cache: SlotKVCache) -> tuple:
        """The eager forwards' arguments for ``tokens`` at the next slots of ``cache``: copies
        of the tokens and states, positions, slots, and the mask over the key span (new token
        ``i`` sees every slot up to its own: the cached prefix and the new ones before it)."""
        slots, span = cache.next_slots(tokens.shape[1], self.device)
        mask = torch.arange(span, device=self.device)[None] <= slots[:, None]
        return tokens.clone(), states.clone(), slots[None], slots, mask[None, None]

    @torch.no_grad()
    def host_sync(self) -> HostSync | None:
        """The first host sync of the draft's extension and step forwards (eagerly, on a
        scratch cache: a prefix of 3 tokens, then a step), or ``None``: what would stop a
        captured forward (:mod:`specforge.engine.host_sync`), as dynamic RoPE does."""
        cache = SlotKVCache(1, whole_spans(4), SlotKVPool())
        tokens, states = self._blank(3)
        for extend, count in ((True, 3), (False, 1)):
            inputs = self._inputs(tokens[:, :count], states, cache)
            run = self._extend_eager if extend else self._step_eager
            sync = host_sync(self.draft, run, *inputs, cache=cache)
            if sync is not None:
                return sync
            _, hidden = run(*inputs, cache=cache)
            states, cache.length = hidden[:, -1:], cache.length + count
        return None

    @torch.no_grad()
    def prepare(self, capacity: int) -> int:
        """Before anything is timed: the buffers for a draft cache of ``capacity`` entries and,
        replaying graphs, every graph a chain needs up to that capacity (extensions over 1 ..
        ``MAX_GRAPH_TOKENS`` tokens and the step, at each key span). Returns the graphs
        captured."""
        cache = self.new_cache(capacity)
        tokens, aux = self._blank(MAX_GRAPH_TOKENS)
        _, hidden = self.forward(tokens[:, :1], aux[:, :1], cache, extend=True)  # eager
        before = self.captures
        if self._step is not self._step_eager:  # graphs
            for span in range(SPAN_STEP, cache.capacity + 1, SPAN_STEP):
                for count in range(1, MAX_GRAPH_TOKENS + 1):
                    cache.length = span - count  # the forward ends at the span's last slot
                    self.forward(tokens[:, :count], aux[:, :count], cache, extend=True)
                cache.length = span - 1
                self.forward(tokens[:, :1], hidden, cache, extend=False)
        return self.captures - before

    @torch.no_grad()
    def forward(
        self, tokens: torch.Tensor, states: torch.Tensor, cache: SlotKVCache, *, extend: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over ``tokens`` (1, T) at the next ``T`` slots and positions of ``cache``:
        with ``extend``, ``states`` are the target's aux states (1, T, 3 * Ht); else the draft's
        own state (1, T, H) of the step before. Returns the last position's logits
        (draft vocabulary, float32) and the state for the next step (1, 1, H), both new tensors.

        Raises:
            ValueError: more tokens than the cache has room for.
        """
        count = tokens.shape[1]
        inputs = self._inputs(tokens, states, cache)
        if not cache.allocated or (extend and count > MAX_GRAPH_TOKENS):
            run = self._extend_eager if extend else self._step_eager
        else:
            run = self._extend if extend else self._step
        logits, hidden = run(*inputs, cache=cache)
        cache.length += count
        # copies: a replayed graph's outputs are overwritten by its next replay
        return logits[0, -1].float().clone(), hidden[:, -1:].clone()


def chain_draft_engine(draft_model, topk: int, engine, draft_engine) -> DraftEngine | None:
    """What runs a chain's draft forwards: ``draft_engine``, else one replaying CUDA graphs
    where the target's engine does and the draft's forwards read no tensor on the host
    (:meth:`DraftEngine.host_sync`; else eagerly, said once); none for a tree (its draft keeps
    its own cache)."""
    if topk > 1:
        return None
    if draft_engine is None and engine is not None and engine.graphs:
        graphs = DraftEngine(draft_model, graphs=True)
        sync = graphs.host_sync()
        if sync is None:
            return graphs
        logger.warning("the draft's forwards run eagerly, not as CUDA graphs: %s", sync)
    return draft_engine
