"""Serving engines: vLLM (generation and the benchmark arms), SGLang, the engines' spec-decode counters."""
