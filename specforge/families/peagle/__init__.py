"""The P-EAGLE family (parallel drafting): ``draft.type: peagle``. An EAGLE-3 draft plus a
learned mask hidden state and a mask token that propose a whole chain in one forward
(:mod:`.model`), trained with EAGLE-3's training-time test on the mask inputs, served by
:mod:`.proposer` and by vLLM's EAGLE-3 proposer with ``parallel_drafting`` on.

It extends the EAGLE-3 family (:mod:`specforge.families.eagle3`): the same vocabulary map,
aux layers, capture (so it trains offline too), TTT options and export, with the export adding
``mask_hidden`` to ``model.safetensors`` and ``mask_token_id``, ``parallel_drafting`` and
``parallel_draft_tokens`` (the depth trained, ``train.ttt_length``) to ``config.json``. SGLang
has no parallel EAGLE drafting, so the bench refuses ``engine: sglang`` for it.
"""
