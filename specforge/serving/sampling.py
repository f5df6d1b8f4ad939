"""Lossless sampling verification: the emitted tokens follow the target's (temperature / top-p
warped) distribution exactly, whatever the draft proposes.

- Chains (Leviathan et al., 2023): draft token ``d_k`` was sampled from the draft's ``q_k``; it is
  accepted with probability ``min(1, p_k(d_k) / q_k(d_k))``; on the first rejection a token is
  drawn from the residual ``norm(max(p_k - q_k, 0))`` and the round ends; when every draft token
  is accepted the bonus token is drawn from ``p_{K+1}``.
- Trees: the children of a node are the draft's deterministic top-k, i.e. point-mass proposals.
  Recursive rejection sampling over point masses accepts child ``c_j`` with probability
  ``p'(c_j)`` (``p'`` = ``p`` with the rejected siblings removed and renormalized), which is the
  same as drawing ``x ~ p`` once and descending into the child equal to ``x`` (stopping with
  ``x`` as the bonus when none is).

:func:`accept_sampling` does both, a chain being a tree of width one.
"""

from __future__ import annotations

import torch

from specforge.serving.tree import DraftTree


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from a 1-D probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_sampling(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Sampling verification of a proposal, a chain or a tree (see the module docstring): at
    each node reached, a child drawn from a draft distribution (``tree.dists``: a sampled
    chain's, one child) is accepted with probability ``min(1, p / q)``, else the round ends
    with a draw from the residual; point-mass children (a greedy chain, a top-k tree) are
    descended into when they equal one draw from ``p``, which otherwise ends the round.

    Args:
        target_probs: (1 + M, V) the target's warped distributions at the root and each node.

    Returns:
        The accepted nodes (root to leaf) and the next token.
    """
    path: list[int] = []
    current = -1
    while True:
        p, children = target_probs[current + 1], tree.children(current)
        if tree.dists is not None and children:  # Leviathan et al. on the one drawn child
            (child,) = children
            token, q = int(tree.tokens[child]), tree.dists[child]
            uniform = torch.rand((), generator=generator, device=target_probs.device)
            if q[token] > 0 and uniform * q[token] <= p[token]:
                path.append(child)
                current = child
                continue
            residual = (p - q).clamp(min=0)
            if residual.sum() <= 0:  # p == q: cannot happen after a rejection, kept for safety
                residual = p
            return path, sample(residual / residual.sum(), generator)
        drawn = sample(p, generator)
        match = next((c for c in children if int(tree.tokens[c]) == drawn), None)
        if match is None:
            return path, drawn
        path.append(match)
        current = match
