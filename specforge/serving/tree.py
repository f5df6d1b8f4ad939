"""EAGLE-2-style dynamic draft trees: grow ``topk`` branches per step for ``num_steps`` depths,
keep the ``num_draft_tokens - 1`` nodes with the highest cumulative draft log-probability, and
verify them in one target forward with a tree attention mask.

The target's tree mask is not handed to the model as one 4D tensor (transformers would apply it
to every layer as given, so sliding-window and chunked layers would see past their window):
:func:`tree_attention` lets the model build each layer type's mask itself from its own mask
function, evaluated at the nodes' positions and restricted to each node's ancestors.

Node ``i`` (depth ``d >= 1``) is a target token proposed after the path root -> ... -> parent.
In the draft it is expanded at position ``last - 1 + d`` (``last`` = the last accepted target
position, which holds the root token) attending to the prefix and to its ancestors; in the
target it is verified at position ``last + d`` attending to the prefix, the root and its
ancestors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from specforge.errors import UserError
from specforge.models.adapter import architecture, tree_refusal
from specforge.models.eagle3 import DraftKVCache, Eagle3DraftModel


@dataclass
class DraftTree:
    """What a round verifies after its last token: the proposed nodes, parents before
    children. A chain is a tree of width one (:meth:`chain`), no proposal an empty one."""

    tokens: torch.Tensor
    """(M,) target ids."""
    parents: torch.Tensor
    """(M,) index of the parent node in this tree, ``-1`` for the root."""
    depths: torch.Tensor
    """(M,) depth, 1..num_steps."""
    dists: torch.Tensor | None = None
    """Sampling: (M, V) the draft distribution each node was drawn from (a sampled chain's);
    ``None``: each node is a point mass (a greedy chain, a top-k tree's children)."""

    @classmethod
    def chain(cls, tokens: torch.Tensor, dists: torch.Tensor | None = None) -> DraftTree:
        """The chain ``tokens`` (K,) (drawn from ``dists`` (K, V) when sampled): node ``k``'s
        parent is node ``k - 1``."""
        size = len(tokens)
        return cls(
            tokens=tokens,
            parents=torch.arange(-1, size - 1),
            depths=torch.arange(1, size + 1),
            dists=dists,
        )

    @property
    def is_chain(self) -> bool:
        """Every node the child of the one before (the empty tree too): verified as one
        sequence, no tree mask."""
        return self.parents.tolist() == list(range(-1, len(self.parents) - 1))

    def ancestors_mask(self) -> torch.Tensor:
        """(M, M) bool: node ``i`` may attend to node ``j`` (``j`` is ``i`` or an ancestor)."""
        size = len(self.tokens)
        mask = torch.eye(size, dtype=torch.bool)
        for i, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                mask[i] |= mask[parent]
        return mask

    def renumbered(self, depth: int) -> list[int | None]:
        """Each node's index in :meth:`within` ``depth``, ``None`` where it is dropped."""
        kept, index = 0, []
        for node_depth in self.depths.tolist():
            index.append(kept if node_depth <= depth else None)
            kept += node_depth <= depth
        return index

    def within(self, depth: int) -> DraftTree:
        """The tree without its nodes deeper than ``depth`` (every node's ancestors are
        shallower, so what is left is a tree, parents still before children)."""
        index = self.renumbered(depth)
        kept = [node for node, new in enumerate(index) if new is not None]
        if len(kept) == len(index):
            return self
        parents = [-1 if p < 0 else index[p] for p in self.parents[kept].tolist()]
        rows = torch.tensor(kept, dtype=torch.long, device=self.tokens.device)
        return DraftTree(
            tokens=self.tokens[rows],
            parents=torch.tensor(parents, dtype=torch.long),
            depths=self.depths[kept],
            dists=None if self.dists is None else self.dists[rows],
        )

    def children(self, node: int) -> list[int]:
        """Indices of the children of ``node`` (``-1`` = root)."""
        return [i for i, parent in enumerate(self.parents.tolist()) if parent == node]


@torch.no_grad()
def build_tree(
    draft: Eagle3DraftModel,
    root_logits: torch.Tensor,
    root_hidden: torch.Tensor,
    *,
    last_position: int,
    cache: DraftKVCache,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
) -> DraftTree:
    """Grow and prune a draft tree (the cache is extended; crop it to the prefix afterwards).

    Args:
        draft: the draft model.
        root_logits: (Vd,) draft logits at the last accepted feature (they propose depth 1).
        root_hidden: (1, 1, H) the draft's hidden state there.
        last_position: the target position of the root token (the prefix has ``last_position``
            draft entries, positions ``0 .. last_position - 1``).
        topk: branches per expanded node, and nodes expanded per depth.
        num_steps: tree depth.
        num_draft_tokens: tree size including the root (nodes kept = ``num_draft_tokens - 1``).
    """
    device = root_logits.device
    prefix = cache.length
    # node tables (grown as the tree grows)
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    entry: dict[int, int] = {}  # node -> its draft cache index once expanded

    def add_children(parent: int, logits: torch.Tensor, base_score: float, depth: int) -> list[int]:
        log_probs = logits.float().log_softmax(-1)
        values, draft_ids = log_probs.topk(topk)
        target_ids = draft.to_target_ids(draft_ids)
        new = []
        for value, token in zip(values.tolist(), target_ids.tolist(), strict=True):
            new.append(len(tokens))
            tokens.append(token)
            parents.append(parent)
            depths.append(depth)
            scores.append(base_score + value)
        return new

    frontier = add_children(-1, root_logits, 0.0, 1)
    frontier_hidden = root_hidden.expand(1, len(frontier), -1)
    for depth in range(2, num_steps + 1):
        # 1. expand the frontier (depth - 1) in one draft forward with a tree mask
        width = len(frontier)
        mask = frontier_mask(frontier, parents, entry, prefix, cache.length, device)
        for row, node in enumerate(frontier):
            entry[node] = cache.length + row
        ids = torch.tensor([[tokens[n] for n in frontier]], device=device)
        positions = torch.full((1, width), last_position - 2 + depth, device=device)
        logits, hidden = draft(
            ids, frontier_hidden, positions, cache=cache, attention_mask=mask[None, None]
        )
        # 2. each expanded node proposes topk children; the best topk become the new frontier
        candidates = []
        for row, node in enumerate(frontier):
            for child in add_children(node, logits[0, row], scores[node], depth):
                candidates.append((scores[child], -child, child, row))
        candidates.sort(reverse=True)
        chosen = candidates[:topk]
        frontier = [child for _, _, child, _ in chosen]
        frontier_hidden = hidden[:, [row for _, _, _, row in chosen]]
    # 3. keep the best num_draft_tokens - 1 nodes (ancestor-closed), parents first
    return prune(tokens, parents, depths, scores, num_draft_tokens - 1, device)


def merged_tree(chains: list[list[int]], device) -> tuple[DraftTree, list[list[int]]]:
    """Chains of target ids after the root (a draft's chain, its first position's further
    candidates, a prompt-lookup proposal) as one tree, a prefix several chains share being one
    path: the tree (nodes in the order the chains reach them, so the first chain's come first,
    as :func:`prune` orders a tree) and each chain's node indices."""
    tokens, parents, depths, nodes = [], [], [], {}
    paths = []
    for chain in chains:
        parent, path = -1, []
        for depth, token in enumerate(chain, start=1):
            if (parent, token) not in nodes:
                nodes[parent, token] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                depths.append(depth)
            parent = nodes[parent, token]
            path.append(parent)
        paths.append(path)
    tree = DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
    )
    return tree, paths


def frontier_mask(frontier, parents, entry, prefix: int, cache_length: int, device):
    """(W, cache_length + W) bool: frontier node ``row`` may attend to the prefix, to the cache
    entries of its ancestors and to itself."""
    width = len(frontier)
    mask = torch.zeros(width, cache_length + width, dtype=torch.bool, device=device)
    mask[:, :prefix] = True
    for row, node in enumerate(frontier):
        ancestor = parents[node]
        while ancestor >= 0:
            mask[row, entry[ancestor]] = True
            ancestor = parents[ancestor]
        mask[row, cache_length + row] = True
    return mask


def prune(tokens, parents, depths, scores, size: int, device) -> DraftTree:
    """The ``size`` best-scoring nodes, closed under ancestors, as a tree (parents first,
    depth first)."""
    order = sorted(range(len(tokens)), key=lambda n: (-scores[n], n))
    kept: list[int] = []
    for node in order:
        if len(kept) == size:
            break
        if parents[node] < 0 or parents[node] in kept:
            kept.append(node)
    # depth first, each node's children best first: the draft's greedy chain takes the first
    # indices, so when the target accepts along it the accepted cache rows are already in
    # place (``gather_cache`` moves nothing)
    children: dict[int, list[int]] = {}
    for node in kept:  # best first
        children.setdefault(parents[node], []).append(node)
    kept, stack = [], children.get(-1, [])[::-1]
    while stack:
        node = stack.pop()
        kept.append(node)
        stack += children.get(node, [])[::-1]
    index = {node: i for i, node in enumerate(kept)}
    return DraftTree(
        tokens=torch.tensor([tokens[n] for n in kept], dtype=torch.long, device=device),
        parents=torch.tensor(
            [index[parents[n]] if parents[n] >= 0 else -1 for n in kept], dtype=torch.long
        ),
        depths=torch.tensor([depths[n] for n in kept], dtype=torch.long),
    )


def verification_inputs(tree: DraftTree, root_token: int, last_position: int):
    """Token ids (1, 1 + M), positions (1, 1 + M) and the (1 + M, 1 + M) bool "may attend"
    table among the new tokens (the root, then every node seeing the root and its ancestors)
    that verify the root plus the tree in one target forward."""
    device = tree.tokens.device
    size = 1 + len(tree.tokens)
    ids = torch.cat([torch.tensor([root_token], device=device), tree.tokens])[None]
    positions = torch.cat([torch.tensor([0]), tree.depths]).to(device)[None] + last_position
    visible = torch.zeros(size, size, dtype=torch.bool, device=device)
    visible[:, 0] = True  # everything sees the root
    visible[1:, 1:] = tree.ancestors_mask().to(device)
    return ids, positions, visible


@dataclass
class _TreeMask:
    """What the mask builders of one tree verification need (see :func:`tree_attention`)."""

    prefix: int
    position_of: torch.Tensor
    """Cache index -> position: (prefix + N,)."""
    visible: torch.Tensor
    """(N, N): new token ``i`` sees new token ``j``."""
    calls: list[str]

    def at_positions(self, mask_function):
        prefix, position_of, visible = self.prefix, self.position_of, self.visible

        def inner(batch_idx, head_idx, q_idx, kv_idx):
            new_q = (q_idx - prefix).clamp(min=0)
            new_kv = (kv_idx - prefix).clamp(min=0)
            allowed = mask_function(batch_idx, head_idx, position_of[q_idx], position_of[kv_idx])
            return allowed & ((kv_idx < prefix) | visible[new_q, new_kv])

        return inner


_ACTIVE_TREE: ContextVar[_TreeMask | None] = ContextVar("specforge_tree_mask", default=None)
"""The tree verification running in this thread or task, if any (set by
:func:`tree_attention` only)."""


def _register_tree_masks(implementation: str) -> None:
    """Wrap the mask builder of ``implementation`` once, through transformers' public
    ``AttentionMaskInterface.register``: the wrapper passes every call through unchanged unless
    a :func:`tree_attention` block is active in the calling thread (a ``ContextVar``), so other
    models and threads build their masks as before."""
    from transformers import AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    base = ALL_MASK_ATTENTION_FUNCTIONS[implementation]
    if getattr(base, "specforge_tree_masks", False):
        return

    @functools.wraps(base)
    def tree_masks(*args, mask_function, **kwargs):
        tree = _ACTIVE_TREE.get()
        if tree is None:
            return base(*args, mask_function=mask_function, **kwargs)
        tree.calls.append(implementation)
        kwargs["allow_is_causal_skip"] = False
        return base(*args, mask_function=tree.at_positions(mask_function), **kwargs)

    tree_masks.specforge_tree_masks = True
    AttentionMaskInterface.register(implementation, tree_masks)


@contextmanager
def tree_attention(model, positions: torch.Tensor, visible: torch.Tensor, prefix: int):
    """While active, the target's forward over ``N`` new tokens after ``prefix`` cached ones
    builds every attention mask (full, sliding-window, chunked: each layer type its own) from
    the model's own mask function evaluated at the new tokens' ``positions`` (N,), and lets new
    token ``i`` see new token ``j`` only where ``visible[i, j]``; the cached prefix stays
    visible as the mask function says.

    The model's mask builder is wrapped once through transformers' mask interface
    (:func:`_register_tree_masks`); the tree itself lives in a ``ContextVar`` for the duration
    of the block, so concurrent forwards in other threads are untouched. A forward that never
    asked for a mask (a model that builds masks some other way) raises rather than verify with
    a plain causal mask.

    Raises:
        UserError: an attention implementation whose masks ignore mask functions (flash), or a
            model that built no mask through transformers' mask interface.
    """
    refusal = tree_refusal(model)
    if refusal:
        raise UserError(refusal)
    _register_tree_masks(model.config._attn_implementation)
    device = positions.device
    # cache index -> position: the prefix sits at its own indices, the new tokens at theirs
    # (prefix,) + (N,) -> (prefix + N,)
    position_of = torch.cat([torch.arange(prefix, device=device), positions.to(device)])
    tree = _TreeMask(prefix, position_of, visible, calls=[])
    token = _ACTIVE_TREE.set(tree)
    try:
        yield
    finally:
        _ACTIVE_TREE.reset(token)
    if not tree.calls:
        raise UserError(
            f"{architecture(model.config)} built no attention mask through transformers' mask "
            "interface, so a tree cannot be verified on it; draft a chain (topk 1)"
        )


def row_argmax(logits: torch.Tensor) -> Callable[[int], int]:
    """``row -> argmax of logits[row]`` for (N, V) ``logits``. On a CPU each row's argmax is
    taken when first asked for: greedy acceptance reads only the rows along the accepted path,
    and an argmax costs ~22 us per 49152 float32 logits on a 2-core CPU (a 17-token tree's
    rows 0.37 ms). Elsewhere all rows at once (one host sync)."""
    if logits.device.type != "cpu":
        return logits.argmax(-1).tolist().__getitem__
    return functools.cache(lambda row: int(logits[row].argmax()))


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance, of a chain or a tree: walk down while a child equals the target's
    argmax (the one greedy acceptor: the runtime's rounds and the prompt-lookup baseline).

    Args:
        target_logits: (1 + M, V) the target's logits at the root and at every node.

    Returns:
        The accepted nodes (tree indices, root to leaf) and the bonus token.
    """
    tokens, predicted = tree.tokens.tolist(), row_argmax(target_logits)
    path: list[int] = []
    current = -1
    while True:
        want = predicted(current + 1)  # row 0 is the root, row i + 1 is node i
        match = next((c for c in tree.children(current) if tokens[c] == want), None)
        if match is None:
            return path, want
        path.append(match)
        current = match
