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

import functools
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

__all__ = ["DocumentSpans", "DrafterConfig", "Eagle3Drafter", "ttt_block_masks"]

FLEX_BLOCK = 128
"""Token block of flex attention's sparse masks; the flex path pads a batch to a multiple of it."""


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
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], cache: list, mask: Any
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        cache.append((k, v))
        grouped = self.kv_heads != self.heads
        if isinstance(mask, DocumentSpans):
            out = mask.attend(q, cache, grouped)
        else:
            keys = torch.cat([c[0] for c in cache], dim=2)
            values = torch.cat([c[1] for c in cache], dim=2)
            if isinstance(mask, torch.Tensor) or mask is None:
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=grouped)
            else:
                out = _flex_attention(q.is_cuda)(q, keys, values, block_mask=mask, enable_gqa=grouped)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


@functools.cache
def _flex_attention(compiled: bool) -> Any:
    """flex_attention, compiled into one fused kernel on CUDA (eager it is a slow reference, used on CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if compiled else flex_attention


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
        mask: Any,
    ) -> torch.Tensor:
        x, residual = self.attention_input(hidden, embeds)
        return self.feed_forward(residual, self.self_attn(x, cos_sin, cache, mask))

    def attention_input(self, hidden: torch.Tensor, embeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual): the norms, and for the first layer the concatenation with the embedding."""
        if self.first:
            normed = self.hidden_norm(hidden)
            residual = normed if self.norm_before_residual else hidden
            return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual
        return self.input_layernorm(hidden), hidden

    def feed_forward(self, residual: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        hidden = residual + attention
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


@dataclass(frozen=True)
class DocumentSpans:
    """A packed row's documents as ``(start, end, padding)`` runs, for the TTT unroll without a [T, (k+1)·T] mask.

    Each document attends only within itself: causal over step 0 (``is_causal``, so the kernel skips the upper
    half), its own position over steps 1..k. The attention then costs Σ n² over the documents instead of
    (k+1)·T² over the row: on 2 CPU cores and 1,024-token rows of about four documents, 0.62 of a 2.35 s step
    went to the masked row-wide attention (docs/performance.md, "The training step"); the quality preset's train
    stage went from 2.07 to 1.60 s a step (benchmarks/results/quality_cpu_avx2.json). A padding run (id -1)
    attends only to itself, so no query is left without a key; padding never reaches the loss.
    """

    spans: tuple[tuple[int, int, bool], ...]

    @classmethod
    def of(cls, document_ids: torch.Tensor) -> DocumentSpans:
        """The runs of equal ids in ``document_ids`` [1, T] (one packed row; documents are contiguous)."""
        if document_ids.shape[0] != 1:
            raise ValueError(f"packed batches are one row, got {document_ids.shape[0]}")
        ids = document_ids[0]
        bounds = [0, *(torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist(), len(ids)]
        padding = (ids[bounds[:-1]] < 0).tolist()
        return cls(tuple(zip(bounds[:-1], bounds[1:], padding, strict=True)))

    def attend(self, q: torch.Tensor, cache: list, grouped: bool) -> torch.Tensor:
        """Attention of step ``len(cache) - 1``'s queries ``q`` [1, heads, T, d] over ``cache``'s (k, v) per step."""
        step = len(cache) - 1
        outputs = []
        for start, end, padding in self.spans:
            keys = torch.cat([k[:, :, start:end] for k, _ in cache], dim=2)
            values = torch.cat([v[:, :, start:end] for _, v in cache], dim=2)
            causal = step == 0 and not padding
            mask = None if causal else _span_mask(end - start, step, padding, q.device)
            outputs.append(
                F.scaled_dot_product_attention(
                    q[:, :, start:end], keys, values, attn_mask=mask, is_causal=causal, enable_gqa=grouped
                )
            )
        return torch.cat(outputs, dim=2)


def _span_mask(length: int, step: int, padding: bool, device: torch.device) -> torch.Tensor:
    """[n, (step+1)·n]: causal (a padding run: only itself) over step 0, the diagonal over steps 1..step."""
    diagonal = torch.eye(length, dtype=torch.bool, device=device)
    first = diagonal if padding else torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return torch.cat([first, *([diagonal] * step)], dim=-1)


def _padded_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """[P] document ids of row 0, padded with -1 to a multiple of the flex block."""
    ids = document_ids[0]
    return F.pad(ids, (0, -len(ids) % FLEX_BLOCK), value=-1)


def ttt_block_masks(document_ids: torch.Tensor, steps: int) -> list[Any]:
    """Flex-attention block masks of the TTT unroll, one per step (the same pattern as ``DocumentSpans``).

    ``document_ids`` [1, P] with P a multiple of FLEX_BLOCK. Step 0 is document-causal (built by
    ``create_block_mask``, which skips blocks across documents); step k appends, per query block, the one key
    block of each later step that holds its diagonal, so the cost of a step beyond 0 is one block per row.
    """
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    documents = document_ids[0]
    length = len(documents)
    if length % FLEX_BLOCK:
        raise ValueError(f"flex masks need a multiple of {FLEX_BLOCK} tokens, got {length}")

    def mask_mod(_batch: Any, _head: Any, query: Any, key: Any) -> Any:
        position = key % length
        same_document = (documents[query] == documents[position]) & (documents[query] >= 0)
        return ((key < length) & same_document & (position <= query)) | (position == query)

    base = create_block_mask(mask_mod, None, None, length, length, device=documents.device)
    rows = length // FLEX_BLOCK
    masks = [base]
    for step in range(1, steps):
        batch, heads, _, _ = base.kv_indices.shape
        later = rows * torch.arange(1, step + 1, device=documents.device)
        diagonal = (torch.arange(rows, device=documents.device)[:, None] + later[None, :]).expand(batch, heads, -1, -1)
        indices = torch.cat([base.kv_indices, base.kv_indices.new_zeros(batch, heads, rows, rows * step)], dim=-1)
        slots = base.kv_num_blocks[..., None].long() + torch.arange(step, device=documents.device)
        indices.scatter_(-1, slots, diagonal.to(indices.dtype))
        full = base.full_kv_indices
        if full is not None:
            full = torch.cat([full, full.new_zeros(batch, heads, rows, rows * step)], dim=-1)
        masks.append(
            BlockMask.from_kv_blocks(
                base.kv_num_blocks + step,
                indices,
                base.full_kv_num_blocks,
                full,
                BLOCK_SIZE=base.BLOCK_SIZE,
                mask_mod=mask_mod,
                seq_lengths=(length, length * (step + 1)),
            )
        )
    return masks


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
        # "sdpa" per document (CPU training, eager CUDA), or "flex" with block-sparse masks (compiled CUDA training)
        self.attention = "sdpa"

    def use_flex_attention(self) -> None:
        """Block-sparse flex attention over packed documents: the CUDA training path, where the whole training
        loss is compiled around it (``objective.compiled_ttt_loss``)."""
        self.attention = "flex"

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

        One packed row: aux_hidden_states [1, T, 3H]; step_input_ids[k] [1, T] the target-vocab token fed at step
        k (the token after each position, shifted by k); position_ids and document_ids [1, T]. Returns
        draft-vocab logits per step. With flex attention the row is padded to a multiple of FLEX_BLOCK and the
        logits cut back.
        """
        length = aux_hidden_states.shape[1]
        if self.attention == "flex":
            pad = -length % FLEX_BLOCK
            aux_hidden_states = F.pad(aux_hidden_states, (0, 0, 0, pad))
            step_input_ids = [F.pad(ids, (0, pad)) for ids in step_input_ids]
            position_ids = F.pad(position_ids, (0, pad))
            masks = ttt_block_masks(_padded_documents(document_ids)[None], len(step_input_ids))
        else:
            masks = [DocumentSpans.of(document_ids)] * len(step_input_ids)
        hidden = self.fc(aux_hidden_states)
        caches: list[list] = [[] for _ in self.layers]
        logits = []
        for step, input_ids in enumerate(step_input_ids):
            embeds = self.embed_tokens(input_ids)
            cos_sin = self.rotary_emb(hidden, position_ids + step)
            for index, layer in enumerate(self.layers):
                hidden = layer(hidden, embeds if index == 0 else None, cos_sin, caches[index], masks[step])
            logits.append(self.draft_logits(hidden)[:, :length])
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
