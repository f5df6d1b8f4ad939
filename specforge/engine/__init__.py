"""The engine: what runs the target forward fast, between the layers that generate (serving,
self-distillation, evaluation) and :mod:`specforge.models`.

- :mod:`specforge.engine.cache`: a KV cache preallocated for rows x capacity and written by
  slot, so accepting or rejecting draft tokens moves nothing but a length; cropping a cache
  and moving a tree's accepted path into place;
- :mod:`specforge.engine.target`: the target's forward over a bounded set of shapes (token
  counts and key spans), eager or compiled once (``torch.compile`` on a CPU, CUDA graphs on a
  GPU) and reused, returning the logits and the auxiliary hidden states the draft reads;
- :mod:`specforge.engine.graphs`: CUDA graphs of an eager forward, one captured per shape and
  replayed;
- :mod:`specforge.engine.draft`: a chain's draft forwards (extensions and steps) over a slot
  cache of their own, replayed as CUDA graphs on a GPU;
- :mod:`specforge.engine.batch`: continuous batching over a row-slot cache whose decode steps
  replay CUDA graphs (what self-distillation uses on a GPU);
- :mod:`specforge.engine.prompt_lookup`: prompt-lookup decoding (n-gram proposals verified
  by the target's engine), the free baseline the bench measures a draft against;
- :mod:`specforge.engine.generation`: continuous batching (rows join and leave a running
  batch), sampling (temperature, nucleus), the automatic rows in flight;
- :mod:`specforge.engine.cpu`: the CPU kernels (decode attention, prepacked and row-planned
  linears, int8 linears), one optional part below the models.

The KV cache types the model forwards themselves read and write (the draft's in-place cache,
HF cache helpers) live in :mod:`specforge.models.kv_cache`, below, since ``models`` uses them.
"""
