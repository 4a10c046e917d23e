"""The integration-fault gate: an engine whose acceptance falls far below the reference evaluator's on the same
prompts and k is serving the drafter wrong (layer ids, norms, vocabulary map), not serving a weak drafter.

Both sides are summaries with ``tau`` and ``per_position`` (unconditional rates), as ``expman.evaluation.evaluate``
writes them and ``AcceptanceCounters.summary()`` returns them. The thresholds are parameters because how loud a fault is
depends on the drafter: measured here, aux ids shifted by one cost a weak SmolLM2 drafter only ~10 % of τ, while a
permuted order or a larger shift is a clear fault. ``hidden_state_parity`` checks the engine's captured target states
against the training features directly, which catches such shifts regardless of drafter quality.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from expman.errors import ExpmanError

if TYPE_CHECKING:
    import torch

__all__ = ["FaultVerdict", "HiddenStateParity", "hidden_state_parity", "integration_fault"]


@dataclass(frozen=True)
class FaultVerdict:
    """The gate's outcome: fault or not, one line per tripped check, and engine τ / reference τ."""

    fault: bool
    reasons: list[str]
    tau_ratio_measured: float


def _summary_values(summary: Mapping[str, Any], side: str) -> tuple[float, list[float]]:
    for key in ("tau", "per_position"):
        if key not in summary:
            raise ExpmanError(f"integration fault gate: the {side} summary has no {key!r}")
    if not summary["per_position"]:
        raise ExpmanError(f"integration fault gate: the {side} summary's per_position is empty")
    tau = float(summary["tau"])
    if tau < 1:
        raise ExpmanError(f"integration fault gate: the {side} tau {tau:g} is below 1 (tau counts the bonus token)")
    return tau, [float(rate) for rate in summary["per_position"]]


def integration_fault(
    reference: Mapping[str, Any], engine: Mapping[str, Any], tau_ratio: float = 0.8, position0_ratio: float = 0.5
) -> FaultVerdict:
    """Fault when engine τ < ``tau_ratio`` × reference τ or the engine's position-0 rate < ``position0_ratio`` × the
    reference's (same prompts, same k)."""
    reference_tau, reference_positions = _summary_values(reference, "reference")
    engine_tau, engine_positions = _summary_values(engine, "engine")
    if len(reference_positions) != len(engine_positions):
        raise ExpmanError(
            f"integration fault gate: reference has k={len(reference_positions)} positions, engine "
            f"k={len(engine_positions)}; compare the same k"
        )
    reasons = []
    tau_threshold = tau_ratio * reference_tau
    if engine_tau < tau_threshold:
        reasons.append(
            f"engine tau {engine_tau:.3f} < {tau_ratio:g} x reference tau {reference_tau:.3f} = {tau_threshold:.3f}"
        )
    position0_threshold = position0_ratio * reference_positions[0]
    if engine_positions[0] < position0_threshold:
        reasons.append(
            f"engine position-0 rate {engine_positions[0]:.3f} < {position0_ratio:g} x reference "
            f"{reference_positions[0]:.3f} = {position0_threshold:.3f}"
        )
    return FaultVerdict(fault=bool(reasons), reasons=reasons, tau_ratio_measured=engine_tau / reference_tau)


@dataclass(frozen=True)
class HiddenStateParity:
    """Mean per-token cosine between engine and reference states, per layer id, and whether all reach the bar."""

    cosine_per_layer: dict[int, float]
    min_cosine: float

    @property
    def passed(self) -> bool:
        return all(cosine >= self.min_cosine for cosine in self.cosine_per_layer.values())


def hidden_state_parity(
    engine_states: Mapping[int, torch.Tensor], reference_states: Mapping[int, torch.Tensor], min_cosine: float = 0.99
) -> HiddenStateParity:
    """Compare target hidden states captured by an engine with the training features, layer id by layer id
    (tensors [tokens, hidden] for the same tokens); an off-by-one layer id shows up as a low cosine."""
    if set(engine_states) != set(reference_states):
        raise ExpmanError(
            f"hidden-state parity: engine layers {sorted(engine_states)} differ from reference layers "
            f"{sorted(reference_states)}"
        )
    cosine_per_layer = {}
    for layer in sorted(reference_states):
        engine, reference = engine_states[layer].double(), reference_states[layer].double()
        if engine.shape != reference.shape:
            raise ExpmanError(
                f"hidden-state parity: layer {layer} engine shape {tuple(engine.shape)} != reference "
                f"{tuple(reference.shape)}"
            )
        dot = (engine * reference).sum(-1)
        norms = (engine.norm(dim=-1) * reference.norm(dim=-1)).clamp_min(1e-12)
        cosine_per_layer[layer] = float((dot / norms).mean())
    return HiddenStateParity(cosine_per_layer=cosine_per_layer, min_cosine=min_cosine)
