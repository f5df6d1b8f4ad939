"""Serving: export for SGLang/vLLM, the speculative runtime and the accept-length benchmark
(export/runtime issue)."""
