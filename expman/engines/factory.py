"""The serving engine ``benchmark.engine`` names, behind the interface of ``expman.engines.serving``. A module of its
own: the implementations import that interface, and only the benchmark stage needs all of them."""

from __future__ import annotations

from expman.engines.serving import ServingEngine
from expman.errors import ExpmanError

__all__ = ["serving_engine"]

ENGINES = ("vllm", "sglang")


def serving_engine(name: str) -> ServingEngine:
    """vLLM's offline ``LLM`` or an SGLang server; the engine itself is imported only when an arm runs."""
    if name == "vllm":
        from expman.engines.vllm import VllmEngine

        return VllmEngine()
    if name == "sglang":
        from expman.engines.sglang import SglangEngine

        return SglangEngine()
    raise ExpmanError(f"benchmark.engine: no serving engine {name!r} (one of {', '.join(ENGINES)})")
