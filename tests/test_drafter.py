"""The EAGLE-3 drafter's TTT unroll equals a brute-force per-position, per-step reference on a tiny case."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from expman.drafter import DrafterConfig, Eagle3Drafter, ttt_attention_mask

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


def _drafter(norm_before_residual: bool = False) -> Eagle3Drafter:
    torch.manual_seed(0)
    config = DrafterConfig.from_verifier(TINY_VERIFIER, draft_vocab_size=20, aux_layer_ids=[2, 4, 5])
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


def test_mask_shape_and_padding_rows_never_empty() -> None:
    documents = torch.tensor([[0, 0, 1, -1, -1]])
    mask = ttt_attention_mask(documents, step=2)
    assert mask.shape == (1, 1, 5, 15)
    assert mask.any(dim=-1).all()
    assert mask[0, 0, 2, :5].tolist() == [False, False, True, False, False]  # a new document starts fresh
    assert mask[0, 0, 1, 5:].nonzero().flatten().tolist() == [1, 6]  # its own position in steps 1 and 2
    assert not mask[0, 0, 0, 3:5].any()  # real tokens never see padding
