"""Peer check against the field's library: speculators 0.9.0 loads expman's checkpoint and computes the same TTT
logits on the same inputs; a checkpoint speculators writes imports into expman with the same outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from expman.drafter.checkpoint import load_drafter, save_speculators
from expman.drafter.model import DrafterConfig, Eagle3Drafter

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


def test_first_step_loss_equals_speculators_loss(tiny_verifier_source: Path, tmp_path: Path) -> None:
    """Loss parity: from the same weights (ported through the speculators checkpoint) and the same batch, each TTT
    step's loss equals speculators' own KL loss plus the targets' entropy (expman minimises the soft cross-entropy,
    which differs from the KL only by that constant). speculators' data are one position ahead of expman's:
    its input ids and verifier states at t are expman's at t+1, and its loss mask marks the predicting position
    where expman's marks the predicted token."""
    from speculators.losses import resolve_loss_config

    from expman.drafter.objective import Packed, VerifierHead, metric_values, ttt_loss

    ours = _ours(tiny_verifier_source)
    save_speculators(ours, tmp_path / "ours", str(tiny_verifier_source), ["LlamaForCausalLM"], speculative_tokens=3)
    theirs = speculators_eagle3.Eagle3DraftModel.from_pretrained(str(tmp_path / "ours")).eval()
    head = VerifierHead.load(tiny_verifier_source, ours.t2d)
    with torch.no_grad():
        theirs.verifier_lm_head.weight.copy_(head.lm_head)
        theirs.verifier_norm.weight.copy_(head.norm_weight)
    aux, ids = _inputs(32)
    generator = torch.Generator().manual_seed(3)
    final = torch.randn(1, LENGTH, 32, generator=generator)
    in_vocab = torch.nonzero(ours.t2d).flatten()
    top1 = in_vocab[torch.randint(0, len(in_vocab), (1, LENGTH), generator=generator)]
    positions = torch.arange(LENGTH)[None]
    batch = Packed(aux, final, top1, ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros_like(ids), positions)
    with torch.no_grad():
        mine = metric_values(ttt_loss(ours, head, batch, steps=3, step_decay=1.0)[1])
        ahead = torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=-1)
        their_mask = torch.arange(LENGTH)[None] <= LENGTH - 3
        _, _, peer = theirs(
            hidden_states=aux,
            input_ids=ahead,
            document_ids=torch.zeros_like(ids),
            loss_mask=their_mask,
            position_ids=positions,
            verifier_last_hidden_states=torch.cat([final[:, 1:], final.new_zeros(1, 1, 32)], dim=1),
            ttt_steps=3,
            ttt_step_loss_decay=1.0,
            loss_config=resolve_loss_config("kl_div", "eager"),  # the fused default is a Triton (GPU) kernel
        )
        probs = head.target_probs(final[0])
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    for k in range(3):
        scored = entropy[1 + k : LENGTH - 1]  # the targets of positions t = 0 .. LENGTH-3-k
        assert mine[f"positions_{k}"] == len(scored)
        kl = mine[f"loss_{k}"] - float(scored.mean())
        assert kl == pytest.approx(float(peer[f"loss_{k}_sum"]), rel=1e-4, abs=1e-5), f"TTT step {k}"
