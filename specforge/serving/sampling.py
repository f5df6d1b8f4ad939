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
  ``x`` as the bonus when none is). That is what :func:`accept_tree_sampling` does.
"""

from __future__ import annotations

import torch

from specforge.serving.tree import DraftTree


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from a 1-D probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator))


def accept_chain_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Leviathan-style verification of a sampled chain.

    Args:
        draft_tokens: (K,) target ids the draft sampled.
        draft_probs: (K, V) the draft distributions they were sampled from, on the target vocab.
        target_probs: (K + 1, V) the target's warped distributions at the root and each token.

    Returns:
        ``(accepted count, next token)``: the next token is the residual sample after a
        rejection, or the bonus sample after full acceptance.
    """
    for k, token in enumerate(draft_tokens.tolist()):
        p, q = target_probs[k, token], draft_probs[k, token]
        uniform = torch.rand((), generator=generator, device=target_probs.device)
        if q > 0 and uniform * q <= p:  # accept with probability min(1, p / q)
            continue
        residual = (target_probs[k] - draft_probs[k]).clamp(min=0)
        if residual.sum() <= 0:  # p == q: cannot happen after a rejection, kept for safety
            residual = target_probs[k]
        return k, sample(residual / residual.sum(), generator)
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], generator)


def accept_tree_sampling(
    tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Sampling verification of a top-k tree (see the module docstring).

    Args:
        target_probs: (1 + M, V) the target's warped distributions at the root and each node.

    Returns:
        The accepted nodes (root to leaf) and the next token.
    """
    path: list[int] = []
    current = -1
    while True:
        drawn = sample(target_probs[current + 1], generator)
        match = next((c for c in tree.children(current) if int(tree.tokens[c]) == drawn), None)
        if match is None:
            return path, drawn
        path.append(match)
        current = match
