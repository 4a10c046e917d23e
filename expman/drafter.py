"""The EAGLE-3 draft model and its training-time test (TTT) unroll.

Architecture (names follow the speculators checkpoint format): ``fc`` (3H→H, no bias) fuses the three aux
states; each decoder layer is a Llama layer, the first of which attends over 2H inputs (the normed token
embedding concatenated with the normed hidden state); ``norm`` then ``lm_head`` over the draft vocab. The token
embedding is the verifier's, frozen. ``d2t``/``t2d`` map draft ids to target ids and back.

TTT: step 0 runs on the verifier's features; step k feeds the drafter's own step k-1 output back in, with
position ids advanced by k. A query at position t of step k attends to step-0 keys at positions <= t of its own
document (causal) and to the keys of steps 1..k at position t itself (the diagonal): exactly what the drafter
sees at inference, where its own k earlier drafts sit in the KV cache after the real context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

__all__ = ["DrafterConfig", "Eagle3Drafter", "ttt_attention_mask"]


@dataclass(frozen=True)
class DrafterConfig:
    """Everything that fixes the drafter's shapes and its contract with the verifier."""

    layer: dict[str, Any]
    """Llama config of the draft decoder layer(s) (speculators' ``transformer_layer_config``); its
    ``vocab_size`` is the target vocab."""
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]
    """Verifier layers whose states feed ``fc``, in HF ``hidden_states`` ids (= vLLM/speculators ids)."""
    norm_before_residual: bool = False
    """False: the residual is the raw hidden state (speculators' and SpecForge's default). vLLM assumes True
    when the key is missing, so exports always write it."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def llama(self) -> LlamaConfig:
        return LlamaConfig(**self.layer)

    @classmethod
    def from_verifier(
        cls, verifier: dict[str, Any], draft_vocab_size: int, aux_layer_ids: list[int], num_layers: int = 1
    ) -> DrafterConfig:
        """A drafter shaped like one layer of a Llama-style verifier (HF config.json as a dict)."""
        keys = (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "max_position_embeddings",
            "vocab_size",
            "hidden_act",
        )
        layer = {k: verifier[k] for k in keys if k in verifier}
        layer["head_dim"] = verifier.get("head_dim") or verifier["hidden_size"] // verifier["num_attention_heads"]
        layer["rope_parameters"] = verifier.get("rope_parameters") or {
            "rope_type": "default",
            "rope_theta": verifier.get("rope_theta", 10000.0),
        }
        layer.update(num_hidden_layers=num_layers, tie_word_embeddings=False, model_type="llama")
        return cls(layer=layer, draft_vocab_size=draft_vocab_size, aux_layer_ids=tuple(aux_layer_ids))


class DraftAttention(nn.Module):
    """Llama attention whose q/k/v read ``in_features`` (2H in the first layer) and that keeps per-step K/V."""

    def __init__(self, config: LlamaConfig, in_features: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(in_features, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], cache: list, mask: torch.Tensor
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        cache.append((k, v))
        keys = torch.cat([c[0] for c in cache], dim=2)
        values = torch.cat([c[1] for c in cache], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DraftLayer(nn.Module):
    """A Llama decoder layer; the first one takes ``cat(input_layernorm(embed), hidden_norm(hidden))``."""

    def __init__(self, config: LlamaConfig, first: bool, norm_before_residual: bool):
        super().__init__()
        hidden = config.hidden_size
        self.first = first
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        if first:
            self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, 2 * hidden if first else hidden)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        cache: list,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        if self.first:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        else:
            residual, x = hidden, self.input_layernorm(hidden)
        hidden = residual + self.self_attn(x, cos_sin, cache, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def ttt_attention_mask(document_ids: torch.Tensor, step: int) -> torch.Tensor:
    """Boolean mask [B, 1, T, (step+1)·T]: causal within a document over step 0, the diagonal over steps 1..step.

    ``document_ids`` [B, T] numbers packed documents; -1 marks padding (which attends only to itself, so no row
    is empty; padding never reaches the loss).
    """
    length = document_ids.shape[1]
    positions = torch.arange(length, device=document_ids.device)
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    causal = same_document & (positions[None, None, :] <= positions[None, :, None])
    diagonal = torch.eye(length, dtype=torch.bool, device=document_ids.device).expand_as(causal)
    padding = (document_ids < 0)[:, :, None]
    causal = (causal & ~padding) | (diagonal & padding)
    return torch.cat([causal, *([diagonal] * step)], dim=-1)[:, None]


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 draft model; ``forward`` runs the TTT unroll and returns logits per step."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        layer = config.llama
        hidden = layer.hidden_size
        self.embed_tokens = nn.Embedding(layer.vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(
            DraftLayer(layer, first=i == 0, norm_before_residual=config.norm_before_residual)
            for i in range(layer.num_hidden_layers)
        )
        self.norm = LlamaRMSNorm(hidden, eps=layer.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(layer)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(layer.vocab_size, dtype=torch.bool))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(
        self,
        aux_hidden_states: torch.Tensor,
        step_input_ids: list[torch.Tensor],
        position_ids: torch.Tensor,
        document_ids: torch.Tensor,
    ) -> list[torch.Tensor]:
        """TTT unroll over ``len(step_input_ids)`` steps.

        aux_hidden_states [B, T, 3H]; step_input_ids[k] [B, T] the target-vocab token fed at step k (the
        token after each position, shifted by k); position_ids [B, T]. Returns draft-vocab logits per step.
        """
        hidden = self.fc(aux_hidden_states)
        caches: list[list] = [[] for _ in self.layers]
        logits = []
        for step, input_ids in enumerate(step_input_ids):
            embeds = self.embed_tokens(input_ids)
            cos_sin = self.rotary_emb(hidden, position_ids + step)
            mask = ttt_attention_mask(document_ids, step)
            for index, layer in enumerate(self.layers):
                hidden = layer(hidden, embeds if index == 0 else None, cos_sin, caches[index], mask)
            logits.append(self.lm_head(self.norm(hidden)))
        return logits

    def decode(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        caches: list[list],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inference: run the layers on ``hidden`` [1, n, H] (``fc(aux)`` for context positions, the previous
        output for a draft step) with the tokens after each position; K/V are appended to ``caches`` (one list
        per layer). Returns the last layer's output (pre-norm), which the next draft step takes as ``hidden``."""
        embeds = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb(hidden, position_ids)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, embeds if index == 0 else None, cos_sin, caches[index], mask)
        return hidden

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))
