"""The EAGLE-3 drafter's TTT unroll equals a brute-force per-position, per-step reference on a tiny case."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from expman.drafter.model import DocumentSpans, DrafterConfig, Eagle3Drafter

TINY_VERIFIER = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64,
    "vocab_size": 50,
    "hidden_act": "silu",
    "rope_theta": 10000.0,
}


def _drafter(norm_before_residual: bool = False, verifier: dict = TINY_VERIFIER) -> Eagle3Drafter:
    torch.manual_seed(0)
    config = DrafterConfig.from_verifier(verifier, draft_vocab_size=20, aux_layer_ids=[2, 4, 5])
    config = DrafterConfig(**{**config.__dict__, "norm_before_residual": norm_before_residual})
    model = Eagle3Drafter(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.3) if parameter.dim() == 2 else parameter.uniform_(0.5, 1.5)
    return model


def _brute_force(model: Eagle3Drafter, aux, step_ids, positions, documents) -> list[torch.Tensor]:
    """One query at a time, keys gathered by hand: step-0 causal within the document plus own earlier steps."""
    layer = model.layers[0]
    attention = layer.self_attn
    group = attention.heads // attention.kv_heads
    hidden = model.fc(aux[0])
    keys_by_step, values_by_step, logits = [], [], []
    for step, ids in enumerate(step_ids):
        normed = layer.hidden_norm(hidden)
        residual = normed if model.config.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(model.embed_tokens(ids[0])), normed], dim=-1)
        length = x.shape[0]
        q = attention.q_proj(x).view(length, attention.heads, -1).transpose(0, 1)[None]
        k = attention.k_proj(x).view(length, attention.kv_heads, -1).transpose(0, 1)[None]
        v = attention.v_proj(x).view(length, attention.kv_heads, -1).transpose(0, 1)[None]
        cos, sin = model.rotary_emb(x[None], positions + step)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys_by_step.append(k[0])
        values_by_step.append(v[0])
        out = torch.zeros(attention.heads, length, attention.head_dim)
        for t in range(length):
            own = [s for s in range(t + 1) if documents[0, s] == documents[0, t]]
            for head in range(attention.heads):
                kv = head // group
                keys = [keys_by_step[0][kv, s] for s in own] + [keys_by_step[j][kv, t] for j in range(1, step + 1)]
                vals = [values_by_step[0][kv, s] for s in own] + [values_by_step[j][kv, t] for j in range(1, step + 1)]
                scores = torch.stack(keys) @ q[0, head, t] / math.sqrt(attention.head_dim)
                out[head, t] = torch.softmax(scores, dim=0) @ torch.stack(vals)
        hidden = residual + attention.o_proj(out.transpose(0, 1).reshape(length, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits.append(model.lm_head(model.norm(hidden)))
    return logits


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_ttt_unroll_equals_brute_force(norm_before_residual: bool) -> None:
    model = _drafter(norm_before_residual)
    generator = torch.Generator().manual_seed(3)
    length, steps = 11, 3
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2]])  # three packed documents
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1]])
    aux = torch.randn(1, length, 3 * 16, generator=generator)
    step_ids = [torch.randint(0, 50, (1, length), generator=generator) for _ in range(steps)]
    with torch.no_grad():
        fast = model(aux, step_ids, positions, documents)
        slow = _brute_force(model, aux, step_ids, positions, documents)
    for step in range(steps):
        torch.testing.assert_close(fast[step][0], slow[step], rtol=1e-5, atol=1e-5)


def test_ttt_unroll_gradients_equal_brute_force() -> None:
    """The per-document attention's backward (CPU training) equals autograd through the brute-force reference."""
    generator = torch.Generator().manual_seed(4)
    documents = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2]])
    aux = torch.randn(1, 10, 3 * 16, generator=generator)
    step_ids = [torch.randint(0, 50, (1, 10), generator=generator) for _ in range(3)]
    weights = [torch.randn(1, 10, 20, generator=generator) for _ in range(3)]
    gradients = []
    for brute_force in (False, True):
        model = _drafter(norm_before_residual=True)
        inputs = (aux, step_ids, positions, documents)
        outputs = _brute_force(model, *inputs) if brute_force else model(*inputs)
        sum((logits.reshape(1, 10, 20) * w).sum() for logits, w in zip(outputs, weights, strict=True)).backward()
        gradients.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys() and "layers.0.self_attn.k_proj.weight" in gradients[0]
    for name, grad in gradients[0].items():
        torch.testing.assert_close(grad, gradients[1][name], rtol=1e-4, atol=1e-5, msg=name)


def test_document_spans_of_a_packed_row_with_padding() -> None:
    spans = DocumentSpans.of(torch.tensor([[0, 0, 1, 2, 2, 2, -1, -1]]))
    assert spans.spans == ((0, 2, False), (2, 3, False), (3, 6, False), (6, 8, True))
    with pytest.raises(ValueError, match="one row"):
        DocumentSpans.of(torch.zeros(2, 4, dtype=torch.long))


def _packed_inputs(length: int, sizes: list[int], generator: torch.Generator, verifier: dict = TINY_VERIFIER) -> tuple:
    documents = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)] + [torch.full((length - sum(sizes),), -1)])
    positions = torch.cat([torch.arange(n) for n in sizes] + [torch.zeros(length - sum(sizes), dtype=torch.long)])
    aux = torch.randn(1, length, 3 * verifier["hidden_size"], generator=generator)
    step_ids = [torch.randint(0, verifier["vocab_size"], (1, length), generator=generator) for _ in range(3)]
    return aux, step_ids, positions[None], documents[None]


@pytest.mark.parametrize("length", [256, 200])
def test_flex_block_masks_give_the_dense_mask_result(length: int) -> None:
    """The block-sparse flex path (CUDA training) equals the per-document path, padding included (flex pads the
    row to its block size; the per-document path gets a padding run at the row's end)."""
    model = _drafter()
    aux, step_ids, positions, documents = _packed_inputs(length, [70, 100, 25], torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model(aux, step_ids, positions, documents)
        model.use_flex_attention()
        flex = model(aux, step_ids, positions, documents)
    real = documents[0] >= 0
    for step in range(3):
        assert flex[step].shape == dense[step].shape
        torch.testing.assert_close(flex[step][0, real], dense[step][0, real], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_compiled_cuda_training_step_matches_eager_gradients() -> None:
    """The compiled training loss with flex attention gives the eager dense path's loss and gradients."""
    from expman.drafter.objective import Packed, VerifierHead, compiled_ttt_loss, ttt_loss

    verifier = TINY_VERIFIER | {"hidden_size": 64, "intermediate_size": 128}  # flex's kernels need head_dim >= 16
    generator = torch.Generator().manual_seed(2)
    aux, step_ids, positions, documents = _packed_inputs(384, [200, 150], generator, verifier)
    hidden, vocab = verifier["hidden_size"], verifier["vocab_size"]
    batch = Packed(
        aux=aux,
        final=torch.randn(1, 384, hidden, generator=generator),
        top1=torch.randint(0, vocab, (1, 384), generator=generator),
        input_ids=step_ids[0],
        loss_mask=documents >= 0,
        document_ids=documents,
        position_ids=positions,
    ).to("cuda")
    draft_rows = torch.randn(_drafter(verifier=verifier).config.draft_vocab_size, hidden, generator=generator)
    head = VerifierHead(torch.randn(vocab, hidden), torch.ones(hidden), 1e-5, draft_rows).to("cuda")
    results = []
    for compiled in (False, True):
        model = _drafter(verifier=verifier).cuda().train()
        model.t2d[: model.config.draft_vocab_size] = True
        if compiled:
            model.use_flex_attention()
        loss, _ = (compiled_ttt_loss() if compiled else ttt_loss)(model, head, batch, steps=3, step_decay=0.8)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-4, atol=1e-4)
    assert eager_grads.keys() == compiled_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-3, atol=1e-4, msg=name)
