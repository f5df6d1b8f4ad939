"""specforge: train EAGLE-3 draft models for speculative decoding, export them for SGLang and
vLLM, and measure their accept length.

Importing the package changes nothing in the process: the settings a stage needs (oneDNN's
primitive cache, the machine's resolution of ``auto`` values) are applied when the stage starts
(:mod:`specforge.recipes.stage`).
"""

__version__ = "0.1.0"
