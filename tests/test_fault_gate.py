"""The integration-fault gate on τ and position-0 rates, and hidden-state parity on hand-made tensors."""

from __future__ import annotations

import pytest
import torch

from expman.errors import ExpmanError
from expman.evaluation.fault_gate import hidden_state_parity, integration_fault

# The peer drafter measured in vLLM CPU (DESIGN.md, Engines): tau 1.355 at k=3.
REFERENCE = {"tau": 1.355, "per_position": [0.26, 0.07, 0.025]}


def test_a_weak_engine_is_a_fault_with_numbers():
    engine = {"tau": 1.06, "per_position": [0.1, 0.02, 0.0]}
    verdict = integration_fault(REFERENCE, engine)
    assert verdict.fault
    assert verdict.tau_ratio_measured == pytest.approx(1.06 / 1.355)
    assert verdict.reasons == [
        "engine tau 1.060 < 0.8 x reference tau 1.355 = 1.084",
        "engine position-0 rate 0.100 < 0.5 x reference 0.260 = 0.130",
    ]


def test_half_the_tau_is_a_fault():
    verdict = integration_fault({"tau": 2.0, "per_position": [0.6, 0.3, 0.1]}, {"tau": 1.0, "per_position": [0.0] * 3})
    assert verdict.fault and verdict.tau_ratio_measured == 0.5


def test_close_to_the_reference_passes():
    verdict = integration_fault(REFERENCE, {"tau": 0.95 * 1.355, "per_position": [0.24, 0.06, 0.02]})
    assert not verdict.fault and verdict.reasons == []
    assert verdict.tau_ratio_measured == pytest.approx(0.95)


def test_position_zero_alone_can_trip_the_gate():
    verdict = integration_fault(REFERENCE, {"tau": 1.3, "per_position": [0.12, 0.1, 0.08]})
    assert verdict.fault
    assert verdict.reasons == ["engine position-0 rate 0.120 < 0.5 x reference 0.260 = 0.130"]


def test_thresholds_are_parameters():
    # An aux-id shift by one cost the weak drafter ~10 % of tau: the default gate lets it pass, a tight one not.
    shifted = {"tau": 1.308, "per_position": [0.23, 0.06, 0.02]}
    assert not integration_fault(REFERENCE, shifted).fault
    assert integration_fault(REFERENCE, shifted, tau_ratio=0.98).fault


def test_malformed_summaries_are_named():
    with pytest.raises(ExpmanError, match="engine summary has no 'per_position'"):
        integration_fault(REFERENCE, {"tau": 1.3})
    with pytest.raises(ExpmanError, match="reference has k=3 positions, engine k=2"):
        integration_fault(REFERENCE, {"tau": 1.3, "per_position": [0.2, 0.1]})
    with pytest.raises(ExpmanError, match="engine tau 0.3 is below 1"):
        integration_fault(REFERENCE, {"tau": 0.3, "per_position": [0.2, 0.1, 0.0]})


def test_hidden_state_parity_flags_a_shifted_layer():
    generator = torch.Generator().manual_seed(0)
    layers = {i: torch.randn(5, 16, generator=generator) for i in (2, 15, 27, 28)}
    reference = {i: layers[i] for i in (2, 15, 27)}
    same = {i: layers[i] + 1e-4 * torch.randn(5, 16, generator=generator) for i in (2, 15, 27)}
    parity = hidden_state_parity(same, reference)
    assert parity.passed
    assert all(c == pytest.approx(1, abs=1e-6) for c in parity.cosine_per_layer.values())
    shifted = {**same, 27: layers[28]}
    parity = hidden_state_parity(shifted, reference)
    assert not parity.passed
    assert parity.cosine_per_layer[27] < 0.9 and parity.cosine_per_layer[2] > 0.99


def test_hidden_state_parity_names_mismatched_layers_and_shapes():
    state = torch.ones(3, 4)
    with pytest.raises(ExpmanError, match=r"engine layers \[2\] differ from reference layers \[3\]"):
        hidden_state_parity({2: state}, {3: state})
    with pytest.raises(ExpmanError, match=r"layer 2 engine shape \(3, 4\) != reference \(2, 4\)"):
        hidden_state_parity({2: state}, {2: torch.ones(2, 4)})
