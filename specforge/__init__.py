"""specforge: train EAGLE-3 draft models for speculative decoding, export them for SGLang and
vLLM, and measure their accept length.

Importing the package applies one process-wide setting, before any matmul runs (an environment
value the user set wins): ``ONEDNN_PRIMITIVE_CACHE_CAPACITY=16``. oneDNN (PyTorch's CPU matmul
library) caches a compiled primitive per matmul shape, 1,024 by default; training's shapes
change with every sequence length, so on CPU that cache grew a run's memory by about 1 GB per
100 steps, while 16 entries cost no speed here. Stages run from the CLI, from Python and from
``benchmarks/`` all get it.
"""

import os

__version__ = "0.1.0"

ONEDNN_PRIMITIVE_CACHE_CAPACITY = "16"

os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_PRIMITIVE_CACHE_CAPACITY)
