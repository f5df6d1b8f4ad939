"""The DFlash block family: ``draft.type: dflash``. A few non-causal layers read several target
layers as keys and values and predict a block of ``block_size - 1`` tokens after an anchor in one
forward (:mod:`.model`), trained on the target's greedy tokens at random anchors
(:mod:`.objective`), proposed a block a round (:mod:`.proposer`), exported as SGLang's and vLLM's
``DFlashDraftModel`` (:mod:`.export`). It trains online only: a capture holds EAGLE-3's aux
layers, not the block draft's target layers.
"""
