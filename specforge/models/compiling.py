"""The options every ``torch.compile`` of ours passes to inductor.

On a GPU, inductor's tiling analysis of a reduction with a broadcast epilogue (an RMSNorm's
scale, for one) can stop the whole compilation with a bare ``AssertionError`` from
``tiling_utils.get_pw_red_splits`` (pytorch/pytorch#197077, open; seen on an H200 with torch
2.11 compiling the TTT step). Its workaround is to leave out that analysis and the loop
reindexing that builds such nodes: both only choose among equivalent tilings, so the results
are the same and the kernels may be slower, never wrong. CPU code generation does neither, and
its options stay the defaults.
"""

from __future__ import annotations

import torch

GPU_WORKAROUNDS = {"triton.coalesce_tiling_analysis": False, "loop_reindexing_after_fusion": False}
"""Inductor options set on a GPU (those this torch has: each appeared in some release)."""


def inductor_options(device: torch.device) -> dict[str, bool]:
    """``torch.compile``'s ``options`` for code that runs on ``device``: on CUDA, the
    workarounds above."""
    if device.type != "cuda":
        return {}
    from torch._inductor import config

    known = config.get_config_copy()
    return {key: value for key, value in GPU_WORKAROUNDS.items() if key in known}
