"""Serving engines, below ``expman.data``: the generation and serving interfaces (``generation``, ``serving``), vLLM
(generation, hidden states, benchmark arms), SGLang (benchmark arms), the engines' spec-decode counters."""
