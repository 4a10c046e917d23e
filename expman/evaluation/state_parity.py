"""Hidden-state parity for the benchmark stage's fault verdict: the states the engine computes at the layers a
served checkpoint names, against the states its drafter was trained on (the capture contract in its manifest,
recomputed by transformers for the same held-out prompts).

This catches what the engine's acceptance may hide: aux ids off by one between engines cost a weak drafter only
~10 % of τ, but the states at the wrong layer are far from the trained ones; a drafter whose features held the
post-norm final state gets the engine's pre-norm one (vLLM's id N is the last layer before the final norm).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from expman.engines.serving import ServingEngine

__all__ = ["served_state_parity"]


def _served_and_trained(arms: dict[str, Path]) -> dict[str, tuple[list[int], dict[str, Any]] | None]:
    """Per arm: (aux ids its checkpoint serves, the capture contract of its features); None when it was imported
    (no features here to hold it to)."""
    from expman.drafter.checkpoint import read_checkpoint

    pairs: dict[str, tuple[list[int], dict[str, Any]] | None] = {}
    for name, folder in arms.items():
        manifest = json.loads((folder / "manifest.json").read_text())
        contract = manifest.get("contract")
        served = list(read_checkpoint(folder)[1].aux_layer_ids)
        pairs[name] = None if contract is None or manifest.get("source") else (served, contract)
    return pairs


def _reference_states(verifier_dir: Path, prompts: list[list[int]], device: str, dtype: Any) -> dict[Any, Any]:
    """transformers' states for the prompts, one at a time: id k (0 = embeddings, k = output of layer k-1) for
    k < N, and the last layer's output before (``pre_norm``) and after (``post_norm``) the final norm."""
    import torch

    from expman.data.verifier import load_verifier

    model = load_verifier(verifier_dir, device, dtype)
    base = model.get_decoder()
    kept: list[Any] = []
    hook = base.layers[-1].register_forward_hook(
        lambda _m, _i, out: kept.append(out[0] if isinstance(out, tuple) else out)
    )
    per_prompt = []
    with torch.inference_mode():
        for prompt in prompts:
            kept.clear()
            out = base(input_ids=torch.tensor([prompt], device=device), output_hidden_states=True, use_cache=False)
            states = {k: h[0].float().cpu() for k, h in enumerate(out.hidden_states[:-1])}
            states["pre_norm"], states["post_norm"] = kept[0][0].float().cpu(), out.last_hidden_state[0].float().cpu()
            per_prompt.append(states)
    hook.remove()
    return {key: torch.cat([states[key] for states in per_prompt]) for key in per_prompt[0]}


def served_state_parity(
    engine: ServingEngine,
    verifier_dir: Path,
    arms: dict[str, Path],
    prompts: list[list[int]],
    device: str,
    dtype: str,
    trust_remote_code: bool,
    min_cosine: float,
) -> dict[str, dict[str, Any]]:
    """Per arm: mean cosine per trained layer (and the final state) between the engine's states at the served
    ids and the trained features' states, and one reason per layer below ``min_cosine`` (empty: parity holds).
    One engine start serves every arm: it captures the union of their served ids and the final id N. An engine
    that cannot capture states leaves every arm unchecked, ``not measured`` and why."""
    import torch

    from expman.evaluation.fault_gate import hidden_state_parity

    if engine.states_unsupported:
        return {name: {"checked": False, "why": f"not measured: {engine.states_unsupported}"} for name in arms}
    pairs = _served_and_trained(arms)
    checked = {name: pair for name, pair in pairs.items() if pair is not None}
    results: dict[str, dict[str, Any]] = {
        name: {"checked": False, "why": "imported: no capture contract to hold it to"}
        for name, pair in pairs.items()
        if pair is None
    }
    if not checked:
        return results
    final = next(iter(checked.values()))[1]["final_layer"]
    ids = sorted({i for served, _ in checked.values() for i in served} | {final})
    captured = torch.cat(engine.hidden_states(verifier_dir, ids, prompts, device, dtype, trust_remote_code)).float()
    reference = _reference_states(verifier_dir, prompts, device, getattr(torch, dtype))
    for name, (served, contract) in checked.items():
        trained = contract["aux_layers"]
        engine_states = {t: captured[:, ids.index(s)] for s, t in zip(served, trained, strict=True)}
        engine_states[final] = captured[:, ids.index(final)]
        reference_states = {t: reference[t] for t in trained} | {final: reference[contract["final_state"]]}
        parity = hidden_state_parity(engine_states, reference_states, min_cosine)
        reasons = [
            f"hidden-state parity: the engine's states at {_label(layer, served, trained, final)} have mean cosine "
            f"{cosine:.4f} < {min_cosine:g} with the trained features' {_trained_label(layer, contract, final)}"
            for layer, cosine in parity.cosine_per_layer.items()
            if cosine < min_cosine
        ]
        results[name] = {"checked": True, "cosine_per_layer": parity.cosine_per_layer, "reasons": reasons}
    return results


def _label(layer: int, served: list[int], trained: list[int], final: int) -> str:
    if layer == final:
        return f"id {final} (the last layer, before the final norm)"
    return f"aux id {served[trained.index(layer)]} (served by the checkpoint)"


def _trained_label(layer: int, contract: dict[str, Any], final: int) -> str:
    return f"final state ({contract['final_state']})" if layer == final else f"layer {layer}"
