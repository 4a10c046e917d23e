"""Peer check against the field's library: speculators 0.9.0 loads expman's checkpoint and computes the same TTT
logits on the same inputs; a checkpoint speculators writes imports into expman with the same outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from expman.checkpoint import load_drafter, save_speculators
from expman.drafter import DrafterConfig, Eagle3Drafter

speculators_eagle3 = pytest.importorskip("speculators.models.eagle3")

LENGTH = 256  # speculators' flex-attention block masks want multiples of 128


def _ours(verifier: Path) -> Eagle3Drafter:
    config = DrafterConfig.from_verifier(json.loads((verifier / "config.json").read_text()), 64, [2, 4, 5])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config).eval()
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.normal_(0, 0.3) if parameter.dim() == 2 else parameter.uniform_(0.5, 1.5)
        chosen = torch.arange(0, 400, 400 // 64)[:64]
        drafter.t2d.zero_()
        drafter.t2d[chosen] = True
        drafter.d2t.copy_(chosen - torch.arange(64))
    return drafter


def _inputs(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(1, LENGTH, 3 * hidden, generator=generator), torch.randint(
        0, 400, (1, LENGTH), generator=generator
    )


def _their_logits(model, aux: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    with torch.no_grad():
        model(hidden_states=aux, input_ids=ids, document_ids=torch.zeros_like(ids), ttt_steps=3)
    hook.remove()
    return captured


def _our_logits(model: Eagle3Drafter, aux: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    # speculators 0.9.0 teacher-forces step k with the ids shifted left by k; positions start at 1
    steps = [torch.cat([ids[:, k:], ids.new_zeros(1, k)], dim=-1) for k in range(3)]
    positions = 1 + torch.arange(LENGTH)[None]
    with torch.no_grad():
        return model(aux, steps, positions, torch.zeros_like(ids))


def test_speculators_loads_our_checkpoint_and_agrees(tiny_verifier_source: Path, tmp_path: Path) -> None:
    ours = _ours(tiny_verifier_source)
    save_speculators(ours, tmp_path / "ours", str(tiny_verifier_source), ["LlamaForCausalLM"], speculative_tokens=3)
    theirs = speculators_eagle3.Eagle3DraftModel.from_pretrained(str(tmp_path / "ours")).eval()
    assert list(theirs.config.eagle_aux_hidden_state_layer_ids) == [2, 4, 5]
    aux, ids = _inputs(32)
    for step, (mine, peer) in enumerate(zip(_our_logits(ours, aux, ids), _their_logits(theirs, aux, ids), strict=True)):
        torch.testing.assert_close(mine, peer, rtol=1e-4, atol=1e-4, msg=f"TTT step {step}")


def test_checkpoint_written_by_speculators_imports(tiny_verifier_source: Path, tmp_path: Path) -> None:
    save_speculators(_ours(tiny_verifier_source), tmp_path / "ours", str(tiny_verifier_source), ["LlamaForCausalLM"], 3)
    theirs = speculators_eagle3.Eagle3DraftModel.from_pretrained(str(tmp_path / "ours")).eval()
    theirs.save_pretrained(str(tmp_path / "theirs"))
    imported = load_drafter(tmp_path / "theirs").eval()
    aux, ids = _inputs(32)
    for mine, peer in zip(_our_logits(imported, aux, ids), _their_logits(theirs, aux, ids), strict=True):
        torch.testing.assert_close(mine, peer, rtol=1e-4, atol=1e-4)
