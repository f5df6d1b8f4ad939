"""The target's side of a round: its KV cache, its forward over the proposed tokens (a chain
as one sequence, a tree under its mask) returning float32 logits and the target features the
draft reads next, and the accepted path's cache rows kept. Through the engine
(:class:`~specforge.engine.target.TargetEngine`) where one runs the target, else
transformers' forward with a growing cache."""

from __future__ import annotations

import torch

from specforge.engine.cache import gather_cache
from specforge.engine.target import TargetEngine
from specforge.errors import UserError
from specforge.models.adapter import check_logits, serving_refusal, tree_refusal
from specforge.models.kv_cache import growing_cache
from specforge.models.target import target_hidden_states
from specforge.serving.tree import DraftTree, tree_attention, verification_inputs


class TargetVerifier:
    """Verifies proposals with ``target_model`` (see the module docstring).

    Args:
        aux_layer_ids: the target layers whose outputs the draft reads.
        engine: the engine over ``target_model`` that runs its forwards, or ``None``.

    Raises:
        UserError: a target the runtime cannot serve (recurrent layers), before any forward.
    """

    def __init__(self, target_model, *, aux_layer_ids: list[int], engine: TargetEngine | None):
        refusal = serving_refusal(target_model)
        if refusal:
            raise UserError(refusal)
        self.tree_refusal = None if engine is not None else tree_refusal(target_model)
        """Why the target cannot verify a tree here (``None``: it can: the engine verifies
        trees whatever the target's attention)."""
        self.target, self.engine = target_model, engine
        self.aux_layer_ids = list(aux_layer_ids)
        self.transform = check_logits(target_model)
        """What the target does to ``lm_head``'s output (verification uses its logits)."""

    def new_cache(self, tokens: int, widest: int):
        """An empty cache with room for ``tokens`` plus a verification of ``widest`` tokens."""
        if self.engine is None:
            return growing_cache()
        return self.engine.new_cache(tokens + widest)

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, cache, positions=None, logits_to_keep=0, visible=None
    ):
        """Target logits (T, V) and fused-aux inputs (1, T, n * Ht) for new tokens ``input_ids``
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

    @torch.no_grad()
    def verify(self, tree: DraftTree, next_token: int, length: int, cache):
        """The target over the round's last token ``next_token`` (at position ``length``) and
        the proposal ``tree``: a chain as one sequence, a tree with the tree mask. Returns
        logits and fused-aux inputs per row (the last token's, then each node's)."""
        device = tree.tokens.device
        if tree.is_chain:
            ids = torch.cat([torch.tensor([next_token], device=device), tree.tokens])
            return self.forward(ids[None], cache)
        ids, positions, visible = verification_inputs(tree, next_token, length)
        if self.engine is not None:
            return self.forward(ids, cache, positions, visible=visible)
        with tree_attention(self.target, positions[0], visible, prefix=length):
            return self.forward(ids, cache, positions)

    @staticmethod
    def keep_path(tree: DraftTree, path: list[int], bonus: int, length: int, cache, aux):
        """Keep the accepted ``path``'s cache rows only; returns the emitted tokens (the path's
        and the ``bonus``) and their aux rows."""
        rows = [0] + [node + 1 for node in path]
        gather_cache(cache, length, rows)  # a chain's rows are in place: a crop
        tokens = tree.tokens.tolist()
        in_place = rows == list(range(len(rows)))  # a chain's, a tree's leading path
        kept = aux[:, : len(rows)] if in_place else aux[:, rows]
        return [tokens[node] for node in path] + [bonus], kept
