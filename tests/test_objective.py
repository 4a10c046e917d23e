"""The training objective: verifier targets, position alignment and masking, and that it trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from expman.data.extract import CaptureHooks
from expman.drafter.model import DrafterConfig, Eagle3Drafter
from expman.drafter.objective import Packed, VerifierHead, metric_values, simulated_tau, ttt_loss
from expman.errors import ExpmanError


@pytest.fixture(scope="module")
def verifier(tiny_verifier_source: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_verifier_source, dtype=torch.float32).eval()


def _document(verifier, length: int, prompt: int, seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, verifier.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    capture = CaptureHooks(verifier, [2, 4, 5], "pre_norm")
    with torch.no_grad():
        aux, final, top1 = capture(ids, torch.ones_like(ids))
    capture.remove()
    mask = torch.zeros(length, dtype=torch.bool)
    mask[prompt:] = True
    return {
        "input_ids": ids[0],
        "loss_mask": mask,
        "aux_hidden_states": aux[0],
        "final_hidden_states": final[0],
        "verifier_top1": top1[0],
    }


def _drafter(verifier, source: Path, full_vocab: bool) -> tuple[Eagle3Drafter, VerifierHead]:
    """A drafter over every target id or 64 of them, and the verifier head holding that draft vocab's rows."""
    vocab = verifier.config.vocab_size
    size = vocab if full_vocab else 64
    chosen = torch.arange(size) if full_vocab else torch.arange(0, vocab, vocab // 64)[:size]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    head = VerifierHead.load(source, t2d)
    config = DrafterConfig.from_verifier(verifier.config.to_dict(), size, [2, 4, 5])
    torch.manual_seed(0)
    drafter = Eagle3Drafter(config)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(head.embed)
        drafter.t2d.copy_(t2d)
        drafter.d2t.copy_(chosen - torch.arange(size))
        drafter.lm_head.weight.copy_(head.lm_head)
    return drafter, head


def test_head_reproduces_verifier_logits(verifier, tiny_verifier_source: Path) -> None:
    head = VerifierHead.load(tiny_verifier_source)
    document = _document(verifier, 12, 4, seed=1)
    with torch.no_grad():
        expected = verifier(input_ids=document["input_ids"][None]).logits[0]
    torch.testing.assert_close(head.logits(document["final_hidden_states"]), expected, rtol=0, atol=1e-4)


def test_valid_positions_follow_the_alignment(verifier, tiny_verifier_source: Path) -> None:
    drafter, head = _drafter(verifier, tiny_verifier_source, full_vocab=True)
    documents = [_document(verifier, 10, 4, seed=2), _document(verifier, 7, 2, seed=3)]
    metrics = metric_values(ttt_loss(drafter, head, Packed.of(documents), steps=3, step_decay=1.0)[1])
    for k in range(3):
        # step k predicts x_{t+2+k}: assistant tokens at index >= 2+k of each document, never across documents
        expected = sum(int(d["loss_mask"][2 + k :].sum()) for d in documents)
        assert metrics[f"positions_{k}"] == expected


def test_padding_a_batch_changes_neither_loss_nor_metrics(verifier, tiny_verifier_source: Path) -> None:
    """The compiled CUDA loss sees every batch padded to one length; the padding must stay out of the loss."""
    drafter, head = _drafter(verifier, tiny_verifier_source, full_vocab=False)
    batch = Packed.of([_document(verifier, 10, 4, seed=4), _document(verifier, 9, 2, seed=5)])
    padded = batch.padded(32)
    assert padded.input_ids.shape == (1, 32) and padded.aux.shape[:2] == (1, 32)
    loss, tracked = ttt_loss(drafter, head, batch, steps=3, step_decay=0.8)
    padded_loss, padded_tracked = ttt_loss(drafter, head, padded, steps=3, step_decay=0.8)
    torch.testing.assert_close(padded_loss, loss)
    metrics, padded_metrics = metric_values(tracked), metric_values(padded_tracked)
    assert padded_metrics.keys() == metrics.keys()
    for name, value in metrics.items():
        assert padded_metrics[name] == pytest.approx(value, rel=1e-5), name


def test_objective_trains(verifier, tiny_verifier_source: Path) -> None:
    drafter, head = _drafter(verifier, tiny_verifier_source, full_vocab=False)
    batch = Packed.of([_document(verifier, 40, 5, seed=s) for s in range(4)])
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(60):
        loss, tracked = ttt_loss(drafter, head, batch, steps=2, step_decay=0.8)
        metrics = metric_values(tracked)
        first = first or metrics
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert drafter.embed_tokens.weight.grad is None  # the embedding stays frozen
    # the soft targets of a random verifier are high-entropy: the loss floor is far above 0, accuracy is not
    assert metrics["loss"] < 0.8 * first["loss"]
    assert first["acc_0"] < 0.2 and metrics["acc_0"] > 0.9 and metrics["cond_acc_1"] > 0.9


def test_simulated_tau() -> None:
    assert simulated_tau([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert simulated_tau([1.0, 0.0, 1.0], 3) == 2.0
    assert simulated_tau([0.3, 0.4], 1) == pytest.approx(1.3)


def test_draft_rows_give_the_verifier_distribution_over_the_draft_vocab(verifier, tiny_verifier_source: Path) -> None:
    final = _document(verifier, 30, 4, seed=7)["final_hidden_states"]
    t2d = torch.zeros(verifier.config.vocab_size, dtype=torch.bool)
    t2d[::5] = True
    full = VerifierHead.load(tiny_verifier_source).logits(final)
    probs = VerifierHead.load(tiny_verifier_source, t2d).target_probs(final)
    torch.testing.assert_close(probs, torch.softmax(full[:, t2d], dim=-1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ExpmanError, match="lm_head.weight has"):
        VerifierHead.load(tiny_verifier_source, t2d[1:])
