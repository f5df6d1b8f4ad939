"""The EAGLE-3 family (and EAGLE 3.1): ``draft.type: eagle3``. One decoder layer over three
fused target layers, chains and trees drafted step by step, trained with training-time test.

EAGLE-3 is the package's base machinery, so its pieces live where the shared layers use them:
the model in :mod:`specforge.models.eagle3` (the draft engine's CUDA graphs and the tree drafter
run it), the TTT objective in :mod:`specforge.trainer.ttt`, the proposer in
:mod:`specforge.serving.proposers.eagle` and the export contract in
:mod:`specforge.serving.export`. This record is the one place that binds them as a family;
other families extend it (their records say ``extends="eagle3"``).
"""
