"""The one interface a serving engine offers the benchmark stage and its integration-fault gate.

An engine runs timed arms (greedy, one batch, with or without an EAGLE-3 drafter at chain length k), reads the
speculative-decoding counters of an arm's timed batch, and, where it can, returns the verifier's hidden states at
given layer ids for the parity check; ``states_unsupported`` says why it cannot. The implementations are vLLM's
offline ``LLM`` (``expman.engines.vllm``) and an SGLang server (``expman.engines.sglang``);
``expman.engines.factory.serving_engine`` picks the one ``benchmark.engine`` names. Nothing here imports an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from expman.engines.metrics import AcceptanceCounters

__all__ = ["ArmResult", "ArmSetup", "ServingEngine"]


@dataclass(frozen=True)
class ArmSetup:
    """What every arm of one benchmark shares: the verifier, the prompts (token ids), the output length, the
    precision, the seed, whether the engine compiles, and whether the verifier's code may run."""

    model_dir: Path
    prompts: list[list[int]]
    max_new_tokens: int
    device: str
    dtype: str
    seed: int
    trust_remote_code: bool
    compile: bool


@dataclass
class ArmResult:
    """What one arm gave: output ids per prompt, wall time of the timed batch, the engine's settings, and its raw
    counter record of that batch (engine-specific; ``ServingEngine.acceptance`` reads it)."""

    outputs: list[list[int]]
    seconds: float
    settings: dict[str, Any]
    raw: dict[str, Any]


class ServingEngine(Protocol):
    """A serving engine as the benchmark stage drives it."""

    name: str
    states_unsupported: str | None
    """Why ``hidden_states`` cannot run in this engine; None when it can."""

    def version(self) -> str | None:
        """The installed engine and its version, None when unknown."""
        ...

    def run_arm(self, setup: ArmSetup, drafter_dir: Path | None, k: int) -> ArmResult:
        """Every prompt greedy in one timed batch after a warm-up request, in a fresh engine; with ``drafter_dir``,
        EAGLE-3 speculation with a chain of ``k`` drafts."""
        ...

    def acceptance(self, arm: ArmResult) -> AcceptanceCounters:
        """The spec-decode counters of the arm's timed batch: rounds, drafted and accepted tokens, and the rounds
        that accepted each draft position."""
        ...

    def hidden_states(
        self,
        model_dir: Path,
        layer_ids: Sequence[int],
        prompts: Sequence[Sequence[int]],
        device: str,
        dtype: str,
        trust_remote_code: bool,
    ) -> list[Any]:
        """One [T, len(layer_ids), H] tensor per prompt: the verifier's states as the engine computes them, HF
        ``hidden_states`` ids (id N: the last layer before the final norm)."""
        ...
