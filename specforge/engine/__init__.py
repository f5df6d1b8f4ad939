"""The engine: what runs the target forward fast, between the layers that generate (serving,
self-distillation, evaluation) and :mod:`specforge.models`.

- :mod:`specforge.engine.cache`: a KV cache preallocated for rows x capacity and written by
  slot, so accepting or rejecting draft tokens moves nothing but a length;
- :mod:`specforge.engine.target`: the target's forward over a bounded set of shapes (token
  counts and key spans), eager or compiled once with ``torch.compile`` and reused, returning
  the logits and the auxiliary hidden states the draft reads.
"""
