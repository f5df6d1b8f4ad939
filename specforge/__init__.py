"""specforge: train EAGLE-3 draft models for speculative decoding, export them for SGLang and
vLLM, and measure their accept length."""

__version__ = "0.1.0"
